"""The console's answer to "does this model use its depth?": what ``dcp-lens run`` prints and
`ProtocolResults.summary` returns.

Per model: a title, then per validated metric one line with the quality at full depth and at
the smallest k, the mean gap and the shares with their intervals, and the verdict sentence (the
one the report and ``results.json`` carry, from `dcp_lens.protocol.verdicts.verdict`). Metrics
that are not validated are named on one line, not given a verdict. The flags come once at the
end, each naming the models it applies to. Every line fits in `WIDTH` characters.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from dcp_lens.protocol.results import FACTORS, ProtocolResults, decode_json
from dcp_lens.protocol.verdicts import flag_lines, verdict

WIDTH = 100
LEGEND = (
    "S: readout shift (the readout reads an earlier state in another frame); "
    "B: block applications (how many times the core ran); "
    "D: distinct computation (how many different iterations it took). "
    "Shares of the truncation gap's area over k, with 95% intervals."
)


def format_summary(results: ProtocolResults) -> str:
    """The console summary of one run (`format_summaries` of one)."""
    return format_summaries([results])


def format_summaries(runs: Sequence[ProtocolResults]) -> str:
    """The console summary of runs side by side: per model its verdict lines, then the legend
    and the flags once (each with the models it holds for), every line within `WIDTH`."""
    lines: list[str] = []
    flags: dict[str, list[str]] = {}
    for results in runs:
        lines.extend(_model_lines(results))
        for flag in _flags(results):
            flags.setdefault(flag, []).append(results.model)
    lines.append("")
    lines.extend(_wrapped(LEGEND, ""))
    if flags:
        lines.append("flags:")
        for flag, models in flags.items():
            where = "" if len(runs) == 1 else f"[{', '.join(models)}] "
            lines.extend(_wrapped(f"- {where}{flag}", "  "))
    return "\n".join(lines)


def _model_lines(results: ProtocolResults) -> list[str]:
    run = decode_json(results.to_results_json())
    title = f"{results.model} ({results.architecture}, r = {results.n_iterations})"
    lines = ["", title]
    if not results.replay_realizable:
        lines.append("  replay: not realizable as the same model (dense network)")
    unvalidated = []
    for metric, decomposition in results.decompositions.items():
        if not decomposition.validated:
            unvalidated.append(metric)
            continue
        lines.append(f"  {metric}: {_quality_text(run, metric)}")
        lines.append(f"    {_shares_text(decomposition)}")
        text, _ = verdict(run, metric)
        lines.extend(_wrapped(text, "    "))
    if unvalidated:
        lines.extend(
            _wrapped(
                f"not validated, no verdict: {', '.join(unvalidated)} (their shares are in "
                "results.json and the report; see the flags)",
                "  ",
            )
        )
    return lines


def _quality_text(run: Mapping[str, Any], metric: str) -> str:
    """Full depth's quality, the smallest k's, and the mean gap over k (a loss gap is the rise
    in loss)."""
    curves = [row for row in run["curves"] if row["metric"] == metric]
    full = next((row["value"] for row in curves if row["condition"] == "full"), math.nan)
    truncated = sorted(
        (row for row in curves if row["condition"] == "truncate"), key=lambda row: row["k"]
    )
    gaps = [row["gap"] for row in run["decomposition"] if row["metric"] == metric]
    finite = [gap for gap in gaps if math.isfinite(gap)]
    mean_gap = sum(finite) / len(finite) if finite else math.nan
    first = f", k = {truncated[0]['k']}: {_number(truncated[0]['value'])}" if truncated else ""
    return f"full depth {_number(full)}{first}; mean gap over k {_number(mean_gap)}"


def _shares_text(decomposition: Any) -> str:
    parts = []
    for factor in FACTORS:
        value = decomposition.shares[factor]
        low, high = (decomposition.shares.get(f"{factor}_{end}") for end in ("lo", "hi"))
        interval = (
            f" [{low:.2f}, {high:.2f}]"
            if low is not None and high is not None and math.isfinite(low) and math.isfinite(high)
            else ""
        )
        parts.append(f"{factor} {value:.2f}{interval}")
    return "   ".join(parts)


def _flags(results: ProtocolResults) -> list[str]:
    flags = list(flag_lines(results))
    flags.append(
        f"null control max |logit diff|: {results.null_control['max_abs_logit_diff']:.2e} "
        "(full depth read through the protocol's own path; 0 up to float error)"
    )
    # The null control's value differs per model: keep it per model, the other flags shared.
    return flags


def _wrapped(text: str, indent: str) -> list[str]:
    return textwrap.wrap(
        text, width=WIDTH, initial_indent=indent, subsequent_indent=indent + "  "
    ) or [indent]


def _number(value: float) -> str:
    if not math.isfinite(value):
        return "n/a"
    return f"{value:.4g}" if abs(value) < 1000 else f"{value:.1f}"
