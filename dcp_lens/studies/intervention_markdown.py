"""``intervention.md``: the training intervention's prediction, per validated metric a table of
every regime over seeds and the verdict, in words (`dcp_lens.studies.intervention` writes it from
the numbers of `dcp_lens.studies.intervention_outcomes`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NotRequired, TypedDict

from dcp_lens.protocol.wording import format_number as _number
from dcp_lens.studies.intervention_outcomes import (
    AGGREGATED,
    BASELINE,
    BRACKET_ABSOLUTE,
    CONFIDENCE,
    NEGATIVE_CONTROL,
    Check,
    Regime,
    mean_over_seeds,
    number,
)


class ExplainedCheck(TypedDict):
    """A check as ``intervention.json`` stores it: its label, the reason with the numbers
    compared, and the measured label or predicted slope where the check has one."""

    label: str
    reason: str
    measured: NotRequired[str]
    predicted_slope: NotRequired[float]


def explain_verdict(
    verdict: Mapping[str, Mapping[str, Check]], regimes: Mapping[str, Regime]
) -> dict[str, dict[str, ExplainedCheck]]:
    """The verdict as ``intervention.json`` stores it: each check of
    `dcp_lens.studies.intervention_outcomes.verdict` with its ``why`` turned into a ``reason``
    that states the numbers compared (``regimes``: the
    `dcp_lens.studies.intervention_outcomes.aggregate` of every regime)."""
    explained: dict[str, dict[str, ExplainedCheck]] = {}
    for regime, checks in verdict.items():
        explained[regime] = {}
        for name, check in checks.items():
            reason = check["why"]
            if check["label"] != "not tested":
                numbers = _compared(name, check, regimes[regime], regimes[BASELINE])
                reason = f"{numbers}: {reason}"
            said: ExplainedCheck = {"label": check["label"], "reason": reason}
            if "measured" in check:
                said["measured"] = check["measured"]
            if "predicted_slope" in check:
                said["predicted_slope"] = check["predicted_slope"]
            explained[regime][name] = said
    return explained


def format_markdown(document: dict[str, Any]) -> str:
    """``intervention.md`` from the content of ``intervention.json``: the prediction, then per
    validated metric a table of every regime and the verdict."""
    metric = document["metric"]
    lines = [
        f"# Training intervention: preset `{document['preset']}`, metric `{metric}`",
        "",
        f"**Prediction.** {document['prediction'][0].upper()}{document['prediction'][1:]}.",
        "",
    ]
    validated = document.get("validated_metrics")
    if validated is not None:
        lines += [
            "Metrics validated on planted models (`dcp-lens validate`), each reported below: "
            + (", ".join(f"`{name}`" for name in validated) or "none")
            + ". A metric not validated is not reported.",
            "",
        ]
        if metric not in validated:
            lines += [f"**`{metric}` is not validated: read its numbers with care.**", ""]
    lines += _metric_section(metric, document["regimes"], document["verdict"])
    for name, section in (document.get("other_metrics") or {}).items():
        lines += ["", f"# Metric `{name}`", ""]
        lines += _metric_section(name, section["regimes"], section["verdict"])
    return "\n".join(lines) + "\n"


def _metric_section(
    metric: str,
    regimes: Mapping[str, Regime],
    verdict: Mapping[str, Mapping[str, ExplainedCheck]],
) -> list[str]:
    lines = [
        *markdown_table(regimes),
        "",
        f"S, B, D: shares of the truncation gap's area over k ({metric}); slope: the classic "
        "truncation slope (quality against k / r); gap, S, B, D in units: their means over k "
        f"in {metric} itself, which the verdict reads (a share of a gap near zero is unstable; "
        "single-seed rows have no interval for these). Each is the mean over the seeds where it is "
        f"defined, with a {CONFIDENCE:.0%} t-interval over them (defined in one seed only: that "
        "run's bootstrap interval over evaluation examples). Shares are undefined in a run whose "
        "truncation gap has zero area (the same predictions at every depth). S and D brackets, "
        "units: the means over seeds of each run's bracket ends (docs/bracket.md), then the "
        "lower end's interval low and the upper end's interval high; the verdict compares "
        'these, so that a bound cannot reverse it. Seeds marked "S bound" have an S bracket '
        "wider than the tolerance (S not identified: the truth lies anywhere in it). DCP verdict "
        "per seed: each run's own verdict on its shares (S, B, D, mixed or inconclusive).",
    ]
    if NEGATIVE_CONTROL in regimes:
        lines.append(
            "The dense row is the negative control: a dense model of distinct layers, whose S is "
            "that of truncating its own layers."
        )
    return [*lines, "", f"## Verdict ({metric})", "", *verdict_lines(verdict)]


CHECK_NAMES = {
    "S_lower": "S lower than fixed",
    "D_stays": "D stays",
    "slope_follows_S": "slope flattens by about the change in S",
}


def verdict_lines(verdict: Mapping[str, Mapping[str, ExplainedCheck]]) -> list[str]:
    """The explained verdict (`explain_verdict`) as markdown bullets: per tested regime, each
    check's label and reason."""
    lines = []
    for regime, checks in verdict.items():
        lines.append(f"- **{regime}**")
        for key, check in checks.items():
            lines.append(f"  - {CHECK_NAMES[key]}: **{check['label']}** ({check['reason']})")
    return lines


def markdown_table(regimes: Mapping[str, Regime]) -> list[str]:
    """The lines of a markdown table: regime, seeds, then the shares S, B, D, the slope, the gap
    and S, B, D in the metric's units (means over k), each with its interval, and the accuracy at
    full depth and at k = 1 (means over seeds)."""
    lines = [
        "| regime | seeds | S [lo, hi] | B [lo, hi] | D [lo, hi] | slope [lo, hi] "
        "| gap, units | S, units | B, units | D, units | S bracket, units | D bracket, units "
        "| DCP verdict per seed | accuracy full / k=1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for regime, row in regimes.items():
        cells = [_interval(row, name) for name in AGGREGATED if name not in BRACKET_ABSOLUTE]
        for factor in ("S", "D"):
            cells.append(_bracket_cell(row, factor))
        cells.append(", ".join(str(v) if v else "-" for v in _listed(row, "verdicts")) or "-")
        seeds = ",".join(str(seed) for seed in _listed(row, "seeds"))
        if undefined := _listed(row, "undefined_seeds"):
            seeds += f" (undefined: {','.join(str(seed) for seed in undefined)})"
        if bound := _listed(row, "S_bound_seeds"):
            seeds += f" (S bound: {','.join(str(seed) for seed in bound)})"
        accuracy = [_number(mean_over_seeds(row, key)) for key in ("full_accuracy", "k1_accuracy")]
        cells.append(" / ".join(accuracy))
        lines.append(f"| {regime} | {seeds} | " + " | ".join(cells) + " |")
    return lines


def _bracket_cell(row: Regime, factor: str) -> str:
    """``[lower, upper]`` of a regime's ``factor`` bracket in units (means over seeds), with the
    lower end's interval low and the upper end's interval high after it; "-" without one."""
    low, high = number(row, f"{factor}_lower_abs"), number(row, f"{factor}_upper_abs")
    if not (math.isfinite(low) and math.isfinite(high)):
        return "-"
    ends = number(row, f"{factor}_lower_abs_lo"), number(row, f"{factor}_upper_abs_hi")
    outer = (_number(ends[0]), _number(ends[1]))
    return f"[{_number(low)}, {_number(high)}] ({outer[0]} to {outer[1]})"


def _compared(check_name: str, check: Check, tested: Regime, fixed: Regime) -> str:
    """The numbers a check of the verdict compared, in words."""
    if check_name == "slope_follows_S":
        return (
            f"slope {_interval(tested, 'slope')}, predicted "
            f"{_number(check.get('predicted_slope'))} "
            f"from fixed slope {_number(number(fixed, 'slope'))} and the change in S"
        )
    factor = {"S_lower": "S", "D_stays": "D"}[check_name]
    name = f"{factor}_abs"
    said = f"{factor} {_interval(tested, name)} against fixed {_interval(fixed, name)}"
    brackets = _bracket_cell(tested, factor), _bracket_cell(fixed, factor)
    if "-" in brackets:
        return said
    return f"{said}; {factor} bracket {brackets[0]} against fixed {brackets[1]}"


def _interval(row: Regime, name: str) -> str:
    point, low, high = (_number(number(row, name + end)) for end in ("", "_lo", "_hi"))
    return f"{point} [{low}, {high}]"


def _listed(row: Regime, name: str) -> list[object]:
    """The list ``name`` of a regime (seeds, verdicts), empty where it has none."""
    value = row.get(name)
    return list(value) if isinstance(value, list) else []
