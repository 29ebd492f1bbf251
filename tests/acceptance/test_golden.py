"""Golden results: a refactor that means to change no number changes none.

`readout_shift.json` is ``dcp-lens run --model planted:readout_shift --n-eval 64
--n-calibration 64 --bootstrap 50`` (the probe on) as written by the commit that last changed
what a run computes, with each run's ``metadata`` (timings, environment) removed. A change that
is meant to move numbers regenerates it and says why in its commit::

    dcp-lens run --model planted:readout_shift --n-eval 64 --n-calibration 64 \
        --bootstrap 50 --quiet --out out/golden
    python tests/acceptance/golden/strip.py out/golden/results.json \
        tests/acceptance/golden/readout_shift.json

The slow test compares ``dcp-lens validate --seed 0`` with docs/data/validation_seed0.json the
same way (``pytest -m slow tests/acceptance/test_golden.py``, about ten minutes).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dcp_lens.protocol.config import ProtocolConfig
from dcp_lens.studies.run import RunOptions, run

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from compare_results import IGNORED, compare  # noqa: E402

ROOT = HERE.parents[1]
# Float32 sums on another CPU may round differently; anything a refactor breaks moves a number
# by far more than this.
TOLERANCE = 1e-6


def _compared(golden: Path, produced: Path, ignored: tuple[str, ...] = IGNORED) -> dict:
    with golden.open() as file:
        before = json.load(file)
    with produced.open() as file:
        after = json.load(file)
    return compare(before, after, ignored)


def test_a_planted_run_gives_the_golden_numbers(tmp_path):
    run(
        tmp_path / "run",
        model="planted:readout_shift",
        config=ProtocolConfig(n_bootstrap=50),
        options=RunOptions(n_eval=64, n_calibration=64, progress=False),
    )
    result = _compared(HERE / "golden" / "readout_shift.json", tmp_path / "run" / "results.json")
    assert result["numbers"] > 1000, result  # the whole record was compared
    assert not result["structural"], result["structural"][:10]
    assert result["max_abs_diff"] <= TOLERANCE, result


@pytest.mark.slow
def test_validation_at_seed_0_gives_the_committed_numbers(tmp_path):
    out = tmp_path / "validate"
    command = [sys.executable, "-m", "dcp_lens", "validate", "--quiet", "--seed", "0"]
    subprocess.run([*command, "--out", str(out)], check=True, cwd=tmp_path)
    # The run's own cost (time, peak memory) is measured, not computed: not compared.
    result = _compared(
        ROOT / "docs" / "data" / "validation_seed0.json",
        out / "validation.json",
        (*IGNORED, "seconds", "peak_rss_mib"),
    )
    assert not result["structural"], result["structural"][:10]
    assert result["max_abs_diff"] <= TOLERANCE, result
