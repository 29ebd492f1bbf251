"""`dcp-lens validate`'s bracket rule and its coverage count on synthetic
results: every test of a row, the false-alarm rate and the coverage fractions."""

from __future__ import annotations

import math
from typing import Any

import pytest

from dcp_lens.studies import validate as validation
from dcp_lens.studies import validation_rules as rules
from dcp_lens.studies.validate import coverage_of
from dcp_lens.studies.validation_rules import (
    ValidationRow,
    judge_bracket,
    judge_run,
    suite_passed,
    summarize,
)

R = 4  # iterations of the synthetic runs; decomposition rows at k = 1..R
TRUTH_S = {"S": 1.0, "B": 0.0, "D": 0.0}


def bracket(s=(0.98, 1.01), b=(-0.01, 0.01), d=(0.0, 0.02), width=0.02) -> dict[str, float]:
    """A share-level bracket: each factor's [lower_lo, upper_hi], the ends between them."""
    values: dict[str, float] = {"S_width_hi": width, "B_width_hi": 0.01}
    for factor, (low, high) in zip("SBD", (s, b, d), strict=True):
        values |= {f"{factor}_lower_lo": low, f"{factor}_upper_hi": high}
        values |= {f"{factor}_lower": low, f"{factor}_upper": high}
        values |= {f"{factor}_lower_hi": high, f"{factor}_upper_lo": low}
    return values


def per_k(s_identified=(True, True, True), b_identified=(True, True, True), gap_lo=(0.2,) * 3):
    return [
        {"k": k, "gap_lo": g, "S_identified": s, "B_identified": b}
        for k, (s, b, g) in enumerate(zip(s_identified, b_identified, gap_lo, strict=True), 1)
    ]


POINT = {"S": 1.0, "B": 0.0, "D": 0.0}


def test_an_identifiable_row_passes_inside_a_narrow_bracket_with_the_point_near_the_truth():
    judgement = judge_bracket(bracket(), POINT, per_k(), TRUTH_S, identifiable=True)
    assert judgement.passed and judgement.in_bracket and judgement.narrow and judgement.point_ok
    assert (judgement.false_alarms, judgement.alarm_ks) == (0, 3)
    assert judgement.flagged_every_k is None


@pytest.mark.parametrize(
    ("changed", "failed"),
    [
        ({"b": (0.08, 0.2)}, "outside"),  # B's bracket above the truth 0 by more than the slack
        ({"width": 0.11}, "narrow"),
        ({}, "point"),
    ],
)
def test_an_identifiable_row_fails_each_test_on_its_own(changed, failed):
    point = {"S": 0.85, "B": 0.0, "D": 0.15} if failed == "point" else POINT
    judgement = judge_bracket(bracket(**changed), point, per_k(), TRUTH_S, identifiable=True)
    assert not judgement.passed
    assert judgement.in_bracket == (failed != "outside")
    assert judgement.outside == (["B"] if failed == "outside" else [])
    assert judgement.narrow == (failed != "narrow")
    assert judgement.point_ok == (failed != "point")


def test_the_slack_lets_the_truth_lie_just_outside_and_no_further():
    near = judge_bracket(bracket(s=(0.5, 0.96)), POINT, per_k(), TRUTH_S, identifiable=False)
    far = judge_bracket(bracket(s=(0.5, 0.94)), POINT, per_k(), TRUTH_S, identifiable=False)
    assert near.in_bracket and not far.in_bracket and far.outside == ["S"]


def test_a_nan_bracket_end_fails_instead_of_passing_silently():
    values = bracket() | {"D_upper_hi": math.nan}
    judgement = judge_bracket(values, POINT, per_k(), TRUTH_S, identifiable=True)
    assert judgement.outside == ["D"] and not judgement.passed


def test_false_alarms_count_only_k_with_a_gap_clearly_above_zero():
    rows = per_k(s_identified=(False, False, True), gap_lo=(-0.01, 0.2, 0.2))
    judgement = judge_bracket(bracket(), POINT, rows, TRUTH_S, identifiable=True)
    # k = 1 has no clear gap: its unidentified S is no false alarm.
    assert (judgement.false_alarms, judgement.alarm_ks) == (1, 2)
    assert judgement.passed  # a false alarm is counted per metric, not against the row


def test_an_ambiguous_row_must_be_flagged_at_every_k_with_a_gap():
    wide = bracket(s=(0.0, 1.0), d=(0.0, 1.0), width=1.0)
    truth = {"S": 0.0, "B": 0.0, "D": 1.0}
    flagged = per_k(s_identified=(False, True, True), b_identified=(True, False, False))
    judgement = judge_bracket(wide, POINT, flagged, truth, identifiable=False)
    assert judgement.passed and judgement.flagged_every_k and judgement.unflagged_ks == []
    assert judgement.narrow is None and judgement.point_ok is None and judgement.alarm_ks == 0
    # k = 3 identified on both: a confident answer where the truth cannot be told apart.
    quiet = per_k(s_identified=(False, False, True), gap_lo=(0.2, 0.2, 0.2))
    judgement = judge_bracket(wide, POINT, quiet, truth, identifiable=False)
    assert not judgement.passed and judgement.unflagged_ks == [3]
    # ... unless k = 3 has no gap to speak of.
    quiet = per_k(s_identified=(False, False, True), gap_lo=(0.2, 0.2, 0.0))
    assert judge_bracket(wide, POINT, quiet, truth, identifiable=False).passed
    # A gap of float rounding (1e-9 against 0.2, clear of zero by its tight interval) is no gap
    # either, while one a millionth of the largest and up still is.
    for tiny, counted in ((1e-9, False), (1e-5, True)):
        rows = [
            row | {"gap": row["gap_lo"]}
            for row in per_k(s_identified=(False, False, True), gap_lo=(0.2, 0.2, tiny))
        ]
        judgement = judge_bracket(wide, POINT, rows, truth, identifiable=False)
        assert judgement.passed is not counted
        assert judgement.unflagged_ks == ([3] if counted else [])


def run(metric: str = "accuracy", **bracket_values: Any) -> dict[str, Any]:
    """A results.json run as the protocol writes it: the point shares, their intervals, the
    share-level bracket and one decomposition row per k (the row at k = r carries no flags)."""
    rows = [
        {
            "metric": metric,
            "k": k,
            "gap": 0.5,
            "gap_lo": 0.4 if k < R else 0.0,
            "S_identified": k < R,
            "B_identified": k < R,
            "S_width_hi": 0.01,
        }
        for k in range(1, R + 1)
    ]
    return {
        "n_iterations": R,
        "decomposition": rows,
        "shares": {metric: {**POINT, "verdict": "S", "stable": True}},
        "share_intervals": {metric: {"S_lo": 0.97, "S_hi": 1.02, "B_lo": -0.01, "B_hi": 0.01}},
        "bracket": {metric: bracket(**bracket_values)},
        "metrics": {metric: {"validated": True}},
    }


def test_judge_run_reads_the_bracket_and_the_rows_below_r():
    judgement = judge_run(run(), "accuracy", TRUTH_S, identifiable=True)
    assert judgement.passed and judgement.alarm_ks == R - 1  # k = r is left out
    assert rules.per_k_of(run(), "accuracy")[-1]["k"] == R - 1
    shares = rules.shares_of(run(), "accuracy")
    assert shares["S_lo"] == 0.97 and math.isnan(shares["D_lo"])  # absent: NaN, not 0
    assert not judge_run(run(width=0.3), "accuracy", TRUTH_S, identifiable=True).passed


def row(
    metric: str,
    passed: bool,
    false_alarms: int,
    alarm_ks: int,
    counted=True,
    right=True,
    wrong=False,
):
    judgement = rules.Judgement(
        in_bracket=passed,
        outside=[],
        narrow=True,
        point_ok=True,
        flagged_every_k=None,
        unflagged_ks=[],
        false_alarms=false_alarms,
        alarm_ks=alarm_ks,
        passed=passed,
        verdict="S",
        verdict_right=right,
        confident_wrong=wrong,
    )
    return ValidationRow(
        model="m",
        metric=metric,
        planted="S",
        identifiable=True,
        shares={},
        bracket={},
        expected=TRUTH_S,
        per_k=[],
        judgement=judgement,
        passed=passed,
        point_rule_passed=True,
        counted=counted,
    )


def test_the_false_alarm_rate_is_pooled_over_the_suite_and_can_fail_a_metric():
    rows = [row("accuracy", True, 1, 10), row("accuracy", True, 0, 10)]
    summary = summarize(rows)["accuracy"]
    assert summary["false_alarm_rate"] == pytest.approx(0.05) and summary["passed"]
    rows.append(row("accuracy", True, 2, 2))
    summary = summarize(rows)["accuracy"]
    assert summary["false_alarm_rate"] == pytest.approx(3 / 22) and not summary["passed"]
    assert summary["rows_passed"] == 3 and not suite_passed(rows)


def test_a_metric_not_validated_is_reported_but_not_counted():
    rows = [row("accuracy", True, 0, 5), row("cross_entropy", False, 5, 5, counted=False)]
    summary = summarize(rows)
    assert not summary["cross_entropy"]["passed"] and summary["cross_entropy"]["failing"] == ["m"]
    assert suite_passed(rows)
    assert not suite_passed([*rows, row("accuracy", False, 0, 5)])


def test_verdicts_are_right_when_their_claim_holds_and_wrong_when_they_name_too_little():
    truth_d = {"S": 0.0, "B": 0.0, "D": 1.0}
    judge = rules.judge_verdict
    assert judge({"verdict": "S"}, TRUTH_S, True, True) == ("S", True, False)
    # Naming S where the truth is D: confidently wrong, on any model.
    assert judge({"verdict": "S"}, truth_d, False, True) == ("S", None, True)
    # A gap no affine map recovers, on a D model: right, and worded as such.
    bounded = {"verdict": "inconclusive", "bound": "not_affine"}
    assert judge(bounded, truth_d, True, False) == ("inconclusive/not_affine", True, False)
    # ... but on an identifiable S model it is no answer.
    assert judge(bounded, TRUTH_S, True, False)[1] is False
    assert judge({"verdict": "inconclusive"}, TRUTH_S, True, True)[1] is False
    assert judge({"verdict": "mixed"}, {"S": 0.5, "B": 0.0, "D": 0.5}, True, True)[1] is True
    assert judge({}, TRUTH_S, True, True)[0] == "none"


def test_an_ambiguous_row_passes_when_its_verdict_is_inconclusive_even_outside_its_bracket():
    narrow = bracket(s=(0.0, 0.05), d=(0.95, 1.0), width=0.05)
    inconclusive = {"verdict": "inconclusive", "bound": "not_affine"}
    rows = per_k(s_identified=(True, True, True))
    judgement = judge_bracket(narrow, POINT, rows, TRUTH_S, False, inconclusive)
    assert judgement.passed and not judgement.in_bracket
    named = judge_bracket(narrow, POINT, rows, TRUTH_S, False, {"verdict": "S"})
    assert not named.passed


def test_an_identified_field_with_the_truth_outside_its_bracket_fails_any_row():
    """The fields are judged as well as the verdict: an inconclusive row of a non-identifiable
    model whose ``S_identified`` claims S with the truth outside the S bracket fails."""
    narrow = bracket(s=(0.0, 0.05), d=(0.95, 1.0), width=0.05)
    rows = per_k(s_identified=(True, True, True))
    claims = {"verdict": "inconclusive", "bound": "not_affine", "S_identified": True}
    judgement = judge_bracket(narrow, POINT, rows, TRUTH_S, False, claims)
    assert judgement.confident_wrong and not judgement.passed
    honest = {**claims, "S_identified": False, "B_identified": True}  # B's truth is inside
    assert judge_bracket(narrow, POINT, rows, TRUTH_S, False, honest).passed


def test_a_truth_that_one_order_of_s_and_b_holds_is_inside_the_bracket():
    # The turning clock: the S bracket [0.90, 0.94] is the orders' mean; S taken first is 1.
    narrow = bracket(s=(0.90, 0.94), b=(0.03, 0.08), width=0.02)
    record = {"verdict": "S", "S_first_lo": 0.99, "S_first_hi": 1.0, "S_after_B_lo": 0.85,
              "S_after_B_hi": 0.88, "B_first_lo": 0.1, "B_first_hi": 0.13,
              "B_after_S_lo": 0.0, "B_after_S_hi": 0.0}  # fmt: skip
    assert judge_bracket(narrow, POINT, per_k(), TRUTH_S, True, record).in_bracket
    alone = judge_bracket(narrow, POINT, per_k(), TRUTH_S, True, {"verdict": "S"})
    assert alone.outside == ["S"]


def test_the_verdict_rate_and_confident_errors_fail_a_metric():
    rows = [row("accuracy", True, 0, 10) for _ in range(9)]
    assert summarize([*rows, row("accuracy", True, 0, 10, right=False)])["accuracy"]["passed"]
    two_wrong = [*rows[:8], *(row("accuracy", True, 0, 10, right=False) for _ in range(2))]
    summary = summarize(two_wrong)["accuracy"]
    assert summary["verdict_rate"] == pytest.approx(0.8) and not summary["passed"]
    confident = summarize([*rows, row("accuracy", True, 0, 10, wrong=True)])["accuracy"]
    assert confident["confidently_wrong"] == ["m"] and not confident["passed"]


def test_coverage_counts_intervals_that_hold_each_replicate_s_truth():
    replicates = [
        {
            **bracket(s=(s - 0.1, s + 0.3)),
            "S": s,
            "S_lo": s - 0.05,
            "S_hi": s + 0.05,
            "B": 0.0,
            "B_lo": -0.01,
            "B_hi": 0.01,
            "D": 1 - s,
            "D_lo": 0.9 - s,
            "D_hi": 1.1 - s,
            "truth_S": 0.5,
            "truth_B": 0.0,
            "truth_D": 0.5,
        }
        for s in (0.45, 0.52, 0.70, 0.30)
    ]
    table = coverage_of(replicates)
    assert table["S"]["covers_truth"] == 0.5  # 0.45 and 0.52 hold 0.5; 0.70 and 0.30 do not
    assert table["S_bracket"]["covers_truth"] == 0.75  # only [0.6, 1.0] misses 0.5
    assert table["D"]["covers_truth"] == 0.5 and table["B"]["covers_truth"] == 1.0
    # The truth plus the mean error -0.0075: 0.4925, held by the intervals around 0.45 and 0.52.
    assert table["S"]["covers_debiased"] == 0.5
    # Estimates spread far more than their intervals say: standard deviation 0.166 against
    # the bootstrap's 0.1 / 3.92.
    assert table["S"]["spread_ratio"] == pytest.approx(0.16601 / (0.1 / 3.92), rel=1e-3)
    assert "covers_debiased" not in table["S_bracket"]
    # B never moves and its interval has width 0.02: no spread; a zero-width interval around
    # estimates that do move would be infinitely overconfident.
    assert table["B"]["spread_ratio"] == 0.0
    frozen = [{**r, "D_lo": r["D"], "D_hi": r["D"]} for r in replicates]
    assert coverage_of(frozen)["D"]["spread_ratio"] == math.inf


def test_coverage_judges_errors_so_that_a_truth_that_moves_with_the_model_is_no_spread():
    # Each replicate's estimate sits 0.1 above its own truth: a constant bias, no spread.
    replicates = [
        {
            **bracket(),
            "S": t + 0.1,
            "S_lo": t + 0.05,
            "S_hi": t + 0.15,
            "B": 0.0,
            "B_lo": 0.0,
            "B_hi": 0.0,
            "D": 0.0,
            "D_lo": 0.0,
            "D_hi": 0.0,
            "truth_S": t,
            "truth_B": 0.0,
            "truth_D": 0.0,
        }
        for t in (0.2, 0.5, 0.8)
    ]
    table = coverage_of(replicates)
    assert table["S"]["covers_truth"] == 0.0 and table["S"]["covers_debiased"] == 1.0
    assert table["S"]["spread_ratio"] == pytest.approx(0.0, abs=1e-9)
    # B has width 0 and never moves: an honest interval, ratio 1.
    assert table["B"]["spread_ratio"] == 1.0


def test_coverage_counts_brackets_everywhere_and_points_only_where_identifiable():
    assert validation.coverage_counted("mixture_three_way") == (
        "S_bracket",
        "B_bracket",
        "D_bracket",
    )
    assert "S" in validation.coverage_counted("mixture_shift_blocks")
    assert set(validation.MIXTURES) == {
        "mixture_shift_distinct",
        "mixture_shift_blocks",
        "mixture_three_way",
    }


def test_validate_refuses_a_width_below_a_model_before_any_run():
    with pytest.raises(validation.ConfigError, match="below the widest planted model's d_model=48"):
        validation.validate(["readout_shift", "mixture_three_way"], width=40)


@pytest.mark.slow
def test_a_run_at_width_records_the_width_and_its_cost(tmp_path):
    """``validate --width`` embeds the models, and validation.json says at what width and what
    the run cost (about a minute)."""
    import json

    config = validation.VALIDATE_CONFIG.replace(n_bootstrap=10, metrics=("accuracy",))
    out = tmp_path / "out"
    validation.run_validation(
        ["block_count"], config=config, n_eval=64, n_calibration=64, out=out, width=64
    )
    settings = json.loads((out / "validation.json").read_text())["settings"]
    assert settings["width"] == 64
    assert settings["seconds"] > 0 and settings["peak_rss_mib"] > 0
