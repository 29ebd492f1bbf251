"""The validity decisions (dcp_lens.protocol.verdicts): the verdict rule on synthetic shares (each
named verdict, mixed, inconclusive, and each condition that vetoes a verdict), the metrics a run
scores, and `validity`, the one function that sets a decomposition's validity fields."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from dcp_lens.protocol.decomposition import decompose
from dcp_lens.protocol.records import ProbeSummaryRecord
from dcp_lens.protocol.results import BRACKET_ROW_KEYS, FACTORS, Decomposition
from dcp_lens.protocol.verdicts import (
    B_IDENTIFICATION_TOLERANCE,
    NOT_AFFINE,
    UNBOUNDED_MAP_REASON,
    BracketRule,
    RunEvidence,
    scored_metrics,
    share_verdict,
    validity,
)

RULE = BracketRule()
R = 4
GRID = (1, 2, 3, 4)


def shares(s: float = 0.9, b: float = 0.05, d: float = 0.05, **changes: float) -> dict:
    """The shares of a clean run whose factors are ``s``, ``b``, ``d`` of the gap: the gap and
    full depth's headroom clearly above zero, narrow brackets and intervals, the orders of S
    and B agreeing, no walk, both factors identified over the whole area; ``changes`` replace
    any of them."""
    record = {
        "gap": 1.0,
        "gap_lo": 0.9,
        "gap_hi": 1.1,
        "headroom_lo": 0.5,
        "S_width_hi": 0.02,
        "B_width_hi": 0.02,
        "order_span": 0.01,
        "order_span_hi": 0.02,
        "S_first": s,
        "S_after_B": s,
        "B_first": b,
        "B_after_S": b,
        "walk_gain": 0.0,
        "S_identified_area": 1.0,
        "B_identified_area": 1.0,
        "S_lower": s,
        "S_upper": s + 0.02,
    }
    for factor, share in zip(FACTORS, (s, b, d), strict=True):
        record[f"{factor}_point_interval"] = 0.05
        record[f"{factor}_lower_lo"] = share - 0.02
        record[f"{factor}_upper_hi"] = share + 0.02
        record[f"{factor}_worse_order_lo"] = share - 0.02
    return {**record, **changes}


# ------------------------------------------------------------------------ the verdict rule


@pytest.mark.parametrize(
    ("given", "named"),
    [(shares(s=0.9, b=0.05, d=0.05), "S"), (shares(s=0.05, b=0.9, d=0.05), "B")],
    ids=["S", "B"],
)
def test_a_factor_carrying_the_gap_and_identified_is_named(given, named):
    decided = share_verdict(given, RULE)
    assert decided.verdict == named
    assert decided.stable and decided.S_identified and decided.B_identified
    assert decided.bound is None


def test_no_factor_reaching_the_named_share_is_mixed():
    decided = share_verdict(shares(s=0.5, b=0.3, d=0.2), RULE)
    assert decided.verdict == "mixed"
    assert "no factor reaches 0.75" in decided.reason
    assert decided.S_identified and decided.B_identified


def test_a_gap_no_affine_map_recovers_is_inconclusive_and_never_named_d():
    decided = share_verdict(shares(s=0.05, b=0.05, d=0.9), RULE)
    assert decided.verdict == "inconclusive"
    assert decided.bound == NOT_AFFINE
    assert not decided.S_identified and not decided.B_identified


@pytest.mark.parametrize(
    ("changes", "words", "stable"),
    [
        ({"gap": math.nan}, "no k has every cell finite", False),
        ({"gap_lo": -0.1}, "not clearly above zero", False),
        ({"headroom_lo": 0.0}, "not clearly better than the base rate", False),
        ({"S_point_interval": 0.5}, "too wide to name a factor", False),
        ({"S_width_hi": 0.3}, "readout shift is not identified", True),
        ({"S_identified_area": 0.5}, "S is identified only at k's that carry 50%", True),
        ({"order_span_hi": 0.5, "S_worse_order_lo": 0.4}, "the order decides", True),
    ],
    ids=[
        "no-finite-gap",
        "gap-may-be-zero",
        "near-chance",
        "wide-interval",
        "wide-s-bracket",
        "s-area",
        "orders-disagree",
    ],
)
def test_each_veto_turns_a_named_s_into_inconclusive(changes, words, stable):
    assert share_verdict(shares(), RULE).verdict == "S"  # the clean run names S
    decided = share_verdict(shares(**changes), RULE)
    assert decided.verdict == "inconclusive"
    assert words in decided.reason
    assert decided.stable is stable
    assert not decided.S_identified


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"walk_gain": 0.2}, "its readout walks"),
        ({"B_width_hi": 0.3}, "the B bracket is up to 0.30 of the gap wide"),
        ({"B_identified_area": 0.5}, "B is identified only at k's that carry 50%"),
    ],
    ids=["walks", "wide-b-bracket", "b-area"],
)
def test_each_veto_turns_a_named_b_into_inconclusive(changes, words):
    assert share_verdict(shares(s=0.05, b=0.9), RULE).verdict == "B"
    decided = share_verdict(shares(s=0.05, b=0.9, **changes), RULE)
    assert decided.verdict == "inconclusive"
    assert words in decided.reason
    assert not decided.B_identified


def test_mixed_needs_both_factors_identified_over_the_area():
    decided = share_verdict(shares(s=0.5, b=0.3, d=0.2, B_identified_area=0.5), RULE)
    assert decided.verdict == "inconclusive"
    assert "the split is not named" in decided.reason


# ------------------------------------------------------------------------ the metrics scored


def test_without_a_request_every_metric_the_set_defines_is_scored():
    registered, needing = ("accuracy", "cross_entropy", "kl_to_full"), ("accuracy",)
    assert scored_metrics(None, registered, needing, has_answers=True) == registered
    assert scored_metrics(None, registered, needing, has_answers=False) == registered[1:]
    assert scored_metrics(["kl_to_full"], registered, needing, has_answers=False) == ("kl_to_full",)


def test_a_requested_metric_that_needs_answers_is_refused_on_a_set_without_them():
    with pytest.raises(ValueError, match="'accuracy' needs answers.*drop 'accuracy'"):
        scored_metrics(["accuracy"], ("accuracy",), ("accuracy",), has_answers=False)


# ------------------------------------------------------------------------ validity


def decomposition(bracketed: bool = False) -> Decomposition:
    """A decomposition of planted qualities over `GRID` (``bracketed``: with a bracket whose
    verdict names S and identifies S and B at every k)."""
    rng = np.random.default_rng(0)
    n = 40
    full = rng.normal(size=n)
    values: dict[str, object] = {"full": full}
    for condition in ("truncate", "calibrate_truncate", "replay", "calibrate_replay", "shift"):
        values[condition] = {k: full - 0.1 * (R - k) for k in GRID}
    decomposed = decompose(values, GRID, n_iterations=R, n_bootstrap=20)
    if not bracketed:
        return decomposed
    return dataclasses.replace(
        decomposed,
        bracket=dict.fromkeys(BRACKET_ROW_KEYS, np.zeros(len(GRID))),
        bracket_shares={"verdict": "S", "reason": "S carries the gap.", "S_identified": True},
        s_identified=np.ones(len(GRID), bool),
        b_identified=np.ones(len(GRID), bool),
    )


def evidence(lower_bound: bool = True, **changes: object) -> RunEvidence:
    """The probe repairs the calibrated states at k = 1 and 3 only; replay reads out as
    truncate at k = 1 (below the tolerance) and differs at k = 2, 3."""
    probe = ProbeSummaryRecord(
        calibrate_truncate=[
            {"k": 1, "auroc": 0.5, "auroc_threshold": 0.6},
            {"k": 2, "auroc": 0.9, "auroc_threshold": 0.6},
            {"k": 3, "auroc": 0.55, "auroc_threshold": 0.6},
        ]
    )
    given: dict[str, object] = {
        "k_grid": GRID,
        "probe": probe,
        "replay_difference": {1: B_IDENTIFICATION_TOLERANCE / 2, 2: 0.5, 3: 0.2, 4: 0.0},
        "calibration_mode": "full",
        "lower_bound": lower_bound,
        "validation": {"accuracy": (True, "recovers the planted factors")},
    }
    return RunEvidence(**{**given, **changes})  # type: ignore[arg-type]


def test_without_a_bracket_identification_comes_from_the_probe_and_replay():
    decided = validity({"accuracy": decomposition()}, evidence())["accuracy"]
    assert decided.s_identified.tolist() == [True, False, True, False]
    assert decided.b_identified.tolist() == [False, True, True, False]
    assert decided.residual_auroc[:3].tolist() == [0.5, 0.9, 0.55]
    assert math.isnan(decided.residual_auroc[3])
    assert decided.residual_auroc_threshold[:3].tolist() == [0.6, 0.6, 0.6]
    assert decided.validated and decided.validation_reason == "recovers the planted factors"


def test_with_a_bracket_identification_is_the_brackets_and_the_probe_stays_beside_it():
    decided = validity({"accuracy": decomposition(bracketed=True)}, evidence())["accuracy"]
    assert decided.s_identified.all() and decided.b_identified.all()
    assert decided.residual_auroc[:3].tolist() == [0.5, 0.9, 0.55]


def test_a_map_that_bounds_nothing_leaves_s_unidentified_and_the_verdict_inconclusive():
    decided = validity({"accuracy": decomposition(bracketed=True)}, evidence(lower_bound=False))
    shares = decided["accuracy"].bracket_shares
    assert shares is not None and shares["verdict"] == "inconclusive"
    assert str(shares["reason"]).startswith(UNBOUNDED_MAP_REASON.format(mode="full"))
    assert not decided["accuracy"].s_identified.any()
    assert decided["accuracy"].b_identified.all()  # B is not the map's to bound
    # Without a bracket there is no verdict to hold back: the probe's flags stand.
    plain = validity({"accuracy": decomposition()}, evidence(lower_bound=False))["accuracy"]
    assert plain.s_identified.tolist() == [True, False, True, False]


def test_replay_within_the_tolerance_reads_as_truncate():
    assert evidence().replay_same() == {1: True, 2: False, 3: False, 4: True}


def test_a_metric_without_a_validation_record_is_refused():
    with pytest.raises(KeyError, match="no validation record for metric 'accuracy'"):
        validity({"accuracy": decomposition()}, evidence(validation={}))
