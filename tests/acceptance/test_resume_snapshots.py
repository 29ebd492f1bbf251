"""`dcp-lens run --resume` reads its snapshots field by field: a string or a bool where a number
belongs (a count, a k of the grid, a maximum) is refused in one line naming the snapshot file
and the field, the folder is left as it was, and the untouched snapshot still resumes to the
numbers an uninterrupted run gives."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from dcp_lens.cli import main
from dcp_lens.utils.folders import RESERVED

SMALL = ["--n-eval", "16", "--n-calibration", "16", "--bootstrap", "5", "--probe", "none"]
EVERY = ["--checkpoint-every", "1", "--batch-size", "8"]


def run_argv(out: Path, *extra: str) -> list[str]:
    return [
        "run",
        "--model",
        "planted:readout_shift",
        *SMALL,
        *EVERY,
        "--quiet",
        "--out",
        str(out),
        *extra,
    ]


def tree(folder: Path) -> dict[str, str]:
    """Every file below ``folder`` (relative path -> content hash) but the folder contract's
    own records (each command, refused or not, is recorded in them)."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.name not in RESERVED
    }


def numbers(folder: Path) -> list[dict[str, Any]]:
    """results.json's runs without their metadata (the time and place of the run)."""
    runs = json.loads((folder / "results.json").read_text())["runs"]
    return [{key: value for key, value in run.items() if key != "metadata"} for run in runs]


def stopped_at(out: Path, point: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A run stopped after the snapshot at ``point`` ("STAGE:BATCHES"); that snapshot's file."""
    import dcp_lens.utils.snapshots as snapshots

    def stop(at: str) -> None:
        if at == point:
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(snapshots, "die_if_asked", stop)
        assert main(run_argv(out)) == 130
    stage = point.split(":")[0]
    return next((out / ".checkpoints").rglob(f"{stage}.rank*.pt"))


def first_count(state: dict[str, Any], value: object) -> str:
    """Set the first source's first group's sample count to ``value``; the field's name."""
    label = next(label for label, groups in state["streams"].items() if groups is not None)
    state["streams"][label][0]["count"] = value
    return f"state.streams[{label!r}][0].count"


def halves_difference(state: dict[str, Any], value: object) -> str:
    state["null"]["halves_difference"] = value
    return "state.null.halves_difference"


def a_k(state: dict[str, Any], value: object) -> str:
    """Turn the k of the first cell's key into ``value`` (a k of the grid names a cell)."""
    key, chunks = state["values"][0]
    state["values"][0] = ((*key[:2], value), chunks)
    return "state.values[0] key"


TAMPERS: dict[str, tuple[str, Callable[[dict[str, Any], object], str]]] = {
    "calibration count": ("calibration:1", first_count),
    "evaluation maximum": ("evaluation.0:1", halves_difference),
    "evaluation k": ("evaluation.0:1", a_k),
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The numbers of the same run, never stopped."""
    out = tmp_path_factory.mktemp("whole") / "out"
    assert main(run_argv(out)) == 0
    return numbers(out)


@pytest.mark.parametrize("tamper", sorted(TAMPERS))
def test_a_string_or_bool_in_a_snapshot_is_refused_and_the_run_still_resumes(
    capsys, tmp_path, monkeypatch, uninterrupted, tamper
):
    point, change = TAMPERS[tamper]
    out = tmp_path / "out"
    snapshot = stopped_at(out, point, monkeypatch)
    original = snapshot.read_bytes()
    for value in ("8", True):
        saved = torch.load(snapshot, weights_only=True)
        field = change(saved["state"], value)
        torch.save(saved, snapshot)
        before = tree(out)
        capsys.readouterr()
        assert main(run_argv(out, "--resume")) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert str(snapshot) in err and f"field {field} must be" in err, err
        assert f"(got {value!r})" in err and "without --resume" in err, err
        assert tree(out) == before  # no snapshot, result or marker written or removed
        snapshot.write_bytes(original)
    assert main(run_argv(out, "--resume")) == 0
    assert numbers(out) == uninterrupted != []
