"""The S bracket wired into the sweep (docs/bracket.md): `DepthControlProtocol.run` on planted
models reports brackets, identification read from them, and verdicts, in results.json."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import lm_sets, make_model, numbers_close, out_of_memory_from, result_numbers

import dcp_lens.protocol.sweep as sweep_module
from dcp_lens.protocol.budget import OutOfMemoryStop
from dcp_lens.protocol.conditions import SUBSAMPLED_CONTROLS
from dcp_lens.protocol.config import ProtocolConfig
from dcp_lens.protocol.dcp import DepthControlProtocol
from dcp_lens.protocol.evaluation_set import EvaluationSet
from dcp_lens.protocol.metrics import IGNORE_INDEX
from dcp_lens.protocol.results import ProtocolResults
from dcp_lens.protocol.wording import verdict
from dcp_lens.utils.errors import ConfigError
from dcp_lens.utils.snapshots import Checkpoint
from dcp_lens.zoo import planted

N = 256
SLACK = 0.05  # the truth's own sampling, as docs/bracket.md's evidence table allows


def run_planted(name: str, evaluation: EvaluationSet | None = None) -> dict:
    """One run of planted ``name`` on accuracy; its results.json run element (JSON round trip)."""
    model = planted.load_planted(name, seed=0)
    task = model.planted_task
    protocol = DepthControlProtocol(
        model, metrics=("accuracy",), n_bootstrap=100, probe="none", progress=False, seed=0
    )
    results = protocol.run(evaluation or task.evaluation(N), task.calibration(N))
    return json.loads(json.dumps(results.to_results_json()))


def test_the_new_conditions_are_curves_of_the_run():
    run = run_planted("readout_shift")
    conditions = {row["condition"] for row in run["curves"]}
    assert {"translate_truncate", "translate_replay", "base_rate"} <= conditions
    row = run["decomposition"][0]
    for key in ("S_lower", "S_upper", "S_lower_lo", "S_lower_hi", "S_upper_lo", "S_upper_hi"):
        assert isinstance(row[key], float), key
    assert row["S_lower"] <= row["S_upper"]
    # readout_shift: S only, identified, the bracket narrow at S = 1.
    shares = run["shares"]["accuracy"]
    assert shares["verdict"] == "S" and shares["S_identified"] and shares["stable"]
    assert shares["S_upper"] - shares["S_lower"] <= 0.1
    assert shares["S_lower"] == pytest.approx(1.0, abs=0.05)
    text, _ = verdict(run, "accuracy")
    assert "readout shift that an affine change of frame undoes" in text and "S bracket [" in text


@pytest.mark.parametrize("name", ["frame_flip", "distinct_computation_skewed"])
def test_an_ambiguous_model_has_its_truth_inside_and_s_not_identified(name):
    run = run_planted(name)
    truth = planted.EXPECTED_FACTOR[name]
    truth_s = 1.0 if truth == "S" else 0.0
    shares = run["shares"]["accuracy"]
    assert shares["S_lower"] - SLACK <= truth_s <= shares["S_upper"] + SLACK, shares
    assert shares["S_identified"] is False
    assert shares["verdict"] == "inconclusive" and "not identified" in shares["reason"]
    below = [row for row in run["decomposition"] if row["k"] < run["n_iterations"]]
    assert not any(row["S_identified"] for row in below if row["gap"] > 0.05)
    text, _ = verdict(run, "accuracy")
    assert text.startswith("Inconclusive") and "readout shift is not identified" in text


def test_the_context_dependent_d_model_gets_a_narrow_bracket_at_d_one():
    run = run_planted("distinct_computation_context")
    bracket = run["bracket"]["accuracy"]
    assert bracket["S_upper"] - bracket["S_lower"] <= 0.1
    assert bracket["D_lower"] >= 0.9 - SLACK and bracket["D_upper"] <= 1.0 + SLACK
    # No affine map recovers the gap, and no test here tells computation from a non-affine
    # shift: the verdict bounds it rather than naming D.
    shares = run["shares"]["accuracy"]
    assert shares["verdict"] == "inconclusive" and shares["bound"] == "not_affine"
    text, _ = verdict(run, "accuracy")
    assert "distinct computation, or a non-affine shift" in text


def test_a_gap_near_chance_is_inconclusive_in_results_json():
    # Targets drawn at random: full depth is no better than the base rate, whatever the model.
    model = planted.load_planted("readout_shift", seed=0)
    evaluation = model.planted_task.evaluation(N)
    generator = torch.Generator().manual_seed(3)
    targets = torch.randint(0, model.cfg.d_vocab, evaluation.targets.shape, generator=generator)
    targets[evaluation.targets == IGNORE_INDEX] = IGNORE_INDEX
    run = run_planted("readout_shift", EvaluationSet(evaluation.tokens, targets))
    shares = run["shares"]["accuracy"]
    assert shares["verdict"] == "inconclusive" and shares["stable"] is False
    assert "near chance" in shares["reason"] or "not clearly above zero" in shares["reason"]
    text, _ = verdict(run, "accuracy")
    assert text.startswith("Inconclusive")


def test_a_gap_near_chance_is_inconclusive_on_the_console_and_in_the_report(tmp_path):
    """A gap near chance reads "inconclusive", with its reason, wherever a
    user looks: `results.summary()` (what `dcp-lens run` prints) and report.html."""
    model = planted.load_planted("readout_shift", seed=0)
    evaluation = model.planted_task.evaluation(N)
    generator = torch.Generator().manual_seed(3)
    targets = torch.randint(0, model.cfg.d_vocab, evaluation.targets.shape, generator=generator)
    targets[evaluation.targets == IGNORE_INDEX] = IGNORE_INDEX
    protocol = DepthControlProtocol(
        model, metrics=("accuracy",), n_bootstrap=100, probe="none", progress=False, seed=0
    )
    results = protocol.run(
        EvaluationSet(evaluation.tokens, targets), model.planted_task.calibration(N)
    )
    summary = results.summary()
    assert "Inconclusive" in summary
    assert max(len(line) for line in summary.splitlines()) <= 100
    page = results.report(tmp_path).read_text()
    assert "Inconclusive" in page


def test_a_map_that_can_compute_never_identifies_s():
    """Optimal transport between mixtures can send each truncated state to the
    node its answer is, so its gain is no lower bound: with it the verdict stays inconclusive."""
    model = planted.load_planted("readout_shift", seed=0)
    task = model.planted_task
    protocol = DepthControlProtocol(
        model,
        metrics=("accuracy",),
        n_bootstrap=50,
        probe="none",
        progress=False,
        seed=0,
        calibration_mode="mixture",
        calibration_groups=0,
    )
    run = protocol.run(task.evaluation(N), task.calibration(N)).to_results_json()
    run = run["runs"][0] if "runs" in run else run
    shares = run["shares"]["accuracy"]
    assert shares["verdict"] == "inconclusive" and shares["S_identified"] is False
    assert "no lower bound" in shares["reason"]
    assert not any(row["S_identified"] for row in run["decomposition"] if row["k"] < 8)


# ------------------------------------------------------------ controls read on a subsample

CAPPED = dict(
    n_bootstrap=20,
    probe="none",
    progress=False,
    batch_size=8,
    calibration_groups=4,
    control_tokens=100,  # 10 of the 40 sequences of 10 tokens
)


@pytest.fixture(scope="module")
def capped():
    model = make_model(dtype=torch.float32)
    evaluation, calibration = lm_sets(model, n=40, pos=10)
    return model, evaluation, calibration


def test_controls_past_the_cap_are_read_on_its_examples_only(capped) -> None:
    model, evaluation, calibration = capped
    calls: list[tuple[frozenset[str], int]] = []
    original = sweep_module.readouts

    def counting(model_, r, states, conditions, full_logits, plan=None):
        calls.append((frozenset(conditions), int(states.shape[1])))
        return original(model_, r, states, conditions, full_logits, plan)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sweep_module, "readouts", counting)
        protocol = DepthControlProtocol(model, **CAPPED)
        results = protocol.run(evaluation, calibration)
    r, grid = protocol.r, protocol.context.k_grid
    below_r = [k for k in grid if k < r]
    controls = frozenset(SUBSAMPLED_CONTROLS)
    # Below r the controls are read apart, on the subsample's examples of each chunk only.
    apart = [examples for names, examples in calls if names == controls]
    assert sum(apart) == 10 * len(below_r)
    document = json.loads(json.dumps(results.to_results_json()))
    run = document["runs"][0] if "runs" in document else document
    counts = run["metadata"]["examples_read"]
    assert {name: counts[name] for name in controls} == dict.fromkeys(controls, 10)
    assert counts["truncate"] == counts["calibrate_truncate"] == 40
    assert ProtocolResults.from_results_json(run).metadata["examples_read"] == counts
    assert run["bracket"]  # every metric the task scores
    for metric, bracket in run["bracket"].items():
        for key in ("S_lower_lo", "S_upper_hi", "S_point_lo", "S_point_hi", "D_point_lo"):
            assert math.isfinite(bracket[key]), (metric, key)
    rows = [row for row in run["decomposition"] if row["k"] < r]
    assert all(math.isfinite(row["shift_gap_lo"]) for row in rows)
    assert not any(row["nonfinite"] for row in run["curves"])
    assert all(math.isfinite(row["value_lo"]) for row in run["curves"] if row["k"] < r)


def test_resume_mid_evaluation_with_the_cap_gives_the_uninterrupted_numbers(
    capped, tmp_path
) -> None:
    model, evaluation, calibration = capped
    reference = result_numbers(DepthControlProtocol(model, **CAPPED).run(evaluation, calibration))
    fails_at_the_third_batch = out_of_memory_from(sweep_module.capture_all, 3)
    checkpoint = Checkpoint(tmp_path / "snapshots", every=16)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sweep_module, "capture_all", fails_at_the_third_batch)
        with pytest.raises(OutOfMemoryStop):
            DepthControlProtocol(model, checkpoint=checkpoint, **CAPPED).run(
                evaluation, calibration
            )
    assert checkpoint.restore("evaluation.0", torch.device("cpu"))[0] == 2
    resumed = DepthControlProtocol(model, checkpoint=checkpoint, **CAPPED).run(
        evaluation, calibration
    )
    assert numbers_close(result_numbers(resumed), reference, 1e-6)


def test_every_example_is_read_with_the_cap_off_and_all_means_off() -> None:
    assert ProtocolConfig(control_tokens="all").control_tokens == 0
    assert ProtocolConfig(control_tokens="4096").control_tokens == 4096
    for bad in (-1, "some", True):
        with pytest.raises(ConfigError, match="control_tokens"):
            ProtocolConfig(control_tokens=bad)


def _evaluation_syncs(protocol: DepthControlProtocol, evaluation: EvaluationSet) -> int:
    """Synchronisations (the CPU shim's count) of one evaluation of ``evaluation``."""
    from dcp_lens.protocol.sweep import Sweep
    from dcp_lens.utils.syncs import counting_syncs

    assert protocol.maps is not None
    sweep = Sweep(protocol.context, protocol.maps, {})
    with counting_syncs() as count:
        sweep.evaluate(evaluation)
    return count.total


def test_an_evaluation_batch_makes_a_handful_of_synchronisations():
    """Each further evaluation batch (the jackknife's examples among them) adds a few reads of a
    tensor by the host (three on the CPU shim), not one per k, condition or chunk: one more per
    k in a loop would add nine. The probe is off: its subsamples read their keys on the host."""
    from helpers import make_model

    model = make_model(torch.float32, n_iterations=32, d_vocab=64, n_ctx=16)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (80, 12), generator=generator)
    calibration = EvaluationSet.from_tokens(tokens[48:])
    protocol = DepthControlProtocol(
        model, batch_size=8, n_bootstrap=10, probe="none", progress=False, seed=0
    )
    protocol.fit(calibration)
    one = _evaluation_syncs(protocol, EvaluationSet.from_tokens(tokens[:8]))
    four = _evaluation_syncs(protocol, EvaluationSet.from_tokens(tokens[:32]))
    per_batch = (four - one) / 3
    assert per_batch <= 8, per_batch
