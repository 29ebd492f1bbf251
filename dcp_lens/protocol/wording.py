"""The words of a run's verdicts and flags: what `dcp_lens.protocol.verdicts` decided, as the
sentences the console, the report and the notebooks show.

- the verdict on one metric (`verdict`; with a bracket, the sentence of the verdict
  `dcp_lens.protocol.verdicts.share_verdict` decided);
- the flags of a run grouped by severity (`flag_groups`, `flag_lines`), of one metric
  (`run_flags`) and of one decomposition row (`row_flags`).

Nothing here decides validity: the thresholds and rules come from `dcp_lens.protocol.verdicts`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dcp_lens.protocol.gate import untested_translators
from dcp_lens.protocol.results import (
    FACTORS,
    REPLAY_NOT_REALIZABLE,
    S_NOT_IDENTIFIED,
    Decomposition,
    ProtocolResults,
)
from dcp_lens.protocol.verdicts import (
    NOT_AFFINE,
    NULL_TOLERANCE,
    SANE_TEMPERATURES,
    SMALL_GAP,
    BracketRule,
    order_disagrees,
    replay_same,
)

# The flag of a row whose S bracket is wide (docs/bracket.md), in the report and on its hover.
S_BRACKET_WIDE = (
    "S not identified: marginal matching and a paired affine translator disagree by more than "
    "0.1 of the gap (affine readout shift lies inside the bracket [S_lower, S_upper])"
)
# The flag of a row whose B is not identified, in the report and on its figures' hover.
B_NOT_IDENTIFIED = "B not identified (the B bracket is wide, or replay walks)"


# The severities of the flags, most important first: what not to read, what a number cannot
# tell, and notes.
SEVERITIES = ("read", "caution", "note")


def flag_groups(results: ProtocolResults) -> dict[str, list[str]]:
    """The flags of a run, each a short sentence, grouped by `SEVERITIES`: ``read`` (which
    metrics to read: the validated ones whose verdict is not inconclusive), ``caution`` (per-k
    identification and the order of S and B, once per text with the metrics it holds for),
    ``note`` (temperatures, overshoots and float-error zeros, identical notes of several
    conditions or metrics merged into one line)."""
    run = results.to_results_json()
    validated = [m for m, d in results.decompositions.items() if d.validated]
    unvalidated = [m for m in results.metrics if m not in validated]
    groups: dict[str, list[str]] = {severity: [] for severity in SEVERITIES}
    readable = [
        m
        for m in validated
        if (results.decompositions[m].bracket_shares or {}).get("verdict") != "inconclusive"
    ]
    inconclusive = [m for m in validated if m not in readable]
    parts = []
    if validated:
        why = (
            f" (inconclusive: {', '.join(inconclusive)}; the verdict says why)"
            if inconclusive
            else ""
        )
        parts.append(f"read {', '.join(validated)}{why}")
    if unvalidated:
        parts.append(f"do not read {', '.join(unvalidated)} (not validated)")
    if parts:
        groups["read"].append("; ".join(parts))
    if not run["replay_realizable"]:
        groups["read"].append(f"dense model: replay is {REPLAY_NOT_REALIZABLE}")
    null_control = run["null_control"]
    null = null_control.get("max_abs_logit_diff") if isinstance(null_control, dict) else None
    if not (isinstance(null, float | int) and null <= NULL_TOLERANCE):
        groups["read"].append(f"null control failed: max |logit diff| {null} at k = r")
    cautions: dict[str, list[str]] = {}
    notes: dict[str, list[str]] = {}
    for metric in validated or list(results.metrics):
        decomposition = results.decompositions[metric]
        for text in _per_k_cautions(run, decomposition):
            cautions.setdefault(text, []).append(metric)
    for metric in validated:
        decomposition = results.decompositions[metric]
        if decomposition.bracket_shares is None and not decomposition.stable:
            notes.setdefault(
                "shares unstable: the gap's area interval includes 0, so its shares mean nothing",
                [],
            ).append(metric)
        if overshoots(metric, [decomposition.shares[factor] for factor in FACTORS]):
            notes.setdefault(OVERSHOOT, []).append(metric)
    groups["caution"] = [f"{text} ({', '.join(ms)})" for text, ms in cautions.items()]
    groups["note"] = [f"{', '.join(ms)}: {text}" for text, ms in notes.items()]
    if any(not results.decompositions[m].higher_is_better for m in validated):  # loss metrics
        groups["note"].extend(temperature_flags(run))
    first = next(iter(results.decompositions.values()))
    same = replay_same(results.metadata, list(first.k_grid))
    ks = [k for k, flag in zip(first.k_grid, same, strict=True) if flag and k < first.n_iterations]
    if ks:
        groups["note"].append(
            f"B = I_BS = 0 by construction at k = {_ks(ks)}: replay reads out as truncate there"
            " (float error), so B is not measured"
        )
    return groups


def _per_k_cautions(run: Mapping[str, Any], decomposition: Decomposition) -> list[str]:
    """The per-k identification flags of one metric, in words (k < r)."""
    below = [i for i, k in enumerate(decomposition.k_grid) if k < decomposition.n_iterations]
    ks = decomposition.k_grid
    same = replay_same(run.get("metadata", {}), ks)
    # Arrays after construction (flags not measured are False).
    s_identified = np.asarray(decomposition.s_identified, bool)
    b_identified = np.asarray(decomposition.b_identified, bool)
    s_open = [ks[i] for i in below if not s_identified[i]]
    b_open = [ks[i] for i in below if not b_identified[i] and not same[i]]
    parts = []
    if s_open and decomposition.bracket is not None:
        parts.append(
            f"S not identified at k = {_ks(s_open)} (S bracket wider than 0.1 of the gap: affine"
            " readout shift lies inside it; read S_lower, S_upper)"
        )
    elif s_open:
        parts.append(
            f"S not identified at k = {_ks(s_open)} (calibrated states still told apart from full"
            " depth: S is a lower bound, D an upper bound)"
        )
    if b_open:
        parts.append(
            f"B not identified at k = {_ks(b_open)} (B bracket wider than 0.1 of the gap, or"
            " replay walks; read B_lower, B_upper)"
        )
    rule = BracketRule()
    cells = decomposition.cells
    differ = order_disagrees(cells["gap"], cells["I_BS_lo"], cells["I_BS_hi"], rule)
    order_ks = [ks[i] for i in below if differ[i]]
    if order_ks:
        parts.append(
            f"the order of S and B moves more than 0.1 of the gap at k = {_ks(order_ks)} (read"
            " I_BS)"
        )
    return ["; ".join(parts)] if parts else []


def flag_lines(results: ProtocolResults) -> list[str]:
    """The flags of a run, most important first (`flag_groups` in `SEVERITIES` order)."""
    groups = flag_groups(results)
    return [line for severity in SEVERITIES for line in groups[severity]]


OVERSHOOT = (
    "a share below 0 or above 1: on a loss metric one factor can overshoot the gap and another "
    "make up for it (calibration also changes confidence; the docs' page The protocol, section "
    "Shares below 0 or above 1)"
)


def overshoots(metric: str, shares: Sequence[float]) -> bool:
    """A share outside [0, 1] (beyond 0.05) on a loss metric, where `OVERSHOOT` explains it."""
    return metric != "accuracy" and any(v < -0.05 or v > 1.05 for v in shares if math.isfinite(v))


def _ks(ks: list[int]) -> str:
    return ", ".join(str(k) for k in ks)


FACTOR_WORDS = {
    "S": (
        "readout shift that an affine change of frame undoes: the truncated states carry what "
        "full depth reads, in a frame the readout was not trained on"
    ),
    "B": (
        "block applications: replaying one update (applying the block more often, with no new "
        "distinct iteration) recovers it"
    ),
    "D": (
        "not recovered by an affine change of frame (distinct computation, or a non-affine shift)"
    ),
}


def below_r(run: Mapping[str, Any], metric: str) -> list[dict[str, Any]]:
    """The decomposition rows of ``metric`` at k < r: at k = r every factor is 0 by construction,
    so flags and verdicts speak of the k below r."""
    return [
        row
        for row in run["decomposition"]
        if row["metric"] == metric and row["k"] < run["n_iterations"]
    ]


def verdict(run: Mapping[str, Any], metric: str) -> tuple[str, list[str]]:
    """A plain-language verdict on one metric of one run, and its flags (each a short sentence).

    With the S bracket (``run["bracket"][metric]``, docs/bracket.md) the text follows the
    verdict `share_verdict` decided: "inconclusive" says why (and what it still establishes);
    S or B names the factor with its bracket; "mixed" gives every factor's bracket. Runs written
    without a bracket get the point shares' verdict."""
    flags = run_flags(run, metric)
    bracketed = run.get("bracket", {}).get(metric)
    if bracketed is not None and bracketed.get("verdict") is not None:
        untested = untested_translators(run.get("metadata", {}).get("translator_gate"))
        text = _bracket_verdict(bracketed)
        if untested is not None:
            text = f"{text} {untested[:1].upper()}{untested[1:]}."
        return text, flags
    shares = {**run["shares"][metric], **run.get("share_intervals", {}).get(metric, {})}
    values = {factor: shares.get(factor, math.nan) for factor in FACTORS}
    gaps = [row["gap"] for row in run["decomposition"] if row["metric"] == metric]
    mean_gap = finite_mean(gaps)
    if any(math.isnan(v) for v in values.values()) or abs(mean_gap) < SMALL_GAP:
        return (
            f"No truncation gap to split (mean gap {format_number(mean_gap)}): the readout is "
            "about as good at every k tested, so the shares say nothing.",
            flags,
        )
    if shares.get("stable") is False or mean_gap < 0:
        return (
            f"Inconclusive: the truncation gap (mean {format_number(mean_gap)}) is negative or "
            "too noisy to split, so its shares are not formed.",
            flags,
        )
    factor = max(FACTORS, key=lambda name: values[name])
    if values[factor] >= 0.5:
        text = f"{_share_of_gap(values[factor])} is {FACTOR_WORDS[factor]}."
        if factor != "S" and any(row.get("S_identified") is False for row in below_r(run, metric)):
            # S is then a lower bound: what the map missed sits in B or D, whichever repairs it.
            text += (
                f" But S is not identified at some k, so part of this {factor} may be readout "
                "shift that the calibration missed."
            )
    else:
        parts = ", ".join(f"{name} {format_number(values[name])}" for name in FACTORS)
        text = f"No single factor carries the gap ({parts})."
    if factor != "D" and values["D"] < 0.2:
        text += " Reading the truncation slope as 'the model uses its depth' would overstate it."
    return text, flags


def bracket_span(bracketed: Mapping[str, Any], factor: str) -> str:
    """A factor's bracket with its 95% interval, e.g. ``"S bracket [0.980, 1.010] (95% interval
    [0.970, 1.020])"``, as shares of the gap's area: the bracket is ``[lower, upper]``, the 95%
    interval runs from the lower end's interval low to the upper end's interval high."""
    low, high = (bracketed.get(f"{factor}_{end}") for end in ("lower", "upper"))
    outer = (bracketed.get(f"{factor}_lower_lo"), bracketed.get(f"{factor}_upper_hi"))
    return (
        f"{factor} bracket [{format_number(low)}, {format_number(high)}]"
        f" (95% interval [{format_number(outer[0])}, {format_number(outer[1])}])"
    )


def _bracket_verdict(bracketed: Mapping[str, Any]) -> str:
    """The sentence of the verdict `share_verdict` decided (``bracketed``: the record)."""
    decided, reason = str(bracketed["verdict"]), str(bracketed.get("reason") or "")
    spans = "; ".join(bracket_span(bracketed, factor) for factor in FACTORS)
    if decided == "inconclusive" and bracketed.get("bound") == NOT_AFFINE:
        least = float(bracketed["D_lower_lo"])
        return (
            f"Inconclusive between distinct computation and a non-affine readout shift:"
            f" {_lower_first(_at_least(least, bracketed.get('D_lower')))} the truncation gap is"
            f" {FACTOR_WORDS['D']}, and no test run here tells the two apart:"
            f" {bracket_span(bracketed, 'D')}."
        )
    if decided == "inconclusive":
        return f"Inconclusive: {reason} Brackets (shares of the gap): {spans}."
    if decided in FACTORS:
        least = float(bracketed[f"{decided}_lower_lo"])
        text = (
            f"{_at_least(least, bracketed.get(f'{decided}_lower'))} the truncation gap is"
            f" {FACTOR_WORDS[decided]}: {bracket_span(bracketed, decided)}."
        )
        d_upper = bracketed.get("D_upper")
        if isinstance(d_upper, float | int) and d_upper < 0.2:
            text += " Reading the truncation slope as 'the model uses its depth' would overstate"
            text += " it."
        return text
    return f"No single factor carries the gap: {spans}."


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def _at_least(least: float, point: float | None) -> str:
    """How much of the gap a named factor is, from the lower end of its bracket's interval
    ``least``: "at least" only where that bound differs from the point ``point`` (the lower
    end) by 0.005 or more; a share past the whole gap is an overshoot."""
    if least >= 1.005:
        return (
            f"More than the whole truncation gap (at least {least:.0%}; the other factors sum"
            " below 0):"
        )
    bound = f"{least:.0%}"
    if point is not None and math.isfinite(point) and abs(point - least) < 0.005:
        return f"{bound} of"
    return f"At least {bound} of"


def _share_of_gap(share: float) -> str:
    """How much of the gap a share of at least 0.5 is, in words: "most" only within [0, 1]; a
    share above 1 overshoots the gap and the other factors' shares sum below 0."""
    if share >= 1.005:  # shown as more than 100%
        return (
            f"More than the whole truncation gap ({share:.0%}; the other factors sum to "
            f"{1 - share:.0%})"
        )
    if share >= 0.995:
        return f"All of the truncation gap ({share:.0%})"
    return f"Most of the truncation gap ({share:.0%})"


def run_flags(run: Mapping[str, Any], metric: str) -> list[str]:
    """The flags of one metric of one run (its ``results.json`` record), each a short
    sentence: what the numbers cannot see, the most important first."""
    flags = []
    record = run.get("metrics", {}).get(metric, {})
    if record.get("validated") is False:
        flags.append(f"metric not validated: {record.get('reason') or 'no reason given'}")
    share = run["shares"][metric]
    if share.get("stable") is False:
        flags.append("unstable share: the gap is too small or too noisy to split reliably")
    if not run["replay_realizable"]:
        flags.append(f"dense model: replay is {REPLAY_NOT_REALIZABLE}")
    null = run["null_control"].get("max_abs_logit_diff", math.nan)
    if not (isinstance(null, float | int) and null <= NULL_TOLERANCE):
        flags.append(f"null control failed: max |logit diff| {null:.2e} at k = r")
    rows = below_r(run, metric)
    bracketed = any("S_lower" in row for row in rows)
    ks = [str(row["k"]) for row in rows if row.get("S_identified") is False]
    if ks:
        flags.append(f"{S_BRACKET_WIDE if bracketed else S_NOT_IDENTIFIED} at k = {', '.join(ks)}")
    same = replay_same(run.get("metadata", {}), [row["k"] for row in rows])
    ks = [
        str(row["k"])
        for row, by in zip(rows, same, strict=True)
        if row.get("B_identified") is False and not by
    ]
    if ks:
        flags.append(f"B not identified at k = {', '.join(ks)}")
    zero = [str(row["k"]) for row, by in zip(rows, same, strict=True) if by]
    if zero:
        flags.append(
            f"B = 0 by construction (replay reads out as truncate) at k = {', '.join(zero)}"
        )
    if overshoots(metric, [share.get(factor, math.nan) for factor in FACTORS]):
        flags.append(OVERSHOOT)
    nonfinite = [row for row in run.get("nonfinite", []) if row["metric"] == metric]
    if nonfinite:
        flags.append(f"{len(nonfinite)} non-finite cells (NaN in the curves)")
    failures = run.get("metadata", {}).get("calibration_failures") or []
    if failures:
        flags.append(f"calibration could not be fitted from {', '.join(failures)}")
    untested = untested_translators(run.get("metadata", {}).get("translator_gate"))
    if untested is not None:
        flags.append(untested)
    if record.get("higher_is_better") is False:  # a loss metric
        flags.extend(temperature_flags(run))
    return flags


def temperature_flags(run: Mapping[str, Any]) -> list[str]:
    """Confidence matching's temperatures outside `SANE_TEMPERATURES`, in one sentence naming
    every condition they hold for: the loss metrics of those cells are read at that
    temperature, and say so."""
    matching = run.get("calibration", {}).get("confidence_matching", {})
    low, high = SANE_TEMPERATURES
    extreme: dict[str, list[str]] = {}
    for condition, per_k in (matching.get("temperatures") or {}).items():
        outside = sorted(
            (
                int(k)
                for k, t in per_k.items()
                if isinstance(t, float | int) and not low <= t <= high
            )
        )
        if outside:
            extreme[condition] = [str(k) for k in outside]
    if not extreme:
        return []
    ks = sorted({k for values in extreme.values() for k in values}, key=int)
    return [
        f"confidence matching fitted a temperature outside [{low:g}, {high:g}] for"
        f" {', '.join(extreme)} (at k = {', '.join(ks)}): the loss metrics are read at that"
        " temperature there"
    ]


def row_flags(row: Mapping[str, Any]) -> list[str]:
    """The validity flags of one decomposition row, in words (absent keys: no flag)."""
    flags = []
    if row.get("S_identified") is False:
        flags.append(S_BRACKET_WIDE if "S_lower" in row else S_NOT_IDENTIFIED)
    if row.get("B_identified") is False:
        flags.append(B_NOT_IDENTIFIED)
    if row.get("nonfinite"):
        flags.append("non-finite cells")
    return flags


def finite_mean(values: Sequence[float]) -> float:
    """The mean of the finite ``values`` (None and NaN left out); NaN when none is finite."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def format_number(value: float | None) -> str:
    """A number with three decimals; ``nan`` for None or NaN."""
    return "nan" if value is None or math.isnan(value) else f"{value:.3f}"
