"""The planted nuisance models (`dcp_lens.zoo.planted.nuisance`) against the translators' gate:
judged by what the readout reads, the translator of a readout shift in a stream of mostly
unpredictable content is kept (summed over every coordinate it was replaced), and a translator
that only predicts content the readout ignores gives way to the mean (summed over every
coordinate it was kept). The whole runs end right: S named on the shift, D bounded as not
affine with no field claiming a factor on the computation."""

from __future__ import annotations

import pytest
import torch

from dcp_lens import DepthControlProtocol
from dcp_lens.protocol import fit
from dcp_lens.protocol.gate import KEPT, REPLACED, judge, ridge_scale
from dcp_lens.protocol.states import capture_states
from dcp_lens.zoo import planted

N = 256  # 2048 calibration positions: the translators' whole budget
FOLDS = 10


def _states(name: str, k: int) -> tuple[planted.PlantedModel, torch.Tensor, torch.Tensor]:
    model = planted.load_planted(name, seed=0)
    calibration = model.planted_task.calibration(N)
    with torch.no_grad():
        states, _ = capture_states(model, calibration.tokens)
    d = model.cfg.d_model
    return model, states[k].reshape(-1, d), states[-1].reshape(-1, d)


def _summed_state_error(source: torch.Tensor, target: torch.Tensor) -> tuple[float, float]:
    """The held-out squared error over every coordinate of the refits (the gate's smallest
    ridge) and of the other folds' mean: the rule the gate replaced."""
    group = torch.arange(source.shape[0]) // 8 % FOLDS  # by sequence, as the example keys
    fitted = mean = 0.0
    for g in range(FOLDS):
        held = group == g
        ridge = 1e-4 * ridge_scale(source[~held])
        refit = fit._least_squares(source[~held], target[~held], ridge)
        assert refit is not None
        fitted += float(((refit(source[held]) - target[held]) ** 2).sum())
        mean += float(((target[~held].mean(0) - target[held]) ** 2).sum())
    return fitted, mean


def _judged(model: planted.PlantedModel, source: torch.Tensor, target: torch.Tensor) -> str:
    group = torch.arange(source.shape[0]) // 8 % FOLDS
    return judge(source, target, group, FOLDS, fit._state_readout_of(model)).judged


def test_a_shift_beside_unpredictable_content_keeps_its_translator() -> None:
    model, source, target = _states("nuisance_shift", 3)
    fitted, mean = _summed_state_error(source, target)
    assert fitted > mean  # judged on every coordinate, the translator would be replaced
    assert _judged(model, source, target) == KEPT


def test_a_translator_of_ignored_content_only_gives_way_to_the_mean() -> None:
    model, source, target = _states("nuisance_distinct", 3)
    fitted, mean = _summed_state_error(source, target)
    assert fitted < mean  # judged on every coordinate, the translator would be kept
    assert _judged(model, source, target) == REPLACED


def _run(name: str, width: int | None = None) -> dict:
    model = planted.load_planted(name, seed=0, width=width)
    task = model.planted_task
    protocol = DepthControlProtocol(
        model, metrics=("accuracy",), n_bootstrap=100, probe="none", progress=False, seed=0
    )
    results = protocol.run(task.evaluation(N), task.calibration(N)).to_results_json()
    return results["runs"][0] if "runs" in results else results


# None: as built (158 and 64 coordinates); 512: embedded in a stream of 512 by a random rotation
# with more unread content (`dcp_lens.zoo.planted.embedding`).
WIDTHS = [None, 512]


@pytest.mark.slow
@pytest.mark.parametrize("width", WIDTHS)
def test_the_shift_in_a_wide_stream_is_named_with_every_translator_kept(width: int | None) -> None:
    run = _run("nuisance_shift", width)
    gate = run["metadata"]["translator_gate"]
    assert len(gate) == 14 and {r["judged"] for r in gate.values()} == {KEPT}
    record = run["bracket"]["accuracy"]
    assert record["verdict"] == "S" and record["S_identified"] is True
    assert record["S_lower_lo"] - 0.05 <= 1.0 <= record["S_upper_hi"] + 0.05


@pytest.mark.slow
@pytest.mark.parametrize("width", WIDTHS)
def test_computation_beside_predictable_ignored_content_raises_no_s_alarm(
    width: int | None,
) -> None:
    run = _run("nuisance_distinct", width)
    assert len(run["metadata"]["translators_replaced_by_the_mean"]) == 14
    rows = [r for r in run["decomposition"] if r["metric"] == "accuracy" and r["k"] < 8]
    assert all(row["S_identified"] for row in rows)  # no per-k false alarm
    record = run["bracket"]["accuracy"]
    assert record["verdict"] == "inconclusive" and record["bound"] == "not_affine"
    assert record["S_identified"] is False and record["B_identified"] is False
    assert record["D_lower_lo"] - 0.05 <= 1.0 <= record["D_upper_hi"] + 0.05
