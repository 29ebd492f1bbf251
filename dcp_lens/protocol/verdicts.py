"""Every validity decision of a DCP run, made in one place.

The numbers come from the protocol (`dcp_lens.protocol.bracket`, `dcp_lens.protocol.decomposition`);
what they allow is decided here, as functions of typed inputs:

- per k: is S identified, is B identified (`identify_per_k`, `identification` for runs without a
  bracket), do the two orders of S and B clearly differ (`order_disagrees`), is the gap a gap
  (`has_gap`);
- per metric: the verdict on the shares and its reason (`share_verdict`): a factor is named only
  where the k's at which it is identified carry at least `BracketRule.identified_area` of the
  gap's area, it holds in both orders of S and B, and the gap is clearly above zero;
- per run: which metrics are scored (`scored_metrics`) and every validity field of each metric's
  decomposition (`validity`, from the run's `RunEvidence`).

The console, ``results.json``, the report and the notebooks render what these functions decided
(`dcp_lens.protocol.wording` holds the words). What the words claim is the map class: S is
readout shift that an affine change of frame undoes; what no affine map recovers is "distinct
computation, or a non-affine shift", never named as computation without a test that tells the
two apart (none is run: such a verdict is inconclusive, with ``bound = "not_affine"``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from dcp_lens.protocol.records import ProbeSummaryRecord
from dcp_lens.protocol.results import FACTORS, Decomposition
from dcp_lens.utils.errors import DCPLensError

# The verdicts on a metric's shares. D (distinct computation) is not among them: no test run
# here tells computation from a shift of frame that no affine map undoes, so a gap that the
# affine maps do not recover is "inconclusive" with ``bound = "not_affine"``.
VERDICTS = ("S", "B", "mixed", "inconclusive")
# Logit difference (nats) below which replay(k) and truncate(k) count as the same readout: B and
# I_BS are then zero by construction (a norm at the readout ignores replay's scaling), not found.
B_IDENTIFICATION_TOLERANCE = 1e-3
NULL_TOLERANCE = 1e-4  # max |logit diff| the exact null controls must stay within (float error)
SMALL_GAP = 1e-3  # a mean gap below this (quality units) leaves shares unstable
# Confidence matching's temperatures outside this range are reported: the loss metrics of those
# cells are scored at a temperature that rescales the readout's confidence by more than 20x.
SANE_TEMPERATURES = (0.05, 20.0)
NOT_AFFINE = "not_affine"
# Why a calibration map that is no lower bound on readout shift leaves every verdict inconclusive.
UNBOUNDED_MAP_REASON = (
    "the calibration map {mode!r} can carry out remaining computation itself (it moves each state"
    " anywhere on full depth's marginal), so its gain is no lower bound on readout shift and S is"
    " not identified; run with an affine map (--calibration-mode full) for a verdict."
)


class BracketInputError(DCPLensError):
    """Cells handed to the bracket are missing, misshapen or inconsistent."""


@dataclass(frozen=True)
class BracketRule:
    """The stated tolerances of the identification and verdict rule (docs/bracket.md).

    Attributes:
        tolerance: largest bracket width (upper end of its interval), as a share of the gap, for
            S (or B) to count as identified.
        max_share_interval: widest interval of a share's point estimate (the lower end's
            ``S_lower`` and the B and D that go with it) that still lets a verdict name a factor.
        named_share: a factor is named alone when the lower end of its whole bracket (interval
            included) reaches this share; otherwise the verdict is ``"mixed"``.
        walk_tolerance: largest share of the gap that replay may gain on examples whose replay
            walks (its top-1 is neither truncate(k)'s nor full depth's but one a later truncation
            reads: the repeated update performed later steps) for B to count as identified.
        gap_floor: per k, the width is compared with ``tolerance`` times the larger of gap(k) and
            this share of the largest gap over the grid: where truncation costs almost nothing
            (the last k before r) a width of a few thousandths is the bootstrap's noise, not an
            unidentified share.
        negligible_gap: per k, a gap whose interval's lower end is at most this share of the
            grid's largest gap is no gap: float rounding (a loss metric's 1e-9 nats where
            truncation already reads full depth's answer) is not a gap whose bracket could be
            narrow, so such a k is not identified, like one whose gap may be zero
            (`has_gap`).
        identified_area: a factor is named only where the k's at which S and B are identified
            (`identify_per_k`; B zero by construction counts as identified) carry at least
            this share of the gap's area (`identified_area`).
        confidence: coverage of the percentile intervals.
    """

    tolerance: float = 0.1
    max_share_interval: float = 0.3
    named_share: float = 0.75
    walk_tolerance: float = 0.05
    gap_floor: float = 0.25
    negligible_gap: float = 1e-6
    identified_area: float = 0.8
    confidence: float = 0.95

    def __post_init__(self) -> None:
        names = ("tolerance", "max_share_interval", "named_share", "walk_tolerance", "gap_floor",
                 "negligible_gap", "identified_area")  # fmt: skip
        for name in names:
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0.0 <= value <= 1.0):
                raise BracketInputError(
                    f"BracketRule.{name}={value!r} must be a number in [0, 1] (a share of the gap)."
                )
        if not 0.0 < self.confidence < 1.0:
            raise BracketInputError(
                f"BracketRule.confidence={self.confidence!r} must lie strictly between 0 and 1."
            )


def has_gap(
    gap_lo: np.ndarray | Sequence[float], gap: np.ndarray | Sequence[float], rule: BracketRule
) -> np.ndarray:
    """``[K]`` bool: the k's with a gap to decompose: the lower end of gap(k)'s interval
    ``gap_lo`` above zero and above `BracketRule.negligible_gap` times the largest of the grid's
    point gaps ``gap`` (NaN gaps ignored). `dcp-lens validate` counts flags over these k's."""
    lower, gaps = np.asarray(gap_lo, dtype=float), np.asarray(gap, dtype=float)
    finite = gaps[np.isfinite(gaps)]
    largest = float(finite.max()) if finite.size else 0.0
    with np.errstate(invalid="ignore"):  # the threshold is >= 0: above it is above zero
        return lower > rule.negligible_gap * max(largest, 0.0)


def allowed_width(gap: np.ndarray, rule: BracketRule) -> np.ndarray:
    """``[K]``: the widest bracket (or order difference) that still counts as identified at each
    k: `BracketRule.tolerance` times the larger of gap(k) and `BracketRule.gap_floor` times the
    grid's largest gap."""
    gap = np.asarray(gap, dtype=float)
    with np.errstate(invalid="ignore"):
        largest = np.nanmax(gap) if np.isfinite(gap).any() else np.nan
        return np.asarray(rule.tolerance * np.maximum(gap, rule.gap_floor * largest))


def order_disagrees(
    gap: np.ndarray | Sequence[float], i_bs_lo: np.ndarray | Sequence[float],
    i_bs_hi: np.ndarray | Sequence[float], rule: BracketRule,
) -> np.ndarray:  # fmt: skip
    """``[K]`` bool: S taken first and S taken after replay clearly differ by more than the
    tolerance at k (I_BS(k)'s 95% interval lies beyond `allowed_width` on one side)."""
    allowed = allowed_width(np.asarray(gap, dtype=float), rule)
    with np.errstate(invalid="ignore"):
        low, high = np.asarray(i_bs_lo, dtype=float), np.asarray(i_bs_hi, dtype=float)
        return np.asarray((low > allowed) | (high < -allowed))


def identify_per_k(
    per_k: Mapping[str, np.ndarray], walk: np.ndarray, replay_same: np.ndarray, rule: BracketRule
) -> dict[str, np.ndarray]:
    """Per k: ``S_identified`` (the gap is clearly above zero and the S bracket is narrow) and
    ``B_identified`` (the same for the B bracket, replay does not walk, and replay reads out
    differently from truncate: where it does not, B = 0 by construction, not by measurement).
    The order of S and B is judged over the shares (``order_span``), where the noise of
    |I_BS(k)| at small gaps averages out; per k, `order_disagrees` names the k's where the
    orders clearly differ.

    Args:
        per_k: ``gap``, ``gap_lo``, ``S_width_hi``, ``B_width_hi``, ``order_width_hi`` ``[K]``.
        walk: replay's gain on walking examples, ``[K]`` (quality units).
        replay_same: ``[K]`` bool, replay(k) reads out as truncate(k) up to float error.
    """
    gap = np.asarray(per_k["gap"], dtype=float)
    clear = has_gap(per_k["gap_lo"], gap, rule)
    allowed = allowed_width(gap, rule)
    with np.errstate(invalid="ignore"):
        s_narrow = np.asarray(per_k["S_width_hi"]) <= allowed
        b_narrow = np.asarray(per_k["B_width_hi"]) <= allowed
        walked = walk > rule.walk_tolerance * gap
    return {
        "S_identified": clear & s_narrow,
        "B_identified": clear & b_narrow & ~walked & ~replay_same,
    }


def identified_area(
    per_k: Mapping[str, np.ndarray], replay_same: np.ndarray, used: np.ndarray
) -> dict[str, float]:
    """Per factor, the share of the gap's area (positive gaps over the k in ``used``) carried by
    the k's where that factor is identified: ``S_identified_area`` (S identified; D, the rest
    of the gap after the affine maps, is identified where S is) and ``B_identified_area`` (B
    identified, or zero by construction: with replay reading out as truncate, B = I_BS = 0).
    NaN where no k has a positive gap."""
    gap = np.where(used, np.nan_to_num(np.asarray(per_k["gap"], dtype=float)), 0.0)
    positive = np.maximum(gap, 0.0)
    total = float(positive.sum())
    masks = {
        "S_identified_area": np.asarray(per_k["S_identified"], bool),
        "B_identified_area": np.asarray(per_k["B_identified"], bool) | replay_same,
    }
    return {
        name: float((positive * mask).sum()) / total if total > 0 else math.nan
        for name, mask in masks.items()
    }


@dataclass(frozen=True)
class ShareVerdict:
    """The verdict on one metric's shares (`share_verdict`)."""

    verdict: str  # one of VERDICTS
    reason: str
    stable: bool
    S_identified: bool
    B_identified: bool
    bound: str | None = None  # NOT_AFFINE: most of the gap is not recovered by an affine map


def share_verdict(shares: Mapping[str, float], rule: BracketRule) -> ShareVerdict:
    """The verdict on the shares of one metric (docs/bracket.md, "The verdict").

    ``shares``: the bracket's shares (`dcp_lens.protocol.bracket.Bracket.shares`): ``gap`` with
    its interval, ``headroom_lo``, the widths ``S_width_hi``, ``B_width_hi``, the orders
    (``S_first``, ``S_after_B``, ``B_first``, ``B_after_S``, ``order_difference``,
    ``order_span``, ``order_span_hi``, ``S_worse_order``, ``B_worse_order``), ``walk_gain``,
    ``S_identified_area``, ``B_identified_area``, each factor's bracket and the point intervals.

    No factor is named unless the gap is clearly above zero, full depth clearly above the base
    rate and every point share's interval at most ``max_share_interval`` wide. S (or B) is
    named when its least share reaches ``named_share``: the lower end of its bracket, interval
    included, and, where the two orders of S and B disagree by more than ``tolerance``
    (``order_span_hi``: |I_BS(k)| summed over k, so that opposite signs do not cancel), its share
    in the worse order at every k; and when it is identified itself: its bracket narrow (B: and
    replay not walking) and identified at k's that carry at least ``identified_area`` of the
    gap's area. How the rest of the gap splits does not block it and is said beside it. A gap
    the affine maps do not recover (D's bracket at or above ``named_share``) is "inconclusive"
    with ``bound = "not_affine"``: D is never named. Otherwise "mixed" where S and B are
    identified, the orders agree and the k's where each is identified carry at least
    ``identified_area`` of the gap's area; "inconclusive" with the reasons where not.

    The record's ``S_identified`` / ``B_identified`` claim only what a verdict could name: the
    factor's bracket narrow, the orders agreeing, its identified k's carrying at least
    ``identified_area`` of the gap's area, the gap clearly a gap, and no ``not_affine`` bound
    (what no affine map recovers may be a shift of frame the maps cannot see).
    """
    if not math.isfinite(shares.get("gap", math.nan)):
        reason = "no k has every cell finite, so there are no shares."
        return ShareVerdict("inconclusive", reason, False, False, False)
    orders_agree = _le(shares.get("order_span_hi"), rule.tolerance)
    walked = _gt(shares.get("walk_gain"), rule.walk_tolerance)
    s_narrow = _le(shares.get("S_width_hi"), rule.tolerance)
    b_narrow = _le(shares.get("B_width_hi"), rule.tolerance) and not walked
    # A field claims only what a verdict could name: the bracket narrow, the orders agreeing
    # and the k's where the factor is identified carrying most of the gap's area.
    s_covered = _ge(shares.get("S_identified_area"), rule.identified_area)
    b_covered = _ge(shares.get("B_identified_area"), rule.identified_area)
    s_identified = s_narrow and orders_agree and s_covered
    b_identified = b_narrow and orders_agree and b_covered
    reasons: list[str] = []
    if not _gt(shares.get("gap_lo"), 0.0):
        reasons.append(
            f"the truncation gap is not clearly above zero (area {shares['gap']:.3g}, 95%"
            f" interval [{shares.get('gap_lo', math.nan):.3g},"
            f" {shares.get('gap_hi', math.nan):.3g}]): shares of a gap that may be zero or"
            " negative are not formed."
        )
    if not _gt(shares.get("headroom_lo"), 0.0):
        reasons.append(
            "full depth is not clearly better than the base rate (a readout with no information"
            " about the example): the gap is a gap near chance."
        )
    widest = max(shares.get(f"{f}_point_interval", math.nan) for f in FACTORS)
    stable = not reasons and _le(widest, rule.max_share_interval)
    if not reasons and not stable:
        reasons.append(
            f"a share's 95% interval is {widest:.2f} wide, more than {rule.max_share_interval:g}:"
            " too wide to name a factor."
        )
    if reasons:  # the gap itself: there are no shares to name, nor a factor identified
        return ShareVerdict("inconclusive", " ".join(reasons), stable, False, False)
    s_words = "" if s_narrow else (
        f"readout shift is not identified: the S bracket [{shares['S_lower']:.2f},"
        f" {shares['S_upper']:.2f}] is up to {shares['S_width_hi']:.2f} of the gap wide"
        f" (tolerance {rule.tolerance:g}); marginal matching and a paired affine translator"
        " disagree."
    )  # fmt: skip
    walk_words = (
        f"{shares.get('walk_gain', math.nan):.2f} of the gap is replay's gain on examples where"
        " its readout walks to answers later iterations read (the repeated update may be"
        " computation)"
    )
    b_words = "" if b_narrow else (
        "block applications are not identified: "
        + (walk_words if walked else f"the B bracket is up to {shares['B_width_hi']:.2f} of the"
           " gap wide") + "."
    )  # fmt: skip
    order = {key: shares.get(key, math.nan) for key in (
        "S_first", "S_after_B", "B_first", "B_after_S", "order_span", "order_span_hi")}  # fmt: skip
    order_words = "" if orders_agree else (
        f"the order decides part of the split of S and B: S is {_two(order['S_first'])} of the"
        f" gap taken first and {_two(order['S_after_B'])} taken after replay (B"
        f" {_two(order['B_after_S'])} and {_two(order['B_first'])}); summed over k the orders"
        f" differ by {_two(order['order_span'])} of the gap (up to"
        f" {_two(order['order_span_hi'])} with the interval), more than the tolerance"
        f" {rule.tolerance:g}."
    )  # fmt: skip
    # Each factor's least share: its bracket's lower end (interval included) and, where the
    # orders disagree, its share in the worse order at every k.
    lows = {f: _worse_order(shares, f, orders_agree) for f in FACTORS}
    named = [f for f in FACTORS if _ge(lows[f], rule.named_share)]
    if len(named) == 1 and named[0] in ("S", "B"):
        # A factor is named on its own identification: its bracket narrow and identified at
        # k's that carry most of the gap's area; how the rest splits does not change it.
        factor = named[0]
        own = s_words if factor == "S" else b_words
        area = shares.get(f"{factor}_identified_area", math.nan)
        if not own and not _ge(area, rule.identified_area):
            own = (
                f"{factor} is identified only at k's that carry {area:.0%} of the gap's area,"
                f" less than the {rule.identified_area:.0%} a verdict needs (the per-k flags say"
                " where)."
            )
        if own:
            return ShareVerdict("inconclusive", own, stable, s_identified, b_identified)
        rest = " ".join(w for w in (b_words if factor == "S" else s_words, order_words) if w)
        reason = (
            f"{factor} is at least {lows[factor]:.2f} of the gap's area, bracket and 95% interval"
            + (" included, in either order." if order_words else " included.")
            + (f" Beside it: {rest}" if rest else "")
        )
        return ShareVerdict(factor, reason, stable, s_identified, b_identified)
    if named == ["D"]:
        # D is never named: its lower end bounds what no affine map recovers.
        reason = (
            f"at least {lows['D']:.2f} of the gap's area is not recovered by an affine change of"
            " frame (distinct computation, or a non-affine shift): no test run here tells the"
            " two apart."
        )
        # What no affine map recovers may be a shift of frame: neither factor is identified.
        return ShareVerdict("inconclusive", reason, stable, False, False, NOT_AFFINE)
    pending = " ".join(w for w in (s_words, order_words, b_words) if w)
    areas = {f: shares.get(f"{f}_identified_area", math.nan) for f in ("S", "B")}
    uncovered = [
        f"{f} is identified only at k's that carry {areas[f]:.0%} of the gap's area"
        for f, covered in (("S", s_covered), ("B", b_covered))
        if not covered
    ]
    if not pending and uncovered:
        pending = (
            f"{'; '.join(uncovered)}, less than the {rule.identified_area:.0%} a verdict needs"
            " (the per-k flags say where): the split is not named."
        )
    if pending:
        return ShareVerdict("inconclusive", pending, stable, s_identified, b_identified)
    parts = ", ".join(
        f"{f} [{shares[f'{f}_lower_lo']:.2f}, {shares[f'{f}_upper_hi']:.2f}]" for f in FACTORS
    )
    reason = f"no factor reaches {rule.named_share:g} of the gap: {parts}."
    return ShareVerdict("mixed", reason, stable, s_identified, b_identified)


def _worse_order(shares: Mapping[str, float], factor: str, orders_agree: bool) -> float:
    """The lower end of ``factor``'s bracket (interval included) and, where the orders of S and
    B disagree, of its share taking the worse order at every k (``S_worse_order_lo``: no
    cancellation between k's): the least the data allow it, whichever order."""
    low = shares.get(f"{factor}_lower_lo", math.nan)
    if orders_agree or factor == "D":
        return low
    values = [low, shares.get(f"{factor}_worse_order_lo", math.nan)]
    return min(values) if all(_finite(v) for v in values) else math.nan


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _le(value: float | None, limit: float) -> bool:
    return _finite(value) and value <= limit  # type: ignore[operator]


def _ge(value: float | None, limit: float) -> bool:
    return _finite(value) and value >= limit  # type: ignore[operator]


def _gt(value: float | None, limit: float) -> bool:
    return _finite(value) and value > limit  # type: ignore[operator]


def replay_same(metadata: Mapping[str, object], k_grid: Sequence[int]) -> np.ndarray:
    """``[K]`` bool from a run's metadata: replay(k) reads out as truncate(k) within
    `B_IDENTIFICATION_TOLERANCE` (``replay_truncate_max_abs_logit_diff``; False where absent)."""
    differences = metadata.get("replay_truncate_max_abs_logit_diff")
    if not isinstance(differences, Mapping):
        differences = {}
    values = [differences.get(str(k), differences.get(k)) for k in k_grid]
    return np.array(
        [isinstance(v, float | int) and _le(v, B_IDENTIFICATION_TOLERANCE) for v in values],
        dtype=bool,
    )


def identification(
    probe: ProbeSummaryRecord, k_grid: Sequence[int], replay_difference: Mapping[int, float]
) -> dict[str, np.ndarray]:
    """Per k of ``k_grid``: is S identified (the calibrated truncated states pass the probe's
    null, or the truncated states were never told apart) and is B identified (replay(k) reads out
    differently from truncate(k) beyond `B_IDENTIFICATION_TOLERANCE`)?

    Returns:
        ``s_identified``, ``b_identified`` (bool arrays) and ``residual_auroc``,
        ``residual_auroc_threshold`` (float arrays), one entry per k, as `Decomposition` holds.
    """
    by_k = {row["k"]: row for row in probe.calibrate_truncate or ()}
    auroc = np.array([by_k.get(k, {}).get("auroc", math.nan) for k in k_grid], float)
    threshold = np.array([by_k.get(k, {}).get("auroc_threshold", math.nan) for k in k_grid], float)
    # Truncated states that are themselves indistinguishable from full depth have no shift to
    # repair (discrete states, as in planted distinct_computation, where any calibration
    # moves them off their lattice and the classifier sees that).
    raw = {row["iteration"]: row for row in probe.trajectory}
    raw_auroc = np.array([raw.get(k, {}).get("auroc", math.nan) for k in k_grid], float)
    raw_threshold = np.array(
        [raw.get(k, {}).get("auroc_threshold", math.nan) for k in k_grid], float
    )
    replay = np.array([replay_difference.get(k, math.nan) for k in k_grid], float)
    with np.errstate(invalid="ignore"):
        repaired = np.isfinite(auroc) & (auroc <= threshold)
        unshifted = np.isfinite(raw_auroc) & (raw_auroc <= raw_threshold)
        return {
            "s_identified": repaired | unshifted,
            "b_identified": np.isfinite(replay) & (replay > B_IDENTIFICATION_TOLERANCE),
            "residual_auroc": auroc,
            "residual_auroc_threshold": threshold,
        }


def _two(value: float) -> str:
    """``value`` with two decimals, never "-0.00" (a rounding's sign is not a finding)."""
    return f"{round(float(value), 2) + 0.0:.2f}"


def scored_metrics(
    requested: Sequence[str] | None,
    registered: Sequence[str],
    needing_answers: Collection[str],
    has_answers: bool,
) -> tuple[str, ...]:
    """The metrics a run scores: ``requested``, else every ``registered`` metric the evaluation
    set defines (those in ``needing_answers`` only where it ``has_answers``).

    Raises:
        ValueError: a requested metric reads answers that the evaluation set does not have.
    """
    if requested is None:
        return tuple(m for m in registered if has_answers or m not in needing_answers)
    needing = [m for m in requested if m in needing_answers]
    if needing and not has_answers:
        raise ValueError(
            f"metric {needing[0]!r} needs answers, but this evaluation set is plain language "
            f"modelling (EvaluationSet.from_tokens); drop {needing[0]!r} from metrics or "
            "build the set from a task with answers."
        )
    return tuple(requested)


@dataclass(frozen=True)
class RunEvidence:
    """What a run's validity is decided from, beside each metric's decomposition.

    Attributes:
        k_grid: the run's k grid, ``K`` entries.
        probe: the residual-stream probe's summary (empty trajectories without a probe).
        replay_difference: per k, max |readout(replay(k)) - readout(truncate(k))| over every
            evaluation (`dcp_lens.protocol.sweep_records.SweepOutput.replay_difference`).
        calibration_mode: the S control's map (`ProtocolConfig.calibration_mode`).
        lower_bound: whether that map's gain bounds readout shift from below
            (`dcp_lens.protocol.calibration.CalibrationMap.lower_bound`).
        validation: per metric, whether `dcp-lens validate` recovers the planted factors with
            it and why (`dcp_lens.protocol.metrics.VALIDATION`).
    """

    k_grid: tuple[int, ...]
    probe: ProbeSummaryRecord
    replay_difference: Mapping[int, float]
    calibration_mode: str
    lower_bound: bool
    validation: Mapping[str, tuple[bool, str]]

    def replay_same(self) -> dict[int, bool]:
        """Per k measured: replay(k) reads out as truncate(k) within
        `B_IDENTIFICATION_TOLERANCE` (B is then 0 by construction; `decompose`'s input)."""
        return {k: v <= B_IDENTIFICATION_TOLERANCE for k, v in self.replay_difference.items()}


def validity(
    decompositions: Mapping[str, Decomposition], evidence: RunEvidence
) -> dict[str, Decomposition]:
    """Every metric's decomposition with its validity decided.

    Per k: S and B identified from the bracket where the decomposition has one, else from the
    probe and replay (`identification`); the probe's residual AUROC and its threshold beside
    them. Per metric: validated or not, and why (``evidence.validation``). Where the
    calibration map is no lower bound on readout shift, S is identified at no k and the
    bracket's verdict is inconclusive (`UNBOUNDED_MAP_REASON`).

    Args:
        decompositions: per metric, `decompose`'s output over ``evidence.k_grid`` (``[K]`` per
            field).
        evidence: what the run measured beside the decompositions.

    Returns:
        The decompositions with ``s_identified``, ``b_identified`` (``[K]`` bool),
        ``residual_auroc``, ``residual_auroc_threshold`` (``[K]`` float), ``validated`` and
        ``validation_reason`` set, in the order of ``decompositions``.
    """
    flags = identification(evidence.probe, evidence.k_grid, evidence.replay_difference)
    decided = {}
    for metric, decomposed in decompositions.items():
        if metric not in evidence.validation:
            raise KeyError(
                f"no validation record for metric {metric!r}; expected one of "
                f"{sorted(evidence.validation)} (register the metric with its validation)."
            )
        validated, reason = evidence.validation[metric]
        # With a bracket, identification is read from it; the probe's scores stay beside it.
        probed = decomposed.bracket is None
        judged = dataclasses.replace(
            decomposed,
            s_identified=flags["s_identified"] if probed else decomposed.s_identified,
            b_identified=flags["b_identified"] if probed else decomposed.b_identified,
            residual_auroc=flags["residual_auroc"],
            residual_auroc_threshold=flags["residual_auroc_threshold"],
            validated=validated,
            validation_reason=reason,
        )
        decided[metric] = judged if evidence.lower_bound else _unbounded(judged, evidence)
    return decided


def _unbounded(decomposition: Decomposition, evidence: RunEvidence) -> Decomposition:
    """``decomposition`` under a calibration map that is no lower bound on readout shift: S
    unidentified at every k and the bracket's verdict inconclusive (unchanged without one)."""
    shares = decomposition.bracket_shares
    if shares is None:
        return decomposition
    reason = UNBOUNDED_MAP_REASON.format(mode=evidence.calibration_mode)
    shares = {
        **shares,
        "S_identified": False,
        "verdict": "inconclusive",
        "reason": f"{reason} {shares.get('reason', '')}".strip(),
    }
    unidentified = np.zeros_like(np.asarray(decomposition.s_identified, dtype=bool))
    return dataclasses.replace(decomposition, bracket_shares=shares, s_identified=unidentified)
