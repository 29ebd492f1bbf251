"""Every rendering of dcp-lens results: console summaries and markdown (the HTML report builds on
these). Functions here read results objects and never recompute science."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from dcp_lens.intervention import (
    AGGREGATED,
    BASELINE,
    CONFIDENCE,
    NEGATIVE_CONTROL,
    mean_over_seeds,
)
from dcp_lens.results import ProtocolResults

if TYPE_CHECKING:  # annotations only: rendering a table needs no training code
    from dcp_lens.training.evaluation import AccuracyTable


def format_summary(results: ProtocolResults) -> str:
    """The console summary of one run: model, depth, shares with intervals, the null control."""
    lines = [f"\n{results.model} ({results.architecture}, r = {results.n_iterations})"]
    if not results.replay_realizable:
        lines.append("  replay: not realizable as the same model (dense network)")
    shares = results.shares()
    lines.append(shares.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    lines.extend(f"  {flag}" for flag in flag_lines(results))
    lines.append(
        f"  null control max |logit diff|: {results.null_control['max_abs_logit_diff']:.2e}"
    )
    return "\n".join(lines)


def flag_lines(results: ProtocolResults) -> list[str]:
    """What the numbers of a run cannot see, in words: one line per flag that is raised."""
    lines = []
    first = next(iter(results.decompositions.values()))
    below_r = [i for i, k in enumerate(first.k_grid) if k < results.n_iterations]
    s_open = [first.k_grid[i] for i in below_r if not first.s_identified[i]]  # type: ignore[index]
    b_open = [first.k_grid[i] for i in below_r if not first.b_identified[i]]  # type: ignore[index]
    if s_open:
        lines.append(
            f"S not identified at k = {_ks(s_open)}: calibrated truncated states are still told "
            "apart from full-depth ones (residual AUROC above the probe's null), so S is a lower "
            "bound and D an upper bound there"
        )
    if b_open:
        lines.append(
            f"B not identified at k = {_ks(b_open)}: replay and truncate give the same readout "
            "there, so B = I_BS = 0 by construction, not by measurement"
        )
    for metric, decomposition in results.decompositions.items():
        if not decomposition.validated:
            lines.append(f"{metric} not validated: {decomposition.validation_reason}")
        if not decomposition.stable:
            lines.append(
                f"{metric} shares unstable: the gap's area interval includes 0, so its shares "
                "mean nothing"
            )
    return lines


def _ks(ks: list[int]) -> str:
    return ", ".join(str(k) for k in ks)


# ------------------------------------------------------------------ training


def format_accuracy_table(table: AccuracyTable) -> str:
    """A text table of a trained model's held-out accuracy: one row per h (and "all"), one
    column per k."""
    head = "h \\ k " + " ".join(f"{k:>5}" for k in table.k_values)
    lines = [head]
    for h, per_k in sorted(table.by_hops.items()):
        cells = " ".join(f"{per_k[k]:5.2f}" for k in table.k_values)
        lines.append(f"{h:>6} {cells}   ({table.queries_per_hop[h]} queries)")
    lines.append(f"{'all':>6} " + " ".join(f"{table.overall[k]:5.2f}" for k in table.k_values))
    return "\n".join(lines)


def explain_verdict(
    verdict: dict[str, dict[str, dict[str, Any]]], regimes: dict[str, dict[str, Any]]
) -> dict[str, dict[str, dict[str, Any]]]:
    """The verdict as ``intervention.json`` stores it: each check of `dcp_lens.intervention.verdict`
    with its ``why`` turned into a ``reason`` that states the numbers compared (``regimes``: the
    `dcp_lens.intervention.aggregate` of every regime)."""
    explained: dict[str, dict[str, dict[str, Any]]] = {}
    for regime, checks in verdict.items():
        explained[regime] = {}
        for name, check in checks.items():
            reason = check["why"]
            if check["label"] != "not tested":
                numbers = _compared(name, check, regimes[regime], regimes[BASELINE])
                reason = f"{numbers}: {reason}"
            rest = {key: value for key, value in check.items() if key not in ("label", "why")}
            explained[regime][name] = {"label": check["label"], "reason": reason, **rest}
    return explained


def format_markdown(document: dict[str, Any]) -> str:
    """``intervention.md`` from the content of ``intervention.json``: the prediction, a table
    of every regime and the verdict."""
    metric = document["metric"]
    lines = [
        f"# Training intervention: preset `{document['preset']}`, metric `{metric}`",
        "",
        f"**Prediction.** {document['prediction'][0].upper()}{document['prediction'][1:]}.",
        "",
        *markdown_table(document["regimes"]),
        "",
        f"S, B, D: shares of the truncation gap's area over k ({metric}); slope: the classic "
        "truncation slope (quality against k / r); gap, S, B, D in units: their means over k "
        f"in {metric} itself, which the verdict reads (a share of a gap near zero is unstable; "
        "single-seed rows have no interval for these). Each is the mean over the seeds where it is "
        f"defined, with a {CONFIDENCE:.0%} t-interval over them (defined in one seed only: that "
        "run's bootstrap interval over evaluation examples). Shares are undefined in a run whose "
        "truncation gap has zero area (the same predictions at every depth).",
    ]
    if NEGATIVE_CONTROL in document["regimes"]:
        lines.append(
            "The dense row is the negative control: a dense model of distinct layers, whose S is "
            "that of truncating its own layers."
        )
    lines += ["", "## Verdict", ""]
    names = {
        "S_lower": "S lower than fixed",
        "D_stays": "D stays",
        "slope_follows_S": "slope flattens by about the change in S",
    }
    for regime, checks in document["verdict"].items():
        lines.append(f"- **{regime}**")
        for key, check in checks.items():
            lines.append(f"  - {names[key]}: **{check['label']}** ({check['reason']})")
    return "\n".join(lines) + "\n"


def markdown_table(regimes: dict[str, dict[str, Any]]) -> list[str]:
    """The lines of a markdown table: regime, seeds, then the shares S, B, D, the slope, the gap
    and S, B, D in the metric's units (means over k), each with its interval, and the accuracy at
    full depth and at k = 1 (means over seeds)."""
    lines = [
        "| regime | seeds | S [lo, hi] | B [lo, hi] | D [lo, hi] | slope [lo, hi] "
        "| gap, units | S, units | B, units | D, units | accuracy full / k=1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for regime, row in regimes.items():
        cells = [_interval(row, name) for name in AGGREGATED]
        seeds = ",".join(str(seed) for seed in row["seeds"])
        if row["undefined_seeds"]:
            seeds += f" (undefined: {','.join(str(seed) for seed in row['undefined_seeds'])})"
        accuracy = [_number(mean_over_seeds(row, key)) for key in ("full_accuracy", "k1_accuracy")]
        cells.append(" / ".join(accuracy))
        lines.append(f"| {regime} | {seeds} | " + " | ".join(cells) + " |")
    return lines


def _compared(
    check_name: str, check: dict[str, Any], tested: dict[str, Any], fixed: dict[str, Any]
) -> str:
    """The numbers a check of the verdict compared, in words."""
    if check_name == "slope_follows_S":
        return (
            f"slope {_interval(tested, 'slope')}, predicted {_number(check['predicted_slope'])} "
            f"from fixed slope {_number(fixed['slope'])} and the change in S"
        )
    factor = {"S_lower": "S", "D_stays": "D"}[check_name]
    name = f"{factor}_abs"
    return f"{factor} {_interval(tested, name)} against fixed {_interval(fixed, name)}"


def _number(value: float | None) -> str:
    return "nan" if value is None or math.isnan(value) else f"{value:.3f}"


def _interval(row: dict[str, Any], name: str) -> str:
    return f"{_number(row[name])} [{_number(row[f'{name}_lo'])}, {_number(row[f'{name}_hi'])}]"
