"""Every validity flag and verdict of a DCP run, built in one place.

The protocol computes the flags that are data (`identification`: per k, is S identified, is B
identified) and records them in ``results.json``; the words that explain them (`flag_lines` for
the console, `run_flags` and `verdict` for the report, `row_flags` for a figure's hover) are
built here from what a run saved, so the report only reads them. The wording and the rule are
those of the report before this module existed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dcp_lens.protocol.results import FACTORS, REPLAY_NOT_REALIZABLE, ProtocolResults

# Logit difference (nats) below which replay(k) and truncate(k) count as the same readout: B and
# I_BS are then zero by construction (a norm at the readout ignores replay's scaling), not found.
B_IDENTIFICATION_TOLERANCE = 1e-3
NULL_TOLERANCE = 1e-4  # max |logit diff| the exact null controls must stay within (float error)
SMALL_GAP = 1e-3  # a mean gap below this (quality units) leaves shares unstable
# Confidence matching's temperatures outside this range are reported: the loss metrics of those
# cells are scored at a temperature that rescales the readout's confidence by more than 20x.
SANE_TEMPERATURES = (0.05, 20.0)
# The flag of a row whose S bracket is wide (docs/bracket.md), in the report and on its hover.
S_BRACKET_WIDE = (
    "S not identified: marginal matching and a paired translator disagree by more than 0.1 of "
    "the gap (the truth lies in the bracket [S_lower, S_upper])"
)
# The flag of a row whose S is not identified, in the report and on its figures' hover.
S_NOT_IDENTIFIED = (
    "S is a lower bound and D an upper bound, B may hold the missed shift (calibrated states "
    "still differ from full depth)"
)


def identification(
    probe: Mapping[str, Any], k_grid: Sequence[int], replay_difference: Mapping[int, float]
) -> dict[str, Any]:
    """Per k of ``k_grid``: is S identified (the calibrated truncated states pass the probe's
    null, or the truncated states were never told apart) and is B identified (replay(k) reads out
    differently from truncate(k) beyond `B_IDENTIFICATION_TOLERANCE`)?

    Returns:
        ``s_identified``, ``b_identified`` (bool arrays) and ``residual_auroc``,
        ``residual_auroc_threshold`` (float arrays), one entry per k, as `Decomposition` holds.
    """
    by_k = {row["k"]: row for row in probe.get("calibrate_truncate", [])}
    auroc = np.array([by_k.get(k, {}).get("auroc", math.nan) for k in k_grid], float)
    threshold = np.array([by_k.get(k, {}).get("auroc_threshold", math.nan) for k in k_grid], float)
    # Truncated states that are themselves indistinguishable from full depth have no shift to
    # repair (discrete states, as in planted distinct_computation, where any calibration
    # moves them off their lattice and the classifier sees that).
    raw = {row["iteration"]: row for row in probe.get("trajectory", [])}
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


def flag_lines(results: ProtocolResults) -> list[str]:
    """What the numbers of a run cannot see, in words: one line per flag that is raised."""
    lines = []
    first = next(iter(results.decompositions.values()))
    below = [i for i, k in enumerate(first.k_grid) if k < results.n_iterations]
    s_open = [first.k_grid[i] for i in below if not first.s_identified[i]]  # type: ignore[index]
    b_open = [first.k_grid[i] for i in below if not first.b_identified[i]]  # type: ignore[index]
    if s_open and first.bracket is not None:
        lines.append(
            f"S not identified at k = {_ks(s_open)} ({first.metric}): the S bracket is wider than"
            " 0.1 of the gap there (marginal matching and a paired translator disagree); the"
            " truth lies in [S_lower, S_upper]"
        )
    elif s_open:
        lines.append(
            f"S not identified at k = {_ks(s_open)}: calibrated truncated states are still told "
            "apart from full-depth ones (residual AUROC above the probe's null), so S is a lower "
            "bound and D an upper bound there, and B may hold the part of the shift the map "
            "missed (where replaying the update repairs the frame)"
        )
    if b_open:
        lines.append(
            f"B not identified at k = {_ks(b_open)}: replay and truncate give the same readout "
            "there, so B = I_BS = 0 by construction, not by measurement"
        )
    for metric, decomposition in results.decompositions.items():
        if overshoots(metric, [decomposition.shares[factor] for factor in FACTORS]):
            lines.append(f"{metric}: {OVERSHOOT}")
        if not decomposition.validated:
            lines.append(f"{metric} not validated: {decomposition.validation_reason}")
        if decomposition.bracket_shares is not None:
            record = decomposition.bracket_shares
            if record["verdict"] == "inconclusive":
                lines.append(f"{metric} inconclusive: {record['reason']}")
        elif not decomposition.stable:
            lines.append(
                f"{metric} shares unstable: the gap's area interval includes 0, so its shares "
                "mean nothing"
            )
    if any(m != "accuracy" for m in results.metrics):
        lines.extend(temperature_flags(results.to_results_json()))
    return lines


OVERSHOOT = (
    "a share below 0 or above 1: on a loss metric one factor can overshoot the gap and another "
    "make up for it (calibration also changes confidence; docs/protocol.md, Shares below 0 or "
    "above 1)"
)


def overshoots(metric: str, shares: Sequence[float]) -> bool:
    """A share outside [0, 1] (beyond 0.05) on a loss metric, where `OVERSHOOT` explains it."""
    return metric != "accuracy" and any(v < -0.05 or v > 1.05 for v in shares if math.isfinite(v))


def _ks(ks: list[int]) -> str:
    return ", ".join(str(k) for k in ks)


FACTOR_WORDS = {
    "S": (
        "readout shift: the truncated states carry what full depth knows, in a frame the readout "
        "was not trained on; the label-free calibration recovers it"
    ),
    "B": (
        "block applications: applying the block more often helps even without new distinct "
        "iterations (replaying one update recovers it)"
    ),
    "D": "distinct computation: later iterations compute something the first k do not",
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
    bracket's verdict: "inconclusive" says why; S, B or D names the factor with its bracket;
    "mixed" gives every factor's bracket. Runs written without a bracket get the point shares'
    verdict."""
    flags = run_flags(run, metric)
    bracketed = run.get("bracket", {}).get(metric)
    if bracketed is not None and bracketed.get("verdict") is not None:
        return _bracket_verdict(bracketed), flags
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
        parts = ", ".join(f"{name} {values[name]:.0%}" for name in FACTORS)
        text = f"No single factor carries the gap ({parts})."
    if factor != "D" and values["D"] < 0.2:
        text += " Reading the truncation slope as 'the model uses its depth' would overstate it."
    return text, flags


def bracket_span(bracketed: Mapping[str, Any], factor: str) -> str:
    """A factor's bracket with its interval, e.g. ``"S in [0.98, 1.01] (interval [0.97, 1.02])"``,
    as shares of the gap's area."""
    low, high = (bracketed.get(f"{factor}_{end}") for end in ("lower", "upper"))
    outer = (bracketed.get(f"{factor}_lower_lo"), bracketed.get(f"{factor}_upper_hi"))
    return (
        f"{factor} in [{format_number(low)}, {format_number(high)}]"
        f" (interval [{format_number(outer[0])}, {format_number(outer[1])}])"
    )


def _bracket_verdict(bracketed: Mapping[str, Any]) -> str:
    """The sentence of the bracket's verdict (`dcp_lens.protocol.bracket.Bracket`)."""
    decided, reason = str(bracketed["verdict"]), str(bracketed.get("reason") or "")
    spans = "; ".join(bracket_span(bracketed, factor) for factor in FACTORS)
    if decided == "inconclusive":
        return f"Inconclusive: {reason} Brackets (shares of the gap): {spans}."
    if decided in FACTORS:
        least = float(bracketed[f"{decided}_lower_lo"])
        # A share past the whole gap is an overshoot (the other factors sum below 0), not "most".
        share = (
            f"At least {least:.0%} of the truncation gap"
            if least < 1.005
            else f"More than the whole truncation gap (at least {least:.0%}; the other factors "
            "sum below 0)"
        )
        text = f"{share} is {FACTOR_WORDS[decided]}: {bracket_span(bracketed, decided)}."
        d_upper = bracketed.get("D_upper")
        if decided != "D" and isinstance(d_upper, float | int) and d_upper < 0.2:
            text += " Reading the truncation slope as 'the model uses its depth' would overstate"
            text += " it."
        return text
    return f"No single factor carries the gap: {spans}."


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
    sentence: what the numbers cannot see."""
    flags = []
    share = run["shares"][metric]
    if share.get("stable") is False:
        flags.append("unstable share: the gap is too small or too noisy to split reliably")
    record = run.get("metrics", {}).get(metric, {})
    if record.get("validated") is False:
        flags.append(f"metric not validated: {record.get('reason') or 'no reason given'}")
    rows = below_r(run, metric)
    bracketed = any("S_lower" in row for row in rows)
    for key, words in (
        ("S_identified", S_BRACKET_WIDE if bracketed else S_NOT_IDENTIFIED),
        ("B_identified", "B not identified"),
    ):
        ks = [str(row["k"]) for row in rows if row.get(key) is False]
        if ks:
            flags.append(f"{words} at k = {', '.join(ks)}")
    if overshoots(metric, [share.get(factor, math.nan) for factor in FACTORS]):
        flags.append(OVERSHOOT)
    if not run["replay_realizable"]:
        flags.append(f"dense model: replay is {REPLAY_NOT_REALIZABLE}")
    null = run["null_control"].get("max_abs_logit_diff", math.nan)
    if not (isinstance(null, float | int) and null <= NULL_TOLERANCE):
        flags.append(f"null control failed: max |logit diff| {null:.2e} at k = r")
    nonfinite = [row for row in run.get("nonfinite", []) if row["metric"] == metric]
    if nonfinite:
        flags.append(f"{len(nonfinite)} non-finite cells (NaN in the curves)")
    failures = run.get("metadata", {}).get("calibration_failures") or []
    if failures:
        flags.append(f"calibration could not be fitted from {', '.join(failures)}")
    if metric != "accuracy":
        flags.extend(temperature_flags(run))
    return flags


def temperature_flags(run: Mapping[str, Any]) -> list[str]:
    """Confidence matching's temperatures outside `SANE_TEMPERATURES`, one sentence per
    condition: the loss metrics of those cells are read at that temperature, and say so."""
    matching = run.get("calibration", {}).get("confidence_matching", {})
    low, high = SANE_TEMPERATURES
    flags = []
    for condition, per_k in (matching.get("temperatures") or {}).items():
        extreme = {
            k: t for k, t in per_k.items() if isinstance(t, float | int) and not low <= t <= high
        }
        if extreme:
            listed = ", ".join(f"k = {k}: T = {t:.3g}" for k, t in extreme.items())
            flags.append(
                f"confidence matching fitted {condition} a temperature outside [{low:g}, {high:g}]"
                f" ({listed}): its loss values there are read at that temperature"
            )
    return flags


def row_flags(row: Mapping[str, Any]) -> list[str]:
    """The validity flags of one decomposition row, in words (absent keys: no flag)."""
    flags = []
    if row.get("S_identified") is False:
        flags.append(S_BRACKET_WIDE if "S_lower" in row else S_NOT_IDENTIFIED)
    if row.get("B_identified") is False:
        flags.append("B not identified")
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
