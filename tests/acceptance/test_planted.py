"""The planted models are what they claim, and `dcp-lens validate` runs them."""

from __future__ import annotations

import json

import pytest
import torch

from dcp_lens import DepthControlProtocol
from dcp_lens.cli import main
from dcp_lens.protocol.calibration import AffineCalibration, StreamingMoments
from dcp_lens.protocol.metrics import METRICS
from dcp_lens.protocol.states import capture_states
from dcp_lens.studies.validate import coverage, validate
from dcp_lens.studies.validation_rules import point_rule_passes, suite_passed
from dcp_lens.zoo import planted

NEW = [
    name
    for name in planted.PLANTED
    if name not in ("readout_shift", "distinct_computation", "block_count")
]
HARD = [name for name in NEW if not name.endswith("_soft")]
N = 256


def accuracy(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return float((logits.argmax(-1) == targets).double().mean())


@pytest.mark.parametrize("name", HARD)
def test_full_depth_solves_the_task_and_truncation_drops_it(name):
    model = planted.load_planted(name, seed=1)
    evaluation = model.planted_task.evaluation(N)
    with torch.no_grad():
        states, logits = capture_states(model, evaluation.tokens)
        truncated = model.readout(states[1])
    assert accuracy(logits, evaluation.targets) == 1.0
    assert accuracy(truncated, evaluation.targets) < 0.7


@pytest.mark.parametrize("name", [n for n in NEW if n.endswith("_soft")])
def test_soft_targets_are_drawn_from_the_full_depth_distribution(name):
    model = planted.load_planted(name)
    task = model.planted_task
    assert task.target_probabilities is not None
    evaluation = task.evaluation(2048)
    with torch.no_grad():
        states, logits = capture_states(model, evaluation.tokens)
        truncated = model.readout(states[1])
    probabilities = logits.double().softmax(-1)
    # The full-depth prediction is the truth: mean p(target) matches mean sum p^2.
    p_target = probabilities.gather(-1, evaluation.targets[..., None]).mean()
    assert float(p_target) == pytest.approx(float(probabilities.pow(2).sum(-1).mean()), abs=0.02)
    # and truncation costs cross-entropy, as much as its KL to full depth (in expectation).
    full_ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), evaluation.targets.flatten())
    truncated_ce = torch.nn.functional.cross_entropy(
        truncated.flatten(0, 1), evaluation.targets.flatten()
    )
    kl = (probabilities * (logits.log_softmax(-1) - truncated.log_softmax(-1))).sum(-1).mean()
    assert float(truncated_ce - full_ce) > 0.1
    assert float(truncated_ce - full_ce) == pytest.approx(float(kl), rel=0.1)


def test_the_distinct_half_of_the_mixture_sees_the_same_states_at_every_depth():
    model = planted.mixture_shift_distinct()
    distinct = torch.arange(32, 64)[:, None]  # every D token once (position 0)
    with torch.no_grad():
        states, _ = capture_states(model, distinct)
    nodes = [states[t, :, 0].argmax(-1).sort().values for t in range(model.n_iterations + 1)]
    for t in range(1, model.n_iterations + 1):
        assert torch.equal(nodes[t], nodes[0])  # a permutation of the nodes: same distribution


def test_a_mixture_reproduces_its_components_exactly():
    model = planted.mixture_shift_distinct(seed=2)
    shift, distinct = planted.readout_shift_step(8, 8, 2), planted.distinct_computation(32, 8, 2)
    tokens = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for k in (1, 3, 8):
            with model.iterations(k), shift.iterations(k), distinct.iterations(k):
                torch.testing.assert_close(
                    model(tokens)[..., :32], shift(tokens), atol=1e-4, rtol=0
                )
                torch.testing.assert_close(
                    model(tokens + 32)[..., 32:], distinct(tokens), atol=1e-4, rtol=0
                )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_step_clock_is_s_only_with_replay_exactly_neutral(seed):
    """`readout_shift_step`: full depth solves the task, every truncation reads the same wrong
    class, replay's readout is truncation's at every k (B = 0, no S/B interaction), and the
    mean-only map (truncated clock moved to full depth's) repairs both (D = 0)."""
    model = planted.readout_shift_step(seed=seed)
    evaluation = model.planted_task.evaluation(N)
    with torch.no_grad():
        states, logits = capture_states(model, evaluation.tokens)
    r = model.n_iterations
    assert accuracy(logits, evaluation.targets) == 1.0
    shift = states[r].mean((0, 1)) - states[1].mean((0, 1))
    for k in range(1, r):
        replayed = states[k] + (r - k) * (states[k] - states[k - 1])
        truncated = model.readout(states[k])
        assert accuracy(truncated, evaluation.targets) < 0.3, k
        assert torch.equal(model.readout(replayed).argmax(-1), truncated.argmax(-1)), k
        for source in (states[k], replayed):
            # The clock sits at c_0 below r, whatever replay adds: one translation repairs it.
            moved = source.clone()
            moved[..., 8:10] += shift[8:10]
            assert accuracy(model.readout(moved), evaluation.targets) == 1.0, k


@pytest.mark.parametrize("name", ["readout_shift_by_token_type", "readout_shift_by_position"])
def test_one_affine_map_per_type_repairs_truncate_and_replay(name):
    """S only: a label-free map fitted per cluster of the state (here: per type) repairs every
    depth, for truncate and for replay alike, so nothing is left for D or B."""
    model = planted.load_planted(name)
    task = model.planted_task
    calibration, evaluation = task.calibration(N), task.evaluation(N)
    with torch.no_grad():
        fit_states, _ = capture_states(model, calibration.tokens)
        states, logits = capture_states(model, evaluation.tokens)
    r = model.n_iterations

    def replay(s, k):
        return s[k] + (r - k) * (s[k] - s[k - 1])

    clock_a = slice(8, 10)  # nonzero on type A's states only: the state says its type
    for k in range(1, r):
        for build in (lambda s, k=k: s[k], lambda s, k=k: replay(s, k)):
            source, target = build(fit_states), fit_states[r]
            repaired = build(states).clone()
            for is_a in (True, False):
                fit_mask = (source[..., clock_a].abs().sum(-1) > 0) == is_a
                mask = (build(states)[..., clock_a].abs().sum(-1) > 0) == is_a
                mapping = AffineCalibration.fit(
                    StreamingMoments.from_samples(source[fit_mask].double()),
                    StreamingMoments.from_samples(target[fit_mask].double()),
                )
                repaired[mask] = mapping(build(states)[mask].double()).float()
            assert accuracy(model.readout(repaired), evaluation.targets) == 1.0, k
    assert accuracy(model.readout(states[1]), evaluation.targets) < 0.5


def test_pooled_calibration_repairs_the_type_dependent_shift_on_accuracy_today():
    model = planted.readout_shift_by_token_type(seed=1)
    task = model.planted_task
    protocol = DepthControlProtocol(
        model, metrics=("accuracy",), n_bootstrap=100, probe="none", progress=False
    )
    shares = protocol.run(task.evaluation(N), task.calibration(N)).decompositions["accuracy"].shares
    assert shares["S"] >= 0.9 and abs(shares["B"]) <= 0.1 and abs(shares["D"]) <= 0.1, shares


@pytest.mark.xfail(
    strict=False,
    reason="cross-entropy is not validated: at seed 1 this model's shares are S 1.53, B -0.54 "
    "even at matched confidence (README's validation table)",
)
def test_the_type_dependent_shift_is_all_S_on_cross_entropy():
    model = planted.readout_shift_by_token_type(seed=1)
    task = model.planted_task
    protocol = DepthControlProtocol(
        model, metrics=("cross_entropy",), n_bootstrap=0, probe="none", progress=False
    )
    results = protocol.run(task.evaluation(N), task.calibration(N))
    shares = results.decompositions["cross_entropy"].shares
    assert point_rule_passes("S", shares, {"S": 1.0, "B": 0.0, "D": 0.0}), shares


@pytest.mark.parametrize("metric", ["cross_entropy", "kl_to_full"])
def test_the_soft_distinct_model_is_all_D_on_the_losses(metric):
    # Raw, 0.2 of the gap leaked into B (replay's readout is less confidently wrong than
    # truncation's); scored at matched confidence the point shares stay with D (the older point
    # rule), and the bracket holds the truth D = 1.
    (row,) = validate(["distinct_computation_soft"], [metric], n_eval=N, n_calibration=N)
    assert row.point_rule_passed, row
    assert row.judgement.in_bracket, row


def test_expected_shares_of_a_mixture_add_up_and_split_the_gap():
    model = planted.mixture_shift_distinct()
    evaluation = model.planted_task.evaluation(N)
    shares = planted.expected_shares(
        "mixture_shift_distinct", model, evaluation, "accuracy", [1, 4]
    )
    assert sum(shares.values()) == pytest.approx(1.0)
    assert shares["B"] == 0.0 and 0.3 < shares["S"] < 0.7, shares
    single = planted.expected_shares(
        "block_count", planted.block_count(), evaluation, "accuracy", [1]
    )
    assert single == {"S": 0.0, "B": 1.0, "D": 0.0}


def test_judge_applies_the_stated_rules():
    truth = {"S": 0.5, "B": 0.0, "D": 0.5}
    assert point_rule_passes("S", {"S": 0.93, "B": 0.05, "D": 0.02}, truth)
    assert not point_rule_passes("S", {"S": 1.4, "B": -0.4, "D": 0.0}, truth)  # not a recovery
    assert not point_rule_passes("D", {"S": 0.0, "B": 0.17, "D": 0.83}, truth)
    assert point_rule_passes("S+D", {"S": 0.45, "B": 0.05, "D": 0.55}, truth)
    assert not point_rule_passes("S+D", {"S": 0.3, "B": 0.0, "D": 0.7}, truth)


def test_validate_command_writes_its_files(tmp_path, capsys):
    code = main(
        [
            "validate",
            "--models",
            "readout_shift,mixture_shift_distinct",
            "--metrics",
            "accuracy,kl_to_full",
            "--n-eval",
            "64",
            "--n-calibration",
            "64",
            "--bootstrap",
            "20",
            "--quiet",
            "--out",
            str(tmp_path),
        ]
    )
    printed = capsys.readouterr().out
    assert "| readout_shift | accuracy | yes |" in printed
    assert "false alarms" in printed
    document = json.loads((tmp_path / "validation.json").read_text())
    rows = {(row["model"], row["metric"]): row for row in document["rows"]}
    assert set(rows) == {
        (m, k)
        for m in ("readout_shift", "mixture_shift_distinct")
        for k in ("accuracy", "kl_to_full")
    }
    shift = rows[("readout_shift", "accuracy")]
    assert shift["passed"] is True and shift["judgement"]["narrow"] is True
    assert shift["judgement"]["alarm_ks"] == len(shift["per_k"]) > 0
    mixture = rows[("mixture_shift_distinct", "accuracy")]
    assert mixture["planted"] == "S+D" and mixture["identifiable"] is False
    assert mixture["judgement"]["narrow"] is None  # ambiguous: the flag is judged instead
    assert document["summary"]["accuracy"]["rows"] == 2
    assert code == (0 if document["passed"] else 1)
    assert (tmp_path / "validation.md").read_text().startswith("| planted model |")
    assert main(["validate", "--models", "nothing", "--quiet"]) == 2


def _states(name: str) -> tuple[planted.PlantedModel, list[torch.Tensor], torch.Tensor]:
    model = planted.load_planted(name)
    tokens = torch.arange(16).view(2, 8) % model.cfg.d_vocab
    with torch.no_grad():
        states, _ = capture_states(model, tokens)
    return model, states, tokens


@pytest.mark.parametrize("name", ["frame_flip_gated", "frame_warp"])
def test_a_non_affine_frame_change_computes_nothing(name):
    # s_k is s_r's code moved by a fixed invertible non-affine map when r - k is odd (a gated
    # sign flip, an elementwise warp) and equal to it when even: nothing is computed.
    model, states, tokens = _states(name)
    r = model.n_iterations
    codes = states[r][..., :4] if name == "frame_flip_gated" else states[r][..., :2]

    def move(code: torch.Tensor) -> torch.Tensor:
        if name == "frame_flip_gated":  # c_i -> -c_i c_3 for i = 1, 2
            moved = code.clone()
            moved[..., :2] = -code[..., :2] * code[..., 2:3]
            return moved
        return 2 * torch.sign(code) - code  # swaps the magnitudes 0.5 and 1.5

    with torch.no_grad():
        assert accuracy(model.readout(states[r]), tokens) == 1.0
        for k in range(1, r):
            width = codes.shape[-1]
            expected = codes if (r - k) % 2 == 0 else move(codes)
            torch.testing.assert_close(states[k][..., :width], expected, atol=1e-3, rtol=0)
            if (r - k) % 2:
                assert accuracy(model.readout(states[k]), tokens) < 0.6
        # The move is not affine: the best affine fit from s_k's code to s_r's misses.
        odd = codes.reshape(-1, codes.shape[-1])
        inputs = torch.cat([move(odd), torch.ones(len(odd), 1)], 1).double()
        fit = torch.linalg.lstsq(inputs, odd.double()).solution
        assert (inputs @ fit - odd.double()).abs().max() > 0.3


def test_the_walk_is_repaired_by_replay_and_by_a_translation_alike():
    # A constant per-step update: replay reproduces full depth, and so does moving s_k by the
    # mean difference to s_r; which one is "the" cause is an order convention.
    model, states, tokens = _states("readout_shift_walk")
    r = model.n_iterations
    answers = model.planted_task.answers[tokens]
    with torch.no_grad():
        assert accuracy(model.readout(states[r]), answers) == 1.0
        for k in (1, 4, r - 1):
            replayed = states[k] + (r - k) * (states[k] - states[k - 1])
            translated = states[k] + (states[r] - states[k]).mean((0, 1))
            assert accuracy(model.readout(states[k]), answers) < 1.0
            assert accuracy(model.readout(replayed), answers) == 1.0
            assert accuracy(model.readout(translated), answers) == 1.0


@pytest.mark.parametrize("name", ["frame_flip_gated", "frame_warp", "readout_shift_walk"])
def test_a_map_class_or_order_ambiguity_is_never_named(name):
    model = planted.load_planted(name)
    task = model.planted_task
    protocol = DepthControlProtocol(
        model,
        metrics=("accuracy", "top1_agreement"),
        n_bootstrap=100,
        probe="none",
        progress=False,
    )
    results = protocol.run(task.evaluation(N), task.calibration(N))
    for metric, decomposition in results.decompositions.items():
        record = decomposition.bracket_shares
        assert record is not None and record["verdict"] == "inconclusive", (metric, record)
    if name == "readout_shift_walk":
        record = results.decompositions["accuracy"].bracket_shares
        assert record is not None and "the order decides" in record["reason"]
        assert record["S_first"] == pytest.approx(1.0, abs=0.02)
        assert record["S_after_B"] == pytest.approx(0.0, abs=0.02)


def test_the_console_flag_list_on_the_easiest_model_is_short_and_says_what_to_read():
    model = planted.load_planted("readout_shift")
    task = model.planted_task
    protocol = DepthControlProtocol(model, n_bootstrap=100, probe="none", progress=False)
    results = protocol.run(task.evaluation(N), task.calibration(N))
    text = results.summary()
    flags = [line.strip() for line in text.split("\nflags:\n")[1].splitlines()]
    assert 1 <= len(flags) <= 5, text
    assert flags[0].startswith("- read accuracy, top1_agreement"), text
    assert "do not read cross_entropy, kl_to_full" in " ".join(flags), text
    # Identical notes are merged: no text repeats, none for metrics the reader should skip.
    assert len(set(flags)) == len(flags) and "temperature" not in text
    # Numbers with three decimals and their names; "at least" only for a bound below the point.
    assert "accuracy: full depth 1.000, k = 1 0." in text


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_the_whole_validation_suite_passes(seed):
    # Rows of metrics marked validated: false are reported but not counted.
    rows = validate(seed=seed)
    assert len(rows) == len(planted.BRACKET_PLANTED) * len(METRICS)
    failed = [(r.model, r.metric, r.judgement) for r in rows if r.counted and not r.passed]
    assert not failed, failed
    assert suite_passed(rows)


def test_coverage_replicates_a_model_with_successive_seeds(tmp_path):
    table = coverage(
        ["readout_shift"],
        ["accuracy"],
        replicates=3,
        n_eval=32,
        n_calibration=32,
        n_bootstrap=20,
        probe="none",
    )
    assert table["seeds"] == [0, 1, 2] and table["replicates"] == 3
    # Every replicate's record is kept, with its truth, so a miss can be traced to its seed.
    draws = table["draws"]["readout_shift"]["accuracy"]
    assert len(draws) == 3 and all(d["truth_S"] == 1.0 and "S_lower_lo" in d for d in draws)
    entries = table["models"]["readout_shift"]["accuracy"]
    assert set(entries) >= {"S", "B", "D", "S_lower", "S_upper", "S_bracket", "D_bracket"}
    for name, entry in entries.items():
        # a fraction of 3 replicates
        assert entry["covers_truth"] in (0.0, 1 / 3, 2 / 3, 1.0), (name, entry)
    # Each seed builds another model and data set: the estimates differ between replicates.
    assert 0 < entries["S"]["spread_ratio"] < float("inf"), entries["S"]
    assert table["passed"] == all(
        entries[q]["covers_truth"] >= 0.9
        for q in ("S", "B", "D", "S_bracket", "B_bracket", "D_bracket")
    )
    assert main(["validate", "--coverage", "1", "--quiet"]) == 2  # one replicate has no spread
