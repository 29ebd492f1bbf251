"""The S bracket's rule (dcp_lens.protocol.bracket, docs/bracket.md) on synthetic cells: every
branch of the discount, the ends, the identification and the verdict."""

from __future__ import annotations

import numpy as np
import pytest

from dcp_lens.protocol.bracket import (
    BRACKET_CONDITIONS,
    BracketInputError,
    BracketRule,
    bracket,
    bracket_ends,
    bracket_from_values,
    discounted_gain,
    has_gap,
)

K = 4
GRID = (1, 2, 3, 4)


def cells(noise: float = 0.002, n_draws: int = 200, seed: int = 0, **given: float):
    """Point cells (constant over k unless given as arrays) and draws around them."""
    point = {name: np.broadcast_to(np.asarray(v, float), (K,)).copy() for name, v in given.items()}
    rng = np.random.default_rng(seed)
    draws = {name: v + noise * rng.standard_normal((n_draws, K)) for name, v in point.items()}
    return point, draws


def curves(a, e, *, b=None, c=None, d=None, ta=None, tc=None, z=0.0):
    """Named cells with defaults: nothing repairs anything (b = a, replay = truncate...)."""
    b = a if b is None else b
    c = a if c is None else c
    d = c if d is None else d
    ta = b if ta is None else ta
    tc = d if tc is None else tc
    return dict(
        full=e,
        truncate=a,
        calibrate_truncate=b,
        replay=c,
        calibrate_replay=d,
        translate_truncate=ta,
        translate_replay=tc,
        base_rate=z,
    )


# ------------------------------------------------------------------------ the discount


@pytest.mark.parametrize(
    ("before", "after", "base", "expected"),
    [
        (0.5, 0.3, 0.1, -0.2),  # calibration hurts: the loss is kept whole
        (0.1, 0.3, 0.4, 0.0),  # the whole gain stays below the base rate: none counts
        (0.1, 0.9, 0.4, 0.5),  # only the gain above the base rate counts
        (0.5, 0.9, 0.4, 0.4),  # truncation already beats the base rate: the whole gain counts
    ],
)
def test_discounted_gain_counts_only_what_the_base_rate_cannot_reach(before, after, base, expected):
    gain = discounted_gain(np.asarray(before), np.asarray(after), np.asarray(base))
    assert float(gain) == pytest.approx(expected)


def test_both_ends_add_up_to_the_gap_and_the_lower_never_exceeds_the_upper():
    rng = np.random.default_rng(1)
    random = {name: rng.uniform(0, 1, 500) for name in ("full", *BRACKET_CONDITIONS)}
    ends = bracket_ends(random)
    for end in ("lower", "upper"):
        total = ends[f"S_{end}"] + ends[f"B_at_{end}"] + ends[f"D_at_{end}"]
        np.testing.assert_allclose(total, ends["gap"], atol=1e-12)
    assert (ends["S_lower"] <= ends["S_upper"] + 1e-12).all()
    assert (ends["B_lower"] <= ends["B_upper"]).all() and (ends["D_lower"] <= ends["D_upper"]).all()


def test_the_lower_end_is_todays_s_where_truncation_beats_the_base_rate():
    named = curves(0.4, 1.0, b=0.8, c=0.5, d=0.9, ta=0.95, tc=0.95, z=0.2)
    ends = bracket_ends({k: np.asarray(v) for k, v in named.items()})
    assert float(ends["S_lower"]) == pytest.approx(((0.8 - 0.4) + (0.9 - 0.5)) / 2)
    assert float(ends["S_upper"]) == pytest.approx(((0.95 - 0.4) + (0.95 - 0.5)) / 2)


# ------------------------------------------------------------------------ verdicts


def test_readout_shift_repaired_by_both_maps_is_identified_as_s():
    point, draws = cells(**curves(0.125, 1.0, b=1.0, d=1.0, ta=1.0, tc=1.0, z=0.125))
    result = bracket(point, draws, GRID)
    assert result.shares["S_lower"] == pytest.approx(1.0)
    assert result.S_identified and result.B_identified and result.stable
    assert result.verdict == "S"
    assert result.per_k["S_identified"].all()


def test_a_gap_no_affine_map_recovers_is_bounded_not_named_as_computation():
    # Computation and a non-affine shift of frame look alike to affine maps: the verdict says
    # what was shown (not recovered by an affine change of frame), not "distinct computation".
    point, draws = cells(**curves(0.09, 1.0, z=0.09))
    result = bracket(point, draws, GRID)
    assert result.verdict == "inconclusive" and result.bound == "not_affine", result.reason
    assert "not recovered by an affine change of frame" in result.reason
    assert result.shares["D_lower"] == pytest.approx(1.0)


def test_a_constant_update_that_both_maps_repair_is_split_by_order_and_inconclusive():
    # A walk along a line: calibration and replay each repair the whole gap, so S is 1 taken
    # first and 0 taken after replay; the midpoint 0.5 is a convention, not a measurement.
    point, draws = cells(**curves(0.125, 1.0, b=1.0, c=1.0, d=1.0, ta=1.0, tc=1.0, z=0.125))
    result = bracket(point, draws, GRID)
    assert result.shares["S_first"] == pytest.approx(1.0)
    assert result.shares["S_after_B"] == pytest.approx(0.0, abs=1e-9)
    assert result.shares["order_span"] == pytest.approx(1.0)
    assert not result.S_identified and not result.B_identified
    assert result.verdict == "inconclusive" and "the order decides" in result.reason
    # Per k the B bracket is narrow; the orders clearly differ, and the flag says so.
    from dcp_lens.protocol.verdicts import order_disagrees

    per_k = result.per_k
    assert order_disagrees(per_k["gap"], *percentile_bounds(draws), BracketRule()).all()


def test_order_differences_of_opposite_sign_do_not_cancel():
    # Replay repairs 0.5 of gap(1) and harms by 0.5 at k = 2: summed with signs both orders give
    # S = 1 over the area; taken at every k in the worse order, S is 0.69 and not named.
    a = np.full(K, 0.2)
    c = np.array([0.7, -0.3, 0.2, 0.2])
    point, draws = cells(**curves(a, 1.0, b=1.0, c=c, d=1.0, ta=1.0, tc=1.0, z=-1.0))
    result = bracket(point, draws, GRID)
    assert result.shares["order_difference"] == pytest.approx(0.0, abs=1e-9)
    assert result.shares["S_first"] == pytest.approx(result.shares["S_after_B"], abs=1e-9)
    assert result.shares["order_span"] == pytest.approx(1.0 / 3.2)
    assert result.shares["S_worse_order"] == pytest.approx(2.7 / 3.2)
    loose = bracket(point, draws, GRID, rule=BracketRule(named_share=0.9))
    assert loose.verdict == "inconclusive" and "the order decides" in loose.reason
    assert result.verdict == "S" and "in either order" in result.reason, result.reason


def test_a_factor_is_named_only_where_it_is_identified_over_most_of_the_area():
    # At k = 3, 4 the translator finds 0.12 of the gap more than calibration (S not identified
    # there); over the area the S bracket is 0.06 wide and S_lower 0.94, so only the per-k flags
    # stand between this and "S": they cover half the gap's area, less than the 80% a verdict
    # needs.
    b = np.array([1.0, 1.0, 0.88, 0.88])
    point, draws = cells(**curves(0.0, 1.0, b=b, d=b, ta=1.0, tc=1.0, z=0.0))
    result = bracket(point, draws, GRID)
    assert result.per_k["S_identified"].tolist() == [True, True, False, False]
    assert result.shares["S_width_hi"] <= 0.1 and result.shares["S_lower"] == pytest.approx(0.94)
    assert result.shares["S_identified_area"] == pytest.approx(0.5)
    assert result.verdict == "inconclusive" and "80%" in result.reason, result.reason
    loose = bracket(point, draws, GRID, rule=BracketRule(identified_area=0.5))
    assert loose.verdict == "S", loose.reason


def test_replay_reading_out_as_truncate_leaves_b_unidentified_but_s_named():
    point, draws = cells(**curves(0.125, 1.0, b=1.0, d=1.0, ta=1.0, tc=1.0, z=0.125))
    same = np.array([True, False, False, False])
    result = bracket(point, draws, GRID, replay_same=same)
    assert result.per_k["B_identified"].tolist() == [False, True, True, True]
    assert result.shares["B_identified_area"] == pytest.approx(1.0)
    assert result.verdict == "S", result.reason


def test_a_negative_gap_gives_ordered_ends_and_no_verdict():
    # Truncation beats full depth (a negative gap): dividing by it would flip the ends.
    point, draws = cells(**curves(0.8, 0.5, b=0.7, d=0.7, ta=0.6, tc=0.6, z=0.1))
    result = bracket(point, draws, GRID)
    assert result.shares["gap"] < 0
    for factor in ("S", "B", "D"):
        assert result.shares[f"{factor}_lower"] <= result.shares[f"{factor}_upper"]
        assert result.shares[f"{factor}_lower_lo"] <= result.shares[f"{factor}_upper_hi"]
    assert result.verdict == "inconclusive" and "not clearly above zero" in result.reason


def test_the_point_s_is_the_lower_end_on_a_negative_gap_too():
    # A translator that undoes more than the calibration: the ends differ, and on a negative gap
    # the lower end's share is the upper end's quantity divided by the gap.
    point, draws = cells(**curves(0.8, 0.5, b=0.7, d=0.7, ta=0.9, tc=0.9, z=0.1))
    result = bracket(point, draws, GRID)
    assert result.shares["gap"] < 0
    assert result.shares["S_lower"] < result.shares["S_upper"]
    assert result.shares["S_point"] == pytest.approx(result.shares["S_lower"])
    total = sum(result.shares[f"{factor}_point"] for factor in ("S", "B", "D"))
    assert total == pytest.approx(1.0)


def test_repeated_updates_that_translation_cannot_replace_are_identified_as_b():
    point, draws = cells(**curves(0.6, 1.0, c=1.0, d=1.0, tc=1.0, z=0.5))
    result = bracket(point, draws, GRID)
    assert result.verdict == "B", result.reason
    assert result.B_identified


def test_s_and_d_in_halves_is_mixed():
    point, draws = cells(**curves(0.0, 1.0, b=0.5, d=0.5, ta=0.5, tc=0.5, z=0.0))
    result = bracket(point, draws, GRID)
    assert result.verdict == "mixed", result.reason
    assert result.shares["S_lower"] == pytest.approx(0.5)


def test_mixed_needs_the_identified_ks_to_cover_the_gap():
    """S and D in halves, the S bracket narrow over the shares (0.09 of the gap) but wider
    than the tolerance at three of four k's: the split is not named, and no field claims S."""
    a, e, half = 0.0, 1.0, 0.5
    ta = np.array([0.62, 0.62, 0.62, 0.5])  # the translator's upper end 0.12 above at k = 1..3
    point, draws = cells(**curves(a, e, b=half, d=half, ta=ta, tc=ta, z=0.0))
    result = bracket(point, draws, GRID)
    assert result.shares["S_identified_area"] < 0.8
    assert result.verdict == "inconclusive", result.reason
    assert "identified only at k's" in result.reason
    assert not result.S_identified


def test_a_bound_not_recovered_by_affine_maps_claims_no_factor():
    """D at least 0.75 with narrow S and B brackets at 0: the verdict bounds what no affine map
    recovers, and the fields claim neither S nor B (a non-affine shift of frame is possible)."""
    point, draws = cells(**curves(0.0, 1.0, z=0.0))
    result = bracket(point, draws, GRID)
    assert result.verdict == "inconclusive" and result.bound == "not_affine"
    assert not result.S_identified and not result.B_identified
    assert result.per_k["S_identified"].all()  # per k the bracket is narrow all the same


def test_a_skewed_prior_gain_is_discounted_and_leaves_s_unidentified():
    # Marginal matching lifts truncation to the base rate and no further.
    point, draws = cells(**curves(0.09, 1.0, b=0.5, d=0.5, ta=0.5, tc=0.5, z=0.5))
    result = bracket(point, draws, GRID)
    assert result.shares["S_lower"] == pytest.approx(0.0, abs=0.01)
    assert result.shares["S_upper"] == pytest.approx(0.41 / 0.91, abs=0.01)
    assert not result.S_identified
    assert result.verdict == "inconclusive" and "readout shift is not identified" in result.reason


def test_a_frame_change_marginal_matching_cannot_see_leaves_s_unidentified():
    point, draws = cells(**curves(0.0, 1.0, ta=1.0, tc=1.0, z=0.06))
    result = bracket(point, draws, GRID)
    assert result.shares["S_lower_lo"] <= 0.0 and result.shares["S_upper_hi"] >= 1.0
    assert not result.S_identified and not result.per_k["S_identified"].any()
    assert result.verdict == "inconclusive"


def test_a_gap_that_may_be_zero_is_inconclusive():
    point, draws = cells(noise=0.02, **curves(0.7, 0.7, b=0.72, z=0.1))
    result = bracket(point, draws, GRID)
    assert result.verdict == "inconclusive" and "not clearly above zero" in result.reason
    assert not result.stable and not result.per_k["S_identified"].any()


def test_a_gap_near_chance_with_a_wide_share_is_inconclusive():
    # Full-depth accuracy 0.38, gap 0.018, S 0.788 [0.313, 1.880]: the gap is above zero, the
    # share's interval is far too wide to name a factor.
    a, e = 0.362, 0.38
    point, draws = cells(noise=0.004, **curves(a, e, b=a + 0.0142, ta=a + 0.0142, z=0.33))
    result = bracket(point, draws, GRID)
    assert result.shares["gap_lo"] > 0
    assert result.shares["S_point_interval"] > 0.3
    assert result.verdict == "inconclusive" and not result.stable
    assert "too wide to name a factor" in result.reason


def test_full_depth_at_the_base_rate_is_inconclusive():
    point, draws = cells(**curves(0.2, 0.5, b=0.5, ta=0.5, z=0.5))
    result = bracket(point, draws, GRID)
    assert result.verdict == "inconclusive" and "base rate" in result.reason


def test_replay_gains_on_walking_examples_leave_b_unidentified():
    point, draws = cells(**curves(0.0, 1.0, c=0.5, d=0.5, tc=0.5, z=0.05))
    walked = bracket(point, draws, GRID, walk_gain=np.array([0.5, 0.5, 0.5, 0.0]))
    assert not walked.B_identified
    assert walked.per_k["B_identified"].tolist() == [False, False, False, True]
    assert walked.shares["walk_gain"] == pytest.approx(1.5 / 4)
    assert "walks to answers later iterations read" in walked.reason
    assert bracket(point, draws, GRID, walk_gain=np.zeros(K)).B_identified


def test_a_walk_gain_of_a_loss_is_negated_with_the_values():
    n = 400
    values = {"full": np.zeros(n), "base_rate": np.full(n, 3.0)}
    for name in BRACKET_CONDITIONS:
        if name != "base_rate":
            values[name] = {k: np.full(n, 1.0) for k in GRID}
    for name in ("replay", "calibrate_replay", "translate_replay"):
        values[name] = {k: np.full(n, 0.6) for k in GRID}
    # On walking examples replay lowers the loss by 0.4 on average: a gain of 0.4 of a gap of 1.
    flagged = bracket_from_values(
        values, GRID, higher_is_better=False, n_bootstrap=20, walk_gain=np.full(K, -0.4)
    )
    assert flagged.shares["walk_gain"] == pytest.approx(0.4)
    assert not flagged.B_identified
    quiet = bracket_from_values(values, GRID, higher_is_better=False, n_bootstrap=20)
    assert quiet.B_identified and quiet.verdict == "mixed"  # B 0.4, D 0.6


def test_per_k_identification_follows_each_ks_bracket():
    a = np.array([0.1, 0.1, 0.1, 0.1])
    ta = np.array([0.1, 0.1, 1.0, 1.0])  # the translator repairs k = 3, 4 alone
    point, draws = cells(**curves(a, 1.0, ta=ta, z=0.1))
    result = bracket(point, draws, GRID)
    assert result.per_k["S_identified"].tolist() == [True, True, False, False]


# ------------------------------------------------------------------------ inputs


def test_losses_are_negated_into_qualities():
    rng = np.random.default_rng(3)
    n = 300
    loss = {"full": rng.uniform(0, 0.1, n)}
    for name in BRACKET_CONDITIONS:
        loss[name] = {k: rng.uniform(0.5, 2.0, n) for k in GRID}
    as_loss = bracket_from_values(loss, GRID, higher_is_better=False, n_bootstrap=50)
    negated = {
        name: (-v if isinstance(v, np.ndarray) else {k: -x for k, x in v.items()})
        for name, v in loss.items()
    }
    as_quality = bracket_from_values(negated, GRID, n_bootstrap=50)
    assert as_loss.shares == pytest.approx(as_quality.shares, nan_ok=True)
    assert as_loss.shares["gap"] > 0


def test_missing_cells_and_bad_shapes_are_refused():
    point, draws = cells(**curves(0.1, 1.0))
    with pytest.raises(BracketInputError, match="translate_replay"):
        bracket({k: v for k, v in point.items() if k != "translate_replay"}, draws, GRID)
    with pytest.raises(BracketInputError, match="expected"):
        bracket({**point, "truncate": point["truncate"][:2]}, draws, GRID)
    with pytest.raises(BracketInputError, match="walk_gain"):
        bracket(point, draws, GRID, walk_gain=np.zeros(1))
    with pytest.raises(BracketInputError, match="tolerance"):
        BracketRule(tolerance=2.0)


# ------------------------------------------------------- walking replay and small gaps


def test_a_walking_replay_widens_b_down_and_d_up_by_its_gain_so_the_truth_d_stays_inside():
    # Replay gains 0.3 over truncation at every k, all of it on walking examples (the readout
    # extrapolates along the answers): the truth is D = 1, B = 0.
    a = np.array([0.1, 0.3, 0.5, 1.0])
    c = np.minimum(a + 0.3, 1.0)
    walk = c - a
    point, draws = cells(**curves(a, 1.0, c=c, z=0.0))
    plain = bracket(point, draws, GRID)
    walked = bracket(point, draws, GRID, walk_gain=walk)
    assert plain.shares["B_lower_lo"] > 0.1  # without the walk, B excludes its truth 0
    assert walked.shares["B_lower_lo"] <= 0.0 <= walked.shares["B_upper_hi"]
    assert walked.shares["D_lower_lo"] <= 1.0 <= walked.shares["D_upper_hi"] + 1e-9
    assert not walked.B_identified and walked.verdict == "inconclusive"


def test_a_width_of_bootstrap_noise_at_an_almost_free_k_is_not_an_alarm():
    # Truncation costs 0.6 at k = 1 and 0.004 at k = 3: a bracket 0.003 wide there is noise.
    a = np.array([0.4, 0.8, 0.996, 1.0])
    ta = a + np.array([0.0, 0.0, 0.003, 0.0])
    point, draws = cells(noise=0.0005, **curves(a, 1.0, b=a, ta=ta, z=0.0))
    floored = bracket(point, draws, GRID)
    strict = bracket(point, draws, GRID, rule=BracketRule(gap_floor=0.0))
    assert bool(floored.per_k["S_identified"][2]) and not bool(strict.per_k["S_identified"][2])
    # A bracket as wide as that k's gap is flagged with the floor too (the floor is 0.25 of the
    # largest gap times the tolerance: 0.015 here).
    wide = bracket(*cells(noise=0.0005, **curves(a, 1.0, b=a, ta=a + (1.0 - a) * 0.9)), GRID)
    assert not bool(wide.per_k["S_identified"][0]) and not bool(wide.per_k["S_identified"][1])


def test_a_gap_of_float_rounding_is_no_gap_to_identify():
    # A loss metric where truncation at k = 4 already reads full depth's answer: its gap is 1e-9
    # (rounding), clear of zero by a tight interval, and its bracket "narrow" against the floor.
    a = np.array([0.2, 0.2, 0.2, 1.0 - 1e-9])
    ta = np.array([1.0, 1.0, 1.0, 1.0])  # the translator repairs k = 1..3: S not identified
    point, draws = cells(noise=1e-12, **curves(a, 1.0, ta=ta, z=0.0))
    result = bracket(point, draws, GRID)
    assert result.per_k["gap_lo"][3] > 0
    assert result.per_k["S_identified"].tolist() == [False, False, False, False]
    assert not bool(result.per_k["B_identified"][3])
    # The rule's floor is stated and can be turned off: then k = 4 counts as a narrow bracket.
    exact = bracket(point, draws, GRID, rule=BracketRule(negligible_gap=0.0))
    assert bool(exact.per_k["S_identified"][3])
    # A real gap of a millionth of the largest and up is still a gap.
    assert has_gap([1e-6, 1e-9, 0.0, 0.5], [1e-6, 1e-9, 0.0, 0.5], BracketRule()).tolist() == [
        True,
        False,
        False,
        True,
    ]


def percentile_bounds(draws):
    """I_BS's 95% interval per k from the cells' draws."""
    from dcp_lens.protocol.equations import order_difference

    names = ("truncate", "calibrate_truncate", "replay", "calibrate_replay")
    spread = order_difference(*(np.asarray(draws[name]) for name in names))
    return np.percentile(spread, 2.5, axis=0), np.percentile(spread, 97.5, axis=0)


# ------------------------------------------------------------------------ the words


@pytest.mark.parametrize(
    ("least", "point", "start"),
    [
        (0.982, 0.996, "At least 98% of the truncation gap"),
        (0.998, 1.0, "100% of the truncation gap"),  # the bound is the point: no "at least"
    ],
)
def test_at_least_only_for_a_bound_below_the_point(least, point, start):
    from dcp_lens.protocol.wording import _bracket_verdict

    record = {
        "verdict": "S",
        "reason": "",
        "S_lower": point,
        "S_upper": 1.0,
        "S_lower_lo": least,
        "S_upper_hi": 1.01,
    }
    text = _bracket_verdict(record)
    assert text.startswith(start), text
    assert "S bracket [" in text and "(95% interval [" in text
    assert "readout shift that an affine change of frame undoes" in text
