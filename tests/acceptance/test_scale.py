"""Past one process: data parallel under torchrun (gloo, 2 CPU processes) against one process,
and `dcp-lens run --resume` after a SIGKILL at three points against an uninterrupted run."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from dcp_lens.cli import main
from dcp_lens.utils.files import MARKER
from dcp_lens.utils.snapshots import KILL_VARIABLE

RUN = ["run", "--model", "planted:readout_shift", "--n-calibration", "32", "--batch-size", "8"]
RUN += ["--quiet", "--dtype", "float64"]


def _dcp_lens(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "dcp_lens", *args],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _largest_difference(a: Any, b: Any, path: str = "") -> float:
    """max |a - b| over every number of two JSON documents of the same structure."""
    if isinstance(a, dict):
        assert set(a) == set(b), path
        return max([_largest_difference(a[k], b[k], f"{path}/{k}") for k in a], default=0.0)
    if isinstance(a, list):
        assert len(a) == len(b), path
        return max(
            [_largest_difference(x, y, path) for x, y in zip(a, b, strict=True)], default=0.0
        )
    if isinstance(a, float) and isinstance(b, float | int) and not isinstance(b, bool):
        if math.isnan(a) or math.isnan(b):
            assert math.isnan(a) and math.isnan(b), path
            return 0.0
        return abs(a - b)
    assert a == b, f"{path}: {a!r} != {b!r}"
    return 0.0


def test_torchrun_two_processes_match_one(tmp_path):
    args = [*RUN, "--n-eval", "64", "--n-calibration", "64", "--bootstrap", "50"]
    args += ["--probe", "none"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    launched = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "dcp_lens",
            *args,
            "--out",
            str(tmp_path / "two"),
        ],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    one = json.loads((tmp_path / "one" / "results.json").read_text())
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    assert one["runs"][0]["metadata"]["n_evaluation"] == 64
    # every decomposition cell, interval, null control and flag within 1e-6
    # The jackknife's group scatters are kept in float32, and two ranks add their batches in
    # another order than one process: their sums round differently (about 1e-6).
    assert _largest_difference(one, two) < 1e-5
    assert not (tmp_path / "two" / MARKER).exists()


RESUMED = [*RUN, "--n-eval", "32", "--bootstrap", "20", "--checkpoint-every", "1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run every resumed one must reproduce, byte for byte (one for the three kill points)."""
    reference = tmp_path_factory.mktemp("uninterrupted")
    assert main([*RESUMED, "--out", str(reference)]) == 0
    return reference


@pytest.mark.parametrize("kill_at", ["calibration:2", "evaluation.0:3", "model:1"])
def test_resume_after_sigkill_matches_an_uninterrupted_run(tmp_path, kill_at, uninterrupted):
    args, reference, resumed = RESUMED, uninterrupted, tmp_path / "resumed"
    killed = _dcp_lens([*args, "--out", str(resumed)], {KILL_VARIABLE: kill_at})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    # killed: marked incomplete, no results.json or report at the top
    assert (resumed / MARKER).is_file()
    assert not (resumed / "results.json").exists() and not (resumed / "report.html").exists()
    finished = _dcp_lens([*args, "--out", str(resumed), "--resume"])
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert (resumed / "results.json").read_bytes() == (reference / "results.json").read_bytes()
    assert (resumed / "report.html").is_file() and not (resumed / MARKER).exists()
    assert not (resumed / ".checkpoints").exists()


def test_a_finished_folder_is_not_overwritten_without_overwrite(tmp_path, capsys):
    args = [*RUN, "--n-eval", "16", "--n-calibration", "16", "--bootstrap", "0", "--probe", "none"]
    out = tmp_path / "run"
    assert main([*args, "--out", str(out)]) == 0
    before = (out / "results.json").read_bytes()
    assert main([*args, "--seed", "1", "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "results.json").read_bytes() == before
    assert main([*args, "--out", str(out), "--resume"]) == 0  # nothing left to do
    assert main([*args, "--seed", "1", "--out", str(out), "--overwrite"]) == 0
    assert (out / "results.json").read_bytes() != before


def test_resume_refuses_a_different_command(tmp_path, capsys):
    args = [*RUN, "--n-eval", "16", "--n-calibration", "16", "--bootstrap", "0", "--probe", "none"]
    out = tmp_path / "run"
    killed = _dcp_lens(
        [*args, "--out", str(out), "--checkpoint-every", "1"], {KILL_VARIABLE: "calibration:1"}
    )
    assert killed.returncode == -signal.SIGKILL
    assert main([*args, "--seed", "3", "--out", str(out), "--resume"]) == 2
    assert "seed" in capsys.readouterr().err
