"""DepthControlProtocol: planted factors recovered, null control, fast path = hook path, errors."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_every_map_matches_hooks, lm_sets, make_model

from dcp_lens import load
from dcp_lens.protocol.calibration import CALIBRATION_MAPS
from dcp_lens.protocol.conditions import SWEEP
from dcp_lens.protocol.dcp import DepthControlProtocol, EvaluationSet
from dcp_lens.protocol.metrics import METRICS, per_example_metrics
from dcp_lens.zoo import planted

N = 384  # sequences of 8 scored positions per split


@pytest.mark.parametrize("name", ["readout_shift", "distinct_computation", "block_count"])
def test_planted_factor_carries_the_gap(name):
    model = load(f"planted:{name}", seed=1)
    task = model.planted_task
    protocol = DepthControlProtocol(
        model, metrics=("accuracy",), n_bootstrap=300, probe="none", progress=False
    )
    results = protocol.run(task.evaluation(N), task.calibration(N))
    shares = results.decompositions["accuracy"].shares
    factor = planted.EXPECTED_FACTOR[name]
    assert shares[factor] >= 0.9, shares
    assert shares[f"{factor}_lo"] > 0.0, shares
    for other in {"S", "B", "D"} - {factor}:
        assert shares[other] <= 0.1, shares
    table = results.table()
    gap = table["gap"].to_numpy()
    assert abs(table["S"] + table["B"] + table["D"] - gap).max() <= 1e-9


def test_probe_separates_truncated_states_on_the_readout_shift_model():
    model = planted.readout_shift(seed=2)
    task = model.planted_task
    protocol = DepthControlProtocol(model, metrics=("accuracy",), n_bootstrap=50, progress=False)
    results = protocol.run(task.evaluation(N), task.calibration(N))
    probe = results.probe
    assert 0.4 <= probe["reference_auroc"] <= 0.6
    trajectory = {row["iteration"]: row for row in probe["trajectory"]}
    assert trajectory[1]["auroc"] >= 0.95 and trajectory[1]["mahalanobis"] > 3
    assert trajectory[model.n_iterations]["mahalanobis"] == pytest.approx(1.0, abs=0.2)
    assert probe["s_rank_correlation"] > 0.5  # the probe orders the k's as S(k) does
    for row in probe["calibrate_truncate"]:  # calibration matches the moments by construction
        assert row["mahalanobis"] == pytest.approx(1.0, abs=0.2), row


def test_null_control_reproduces_full_depth_in_float64():
    model = make_model(injection="concat_adapter")  # float64
    evaluation, calibration = lm_sets(model)
    protocol = DepthControlProtocol(model, n_bootstrap=20, probe="none", progress=False)
    results = protocol.run(evaluation, calibration)
    null = results.null_control
    assert null["max_abs_logit_diff"] <= 1e-5
    assert null["shift_at_r_max_abs_logit_diff"] <= 1e-5
    # calibrate(full) fits the reference onto itself: the identity up to float error, since the
    # Ledoit-Wolf shrinkage is the same on both sides and cancels.
    assert null["calibrate_full_max_abs_logit_diff"] <= 1e-5
    row = results.table().query("k == 4")
    assert (row[["gap", "S", "B", "D"]].abs() <= 1e-9).all().all()


@pytest.mark.parametrize("dense", [False, True])
def test_fast_path_equals_hook_path_for_every_condition_map_and_metric(dense):
    model = make_model(n_core=0, n_prelude=4, n_coda=0) if dense else make_model()
    evaluation, calibration = lm_sets(model)
    checked = assert_every_map_matches_hooks(
        model, calibration, evaluation.tokens[:6], mixture_components=2
    )
    assert {*CALIBRATION_MAPS, *SWEEP, *METRICS} <= set(checked)


def test_dense_model_runs_with_replay_marked_not_realizable():
    model = make_model(n_core=0, n_prelude=3, n_coda=1)
    evaluation, calibration = lm_sets(model)
    protocol = DepthControlProtocol(
        model, metrics=("cross_entropy", "kl_to_full"), n_bootstrap=20, progress=False
    )
    results = protocol.run(evaluation, calibration)
    assert results.architecture == "dense" and results.n_iterations == 4
    assert results.replay_realizable is False
    assert results.to_results_json()["replay_realizable"] is False


def test_non_finite_states_are_reported_per_condition_not_raised():
    model = make_model()
    evaluation, calibration = lm_sets(model)
    with torch.no_grad():  # every state overflows: nothing can be fitted or read out
        model.embed.W_E.mul_(1e300)
    protocol = DepthControlProtocol(model, metrics=("cross_entropy",), n_bootstrap=20)
    results = protocol.run(evaluation, calibration)
    flagged = results.nonfinite()
    assert set(flagged["condition"]) == {"full", *tuple(SWEEP)}
    assert len(flagged) == 1 + len(tuple(SWEEP)) * len(protocol.context.k_grid)
    assert "truncate(1)" in results.metadata["calibration_failures"]
    assert results.table()["gap"].isna().all()


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("where", [(1, 2), (1, 2, 3)])  # a whole position, or one logit of it
def test_a_non_finite_readout_marks_only_its_examples(bad, where):
    logits = torch.randn(3, 4, 7, dtype=torch.float64)
    reference = logits.log_softmax(-1)
    logits[where] = bad
    targets = torch.randint(0, 7, (3, 4))
    targets[1, 2] = 0 if where == (1, 2, 3) else targets[1, 2]  # not the -inf token itself
    scores = per_example_metrics(logits, reference, targets, METRICS)
    for metric in METRICS:
        assert scores[metric][[0, 2]].isfinite().all(), metric
        # One logit at -inf is a token of probability 0: the cross-entropy of another is finite.
        if (metric, bad, where) != ("cross_entropy", float("-inf"), (1, 2, 3)):
            assert not scores[metric][1].isfinite(), metric


def test_bad_input_is_a_clear_error():
    model = make_model()
    evaluation, calibration = lm_sets(model)
    with pytest.raises(ValueError, match=r"k=5 is outside \[1, r=4\]"):
        DepthControlProtocol(model, k_grid=[1, 5])
    with pytest.raises(ValueError, match="empty"):
        EvaluationSet.from_tokens(torch.zeros(0, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="overlaps"):
        DepthControlProtocol(model, progress=False).run(evaluation, evaluation)
    with pytest.raises(ValueError, match="scored position 9 is outside the sequence"):
        EvaluationSet.from_tokens(evaluation.tokens[:2], scored_positions=[[1, 9], [0, 2]])
    with pytest.raises(ValueError, match="accuracy.*needs answers"):
        DepthControlProtocol(model, metrics=("accuracy",), progress=False).run(
            evaluation, calibration
        )
    with pytest.raises(ValueError, match="metrics"):
        DepthControlProtocol(model, metrics=("perplexity",))
    protocol = DepthControlProtocol(model, progress=False)
    with pytest.raises(RuntimeError, match="fit the calibrations"):
        protocol.condition_logits(evaluation.tokens[:2], "shift", 2)
