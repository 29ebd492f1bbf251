"""The notebooks under demos/ run top to bottom (as scripts, with DCP_DEMO_QUICK=1 sizes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
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
