"""The rules `dcp-lens validate` judges by (docs/bracket.md, docs/validation.md).

A row per (planted model, metric), judged from the run's results alone (`judge_run`, a pure
function of a ``results.json`` run):

- **in bracket**: the truth (`dcp_lens.zoo.planted.expected_shares`) lies inside the bracket of
  every factor, intervals included: S in ``[S_lower_lo, S_upper_hi]``, B in
  ``[B_lower_lo, B_upper_hi]``, D in ``[D_lower_lo, D_upper_hi]``, with `TRUTH_SLACK` for the
  truth's own sampling (it is measured on the same evaluation examples, from truncation alone);
- **narrow** and **point** (identifiable models, ``planted.IDENTIFIABLE``): the S bracket's width
  at the upper end of its interval (``S_width_hi``) is at most `NARROW_WIDTH` of the gap, and each
  point share (S, B, D) is within `POINT_TOLERANCE` of the truth;
- **flagged at every k** (ambiguous models): at every k < r whose gap is clearly above zero (the
  row's ``gap_lo`` > 0 and above float rounding: `dcp_lens.protocol.bracket.has_gap`),
  ``S_identified`` or ``B_identified`` is false;
- **fields** (every model): the share-level ``S_identified`` / ``B_identified`` of the results
  never claim a factor whose truth lies outside its bracket; a row whose field does is
  confidently wrong and fails, whatever its verdict.

Per metric, the flag's **false-alarm rate**: over the identifiable rows' k < r with a gap clearly
above zero, the fraction where ``S_identified`` is false; at most `FALSE_ALARM_RATE` at one seed
(and `POOLED_FALSE_ALARM_RATE` pooled over the documented seeds, docs/validation.md). A metric
passes when every counted row passes and its false-alarm rate holds; a metric the results mark
``validated: false`` (``runs[].metrics[metric]``) is reported, not counted. The older point rule
(a single factor >= 0.9 of the gap, a mixture's shares within 0.1) is kept beside it as
``point_rule_passed``, information only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dcp_lens.protocol.bracket import BracketRule, has_gap
from dcp_lens.protocol.results import FACTORS

TRUTH_SLACK = 0.05  # the truth's own sampling: how far outside a bracket it may lie
NARROW_WIDTH = 0.1  # an identifiable model's largest S bracket width (upper interval end)
POINT_TOLERANCE = 0.1  # an identifiable model's largest |point share - truth|
# The largest fraction of identifiable k's flagged "S not identified": at one seed, and pooled
# over the seeds docs/validation.md reports (docs/gen_tables.py checks the pooled rate).
FALSE_ALARM_RATE = 0.10
POOLED_FALSE_ALARM_RATE = 0.05
VERDICT_RATE = 0.9  # the least fraction of identifiable rows whose verdict is right
# A verdict that names S or B (or bounds the gap as not affine-recoverable) claims at least
# this share of the gap for it; below it, the claim is wrong.
CLAIMED_SHARE = 0.65
COVERAGE_TARGET = 0.9  # the least fraction of replicates whose 95% interval covers the truth
# The older point rule, information only.
SINGLE_FACTOR_PASS = 0.9  # the planted factor's least share of the gap's area
MIXTURE_TOLERANCE = 0.1  # the largest |share - true share| of a mixture

# The share-level bracket quantities a row keeps (each with _lo / _hi), and the per-k fields.
BRACKET_KEYS = ("S_lower", "S_upper", "B_lower", "B_upper", "D_lower", "D_upper")
PER_K_KEYS = (
    "k", "gap", "gap_lo", "S_width_hi", "B_width_hi", "order_width_hi", "I_BS",
    "S_identified", "B_identified",
)  # fmt: skip


@dataclass(frozen=True)
class Judgement:
    """The bracket rule on one (model, metric) row; None where a test does not apply."""

    in_bracket: bool
    outside: list[str]  # factors whose truth lies outside their bracket (slack included)
    narrow: bool | None  # identifiable models: S_width_hi <= NARROW_WIDTH
    point_ok: bool | None  # identifiable models: every point share within POINT_TOLERANCE
    flagged_every_k: bool | None  # ambiguous models: S or B flagged at every k with a gap
    unflagged_ks: list[int]  # ambiguous models: the k's with a gap and neither flag raised
    false_alarms: int  # identifiable models: k's with a gap where S_identified is false
    alarm_ks: int  # identifiable models: k's < r whose gap is clearly above zero
    passed: bool  # in bracket, and narrow and point (identifiable) or flagged (ambiguous)
    verdict: str = "none"  # the verdict the results carry (with "/not_affine" bound), or none
    verdict_right: bool | None = None  # identifiable models: the verdict names the truth
    confident_wrong: bool = False  # S or B named with a true share below CLAIMED_SHARE


@dataclass(frozen=True)
class ValidationRow:
    """DCP against the truth on one planted model and one metric."""

    model: str
    metric: str
    planted: str  # "S", "B", "D", or a mixture's "S+D"
    identifiable: bool
    shares: dict[str, float]  # point S, B, D and each _lo / _hi
    bracket: dict[str, float]  # BRACKET_KEYS with _lo / _hi, S_width_hi, B_width_hi
    expected: dict[str, float]  # the true S, B, D
    per_k: list[dict[str, object]]  # PER_K_KEYS of every k < r
    judgement: Judgement
    passed: bool
    point_rule_passed: bool  # the older rule, information only
    counted: bool  # False where the results mark the metric not validated
    flags: dict[str, object] = field(default_factory=dict)
    record: dict[str, object] = field(default_factory=dict)  # the results' whole bracket record


def point_rule_passes(
    planted_factor: str, shares: Mapping[str, float], expected: Mapping[str, float]
) -> bool:
    """The older point rule (information only): a single factor >= 0.9 of the gap and the others
    within +-0.1; a mixture's shares each within 0.1 of the truth."""
    if planted_factor in FACTORS:
        others = [f for f in FACTORS if f != planted_factor]
        return shares[planted_factor] >= SINGLE_FACTOR_PASS and all(
            abs(shares[f]) <= MIXTURE_TOLERANCE for f in others
        )
    return all(abs(shares[f] - expected[f]) <= MIXTURE_TOLERANCE for f in FACTORS)


def judge_bracket(
    bracket: Mapping[str, float],
    shares: Mapping[str, float],
    per_k: Sequence[Mapping[str, object]],
    expected: Mapping[str, float],
    identifiable: bool,
    verdict: Mapping[str, object] | None = None,
) -> Judgement:
    """The bracket rule on one row (module docstring): ``bracket`` the share-level bracket
    (`BRACKET_KEYS` with ``_lo`` / ``_hi``, ``S_width_hi``; for S and B spanned with both orders'
    intervals from ``verdict``, the results' record, where it has them), ``shares`` the point
    S, B, D,
    ``per_k`` the decomposition rows of the k < r (``gap_lo``, ``S_identified``,
    ``B_identified``), ``expected`` the true S, B, D, ``verdict`` the results' ``verdict``
    and ``bound`` (`judge_verdict`). A missing or NaN value fails its test. An ambiguous row
    also passes with the verdict "inconclusive" (what the data cannot tell is not named), unless
    its ``S_identified`` or ``B_identified`` field claims a factor whose truth lies outside its
    bracket: every row with such a field is confidently wrong and fails."""
    outside = [
        factor
        for factor in FACTORS
        if not (
            _span(bracket, verdict or {}, factor)[0] - TRUTH_SLACK
            <= expected[factor]
            <= _span(bracket, verdict or {}, factor)[1] + TRUTH_SLACK
        )
    ]
    clear = has_gap(
        [_get(row, "gap_lo") for row in per_k], [_get(row, "gap") for row in per_k], BracketRule()
    )
    gapped = [row for row, has in zip(per_k, clear, strict=True) if has]
    narrow = point_ok = flagged = None
    unflagged: list[int] = []
    false_alarms = alarm_ks = 0
    if identifiable:
        narrow = _get(bracket, "S_width_hi") <= NARROW_WIDTH
        point_ok = all(
            abs(_get(shares, factor) - expected[factor]) <= POINT_TOLERANCE for factor in FACTORS
        )
        alarm_ks = len(gapped)
        false_alarms = sum(row.get("S_identified") is not True for row in gapped)
    else:
        unflagged = [
            int(_get(row, "k"))
            for row in gapped
            if row.get("S_identified") is not False and row.get("B_identified") is not False
        ]
        flagged = not unflagged
    named, right, wrong = judge_verdict(verdict or {}, expected, identifiable, not outside)
    # A field that claims a factor identified is a claim like a named verdict: wrong where the
    # truth lies outside that factor's bracket.
    wrong = wrong or any(
        (verdict or {}).get(f"{f}_identified") is True for f in outside if f != "D"
    )
    if identifiable:
        passed = not outside and bool(narrow and point_ok)
    else:
        passed = (not outside and bool(flagged)) or named.startswith("inconclusive")
    return Judgement(
        in_bracket=not outside,
        outside=outside,
        narrow=narrow,
        point_ok=point_ok,
        flagged_every_k=flagged,
        unflagged_ks=unflagged,
        false_alarms=false_alarms,
        alarm_ks=alarm_ks,
        passed=passed and not wrong,
        verdict=named,
        verdict_right=right,
        confident_wrong=wrong,
    )


# The shares of S and B in each order (`dcp_lens.protocol.bracket`), whose intervals widen the
# bracket a truth is judged against: where the order decides part of the split, either order's
# share is an answer the data allow.
ORDER_SHARES = {"S": ("S_first", "S_after_B"), "B": ("B_first", "B_after_S"), "D": ()}


def _span(
    bracket: Mapping[str, float], record: Mapping[str, object], factor: str
) -> tuple[float, float]:
    """``factor``'s bracket, lower end's interval low to upper end's interval high, spanned with
    both orders' intervals where the results carry them."""
    low, high = _get(bracket, f"{factor}_lower_lo"), _get(bracket, f"{factor}_upper_hi")
    for name in ORDER_SHARES[factor]:
        order_low, order_high = _get(record, f"{name}_lo"), _get(record, f"{name}_hi")
        if math.isfinite(order_low) and math.isfinite(order_high):
            low, high = min(low, order_low), max(high, order_high)
    return low, high


def judge_verdict(
    verdict: Mapping[str, object],
    expected: Mapping[str, float],
    identifiable: bool,
    in_bracket: bool,
) -> tuple[str, bool | None, bool]:
    """(the verdict as counted, whether it is right on an identifiable model, whether it is
    confidently wrong). ``verdict``: ``verdict`` and ``bound`` of the results. Right: S or B
    named whose true share is at least `CLAIMED_SHARE`; "inconclusive" bounded as not
    recovered by an affine map (``not_affine``) where the true D is at least that; "mixed"
    with the truth inside every bracket. Confidently wrong: S or B named whose true share is
    below `CLAIMED_SHARE`."""
    named = str(verdict.get("verdict") or "none")  # "none": the results carry no verdict
    bound = verdict.get("bound")
    counted = f"{named}/{bound}" if named == "inconclusive" and isinstance(bound, str) else named
    wrong = named in ("S", "B") and not expected[named] >= CLAIMED_SHARE
    if not identifiable:
        return counted, None, wrong
    if named in ("S", "B"):
        right = not wrong
    elif named == "mixed":
        right = in_bracket
    else:
        right = bound == "not_affine" and expected["D"] >= CLAIMED_SHARE
    return counted, right, wrong


def judge_run(
    run: Mapping[str, Any],
    metric: str,
    expected: Mapping[str, float],
    identifiable: bool,
) -> Judgement:
    """`judge_bracket` on ``metric`` of one ``results.json`` run."""
    return judge_bracket(
        bracket_of(run, metric),
        shares_of(run, metric),
        per_k_of(run, metric),
        expected,
        identifiable,
        run.get("bracket", {}).get(metric),
    )


def shares_of(run: Mapping[str, Any], metric: str) -> dict[str, float]:
    """The point S, B, D of ``metric`` with each ``_lo`` / ``_hi`` (``run["share_intervals"]``)."""
    point, interval = run["shares"][metric], run.get("share_intervals", {}).get(metric, {})
    keys = [*FACTORS, *(f"{f}_{end}" for f in FACTORS for end in ("lo", "hi"))]
    return {key: _float({**point, **interval}.get(key)) for key in keys}


def bracket_of(run: Mapping[str, Any], metric: str) -> dict[str, float]:
    """The share-level bracket of ``metric``: `BRACKET_KEYS` with ``_lo`` / ``_hi`` and the
    widths, from ``run["bracket"]`` where the results carry it, else ``run["shares"]`` (NaN
    where neither has a key)."""
    source = {**run["shares"][metric], **run.get("bracket", {}).get(metric, {})}
    keys = [f"{key}{end}" for key in BRACKET_KEYS for end in ("", "_lo", "_hi")]
    return {key: _float(source.get(key)) for key in (*keys, "S_width_hi", "B_width_hi")}


def per_k_of(run: Mapping[str, Any], metric: str) -> list[dict[str, object]]:
    """`PER_K_KEYS` of ``metric``'s decomposition rows at k < r (at k = r every factor is 0 by
    construction; the flags speak of the k below it)."""
    return [
        {key: row.get(key) for key in PER_K_KEYS}
        for row in run["decomposition"]
        if row["metric"] == metric and row["k"] < run["n_iterations"]
    ]


def summarize(rows: Sequence[ValidationRow]) -> dict[str, dict[str, Any]]:
    """Per metric: rows and rows passed, the false-alarm count and rate over identifiable k's,
    whether the rate holds, whether the metric is counted and whether it passes."""
    summary: dict[str, dict[str, Any]] = {}
    for metric in dict.fromkeys(row.metric for row in rows):
        mine = [row for row in rows if row.metric == metric]
        alarms = sum(row.judgement.false_alarms for row in mine)
        ks = sum(row.judgement.alarm_ks for row in mine)
        rate = alarms / ks if ks else 0.0
        passed_rows = sum(row.passed for row in mine)
        judged = [row for row in mine if row.identifiable]
        right = sum(bool(row.judgement.verdict_right) for row in judged)
        verdict_rate = right / len(judged) if judged else 1.0
        wrong = [row.model for row in mine if row.judgement.confident_wrong]
        summary[metric] = {
            "verdicts_right": right,
            "verdicts_judged": len(judged),
            "verdict_rate": verdict_rate,
            "verdict_ok": verdict_rate >= VERDICT_RATE,
            "wrong_verdicts": [row.model for row in judged if not row.judgement.verdict_right],
            "confidently_wrong": wrong,
            "rows": len(mine),
            "rows_passed": passed_rows,
            "failing": [row.model for row in mine if not row.passed],
            "false_alarms": alarms,
            "alarm_ks": ks,
            "false_alarm_rate": rate,
            "false_alarm_ok": rate <= FALSE_ALARM_RATE,
            "counted": all(row.counted for row in mine),
            "passed": passed_rows == len(mine)
            and rate <= FALSE_ALARM_RATE
            and verdict_rate >= VERDICT_RATE
            and not wrong,
        }
    return summary


def suite_passed(rows: Sequence[ValidationRow]) -> bool:
    """True when every counted metric passes: each of its rows, and its false-alarm rate."""
    return all(s["passed"] for s in summarize(rows).values() if s["counted"])


def _get(values: Mapping[str, object], key: str) -> float:
    return _float(values.get(key))


def _float(value: object) -> float:
    """A number of a results record as a float (None, JSON's NaN, as NaN)."""
    if value is None:
        return math.nan
    if not isinstance(value, int | float | str):
        raise TypeError(f"{value!r} is not a number of a results record.")
    return float(value)
