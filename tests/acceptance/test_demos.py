"""The notebooks under demos/ run top to bottom (as scripts, with DCP_DEMO_QUICK=1 sizes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FAST = ["hooking_iterations", "dcp_on_your_model", "huginn_and_ouro"]
SLOW = ["readout_shift"]  # distils a retrofit and trains probe classifiers: about a minute


def run_demo(name: str) -> str:
    environment = {**os.environ, "DCP_DEMO_QUICK": "1", "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(
        [sys.executable, str(REPO / "demos" / f"{name}.py")],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return completed.stdout


@pytest.mark.parametrize("name", FAST)
def test_fast_demo_runs(name: str) -> None:
    assert run_demo(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_slow_demo_runs(name: str) -> None:
    assert "calibrated lens" in run_demo(name)


def test_every_demo_is_tested_and_has_its_executed_notebook() -> None:
    scripts = {path.stem for path in (REPO / "demos").glob("*.py")}
    notebooks = scripts - {"quickstart", "real_scale_configs", "retrofit_stories260k"}
    assert notebooks == set(FAST + SLOW)
    for name in notebooks:
        assert (REPO / "demos" / f"{name}.ipynb").is_file(), name


def test_gpu_check_script_runs_its_steps_on_a_toy_size(tmp_path: Path) -> None:
    """demos/gpu_check.sh (the GPU measurement) end to end on the CPU at a toy Huginn size: the
    bench JSON it writes holds the figures it prints, per million tokens and peak memory."""
    import json

    environment = {
        **os.environ, "DEVICE": "cpu", "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
        "BENCH_ARGS": "--d-model 96 --iterations 2 --vocab 128 --batch 1 --seq 8 --repeats 1",
    }  # fmt: skip
    completed = subprocess.run(
        ["bash", str(REPO / "demos" / "gpu_check.sh"), str(tmp_path)],
        cwd=REPO, env=environment, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr[-3000:]
    bench = json.loads((tmp_path / "bench_huginn_bf16.json").read_text())
    assert bench["preset"] == "huginn" and bench["dtype"] == "bfloat16"
    assert (bench["model"]["n_prelude"], bench["model"]["n_core"], bench["model"]["n_coda"]) == (
        2, 4, 2,
    )  # fmt: skip
    assert bench["model"]["n_layers"] == 2 + 4 * 2 + 2
    per_million = bench["sweep_seconds_per_million_tokens"]
    assert per_million == pytest.approx(1e6 / bench["sweep_tokens_per_second"])
    assert f"{per_million:.1f} s per 1M tokens" in completed.stdout
