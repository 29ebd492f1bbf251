"""The translators' held-out gate in a run: on a model whose states carry no affine information
about the answer the S bracket's upper end falls to the mean translator's base rate, with the
jackknife and without it; on a readout shift every translator is kept."""

from __future__ import annotations

import copy
import math

import pytest

from dcp_lens import DepthControlProtocol
from dcp_lens.protocol.gate import DEFAULT_RIDGE, UNTESTABLE, GateRecord
from dcp_lens.protocol.wording import verdict
from dcp_lens.zoo import planted

N = 128


def _run(name: str, groups: int) -> dict:
    model = planted.load_planted(name, seed=0)
    task = model.planted_task
    protocol = DepthControlProtocol(
        model,
        metrics=("accuracy",),
        n_bootstrap=50,
        probe="none",
        progress=False,
        seed=0,
        calibration_groups=groups,
    )
    results = protocol.run(task.evaluation(N), task.calibration(N)).to_results_json()
    return results["runs"][0] if "runs" in results else results


@pytest.mark.parametrize("groups", [10, 0])
def test_translators_without_information_give_way_to_the_mean(groups: int) -> None:
    run = _run("distinct_computation_context", groups)
    replaced = run["metadata"]["translators_replaced_by_the_mean"]
    gate = run["metadata"]["translator_gate"]
    assert {gate[label]["judged"] for label in replaced} == {"replaced_by_the_mean"}
    assert all(gate[label]["folds"] == 10 for label in replaced)
    assert {"truncate(1)", "replay(1)"} <= set(replaced)
    rows = [row for row in run["decomposition"] if row["metric"] == "accuracy" and row["k"] < 8]
    # The upper end is the mean translator's base-rate gain at every k: one small number.
    assert max(row["S_upper"] for row in rows) < 0.05
    # D bounded as not recovered by an affine map: the record claims neither factor.
    assert run["bracket"]["accuracy"]["bound"] == "not_affine"
    assert run["shares"]["accuracy"]["S_identified"] is False


@pytest.fixture(scope="module")
def readout_shift_run() -> dict:
    return _run("readout_shift", 10)


def test_a_readout_shift_keeps_every_translator(readout_shift_run: dict) -> None:
    run = readout_shift_run
    assert run["metadata"]["translators_replaced_by_the_mean"] == []
    assert run["shares"]["accuracy"]["verdict"] == "S"


def test_an_untested_translator_is_said_in_the_verdict_and_the_flags(
    readout_shift_run: dict,
) -> None:
    run = copy.deepcopy(readout_shift_run)
    text, flags = verdict(run, "accuracy")
    assert "could not be tested" not in text and not any("could not be tested" in f for f in flags)
    gate = run["metadata"]["translator_gate"]
    label = sorted(gate)[0]
    gate[label] = GateRecord(
        UNTESTABLE, DEFAULT_RIDGE, math.nan, math.nan, 0, 7, "one fold"
    ).record()
    text, flags = verdict(run, "accuracy")
    said = f"1 of {len(gate)} paired translators could not be tested on held-out data (one fold)"
    assert said in text and any(said in flag for flag in flags)


def test_a_pass_with_parked_groups_gives_the_same_results(monkeypatch) -> None:
    """On an accelerator the calibration groups wait on the host, one filled at a time, and the
    pass reads the split group by group: forced here on the CPU, the results equal the default
    pass's up to the float rounding of the moments' sums."""
    import json

    import torch

    from dcp_lens.protocol import fit

    def run() -> dict:
        model = planted.load_planted("readout_shift", seed=0)
        task = model.planted_task
        protocol = DepthControlProtocol(
            model, n_bootstrap=50, probe="none", progress=False, seed=0, batch_size=8
        )
        results = protocol.run(task.evaluation(96), task.calibration(96)).to_results_json()
        return json.loads(json.dumps(results))

    default = run()
    monkeypatch.setattr(fit, "moments_host", lambda context: torch.device("cpu"))
    parked = run()
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "acceptance"))
    from compare_results import compare

    result = compare(default, parked)
    assert not result["structural"], result["structural"][:5]
    assert result["numbers"] > 1000 and result["max_abs_diff"] < 1e-4, result
