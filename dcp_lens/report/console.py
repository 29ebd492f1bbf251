"""The console's answer to "does this model use its depth?": what ``dcp-lens run`` prints and
`ProtocolResults.summary` returns.

Per model: a title, then per validated metric one line with the quality at full depth and at
the smallest k (three decimals, each number named), the mean gap, the point shares with their
95% intervals, and the verdict sentence (the one the report and ``results.json`` carry, from
`dcp_lens.protocol.wording.verdict`). Metrics that are not validated are named on one line, not
given a verdict. The flags come once at the end, grouped by severity as
`dcp_lens.protocol.wording.flag_groups` decided (which metrics to read first), each naming the
models it applies to. Every line fits in `WIDTH` characters. Notation: a bracket is
``bracket [lower, upper]``; a 95% interval is ``95% interval [low, high]``, or ``[low, high]``
after a value on a line that says "with 95% intervals".
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any

from dcp_lens.protocol.results import FACTORS, Decomposition, ProtocolResults, decode_json
from dcp_lens.protocol.wording import SEVERITIES, flag_groups, verdict

WIDTH = 100
LEGEND = (
    "S: readout shift that an affine change of frame undoes; "
    "B: block applications (replaying one update recovers it); "
    "D: distinct computation, or a non-affine shift (the rest: not recovered by an affine "
    "change of frame). Point shares of the truncation gap's area over k (the S bracket's lower "
    "end), with 95% intervals."
)
SEVERITY_TITLES = {"read": "", "caution": "caution: ", "note": "note: "}


def format_summary(results: ProtocolResults) -> str:
    """The console summary of one run (`format_summaries` of one)."""
    return format_summaries([results])


def format_summaries(runs: Sequence[ProtocolResults]) -> str:
    """The console summary of runs side by side: per model its verdict lines, then the legend
    and the flags once (each with the models it holds for), every line within `WIDTH`."""
    lines: list[str] = []
    flags: dict[tuple[str, str], list[str]] = {}
    for results in runs:
        lines.extend(_model_lines(results))
        groups = flag_groups(results)
        for severity in SEVERITIES:
            for flag in groups[severity]:
                flags.setdefault((severity, flag), []).append(results.model)
    # The most important first, whatever run raised them.
    flags = dict(sorted(flags.items(), key=lambda item: SEVERITIES.index(item[0][0])))
    lines.append("")
    lines.extend(_wrapped(LEGEND, ""))
    if flags:
        lines.append("flags:")
        for (severity, flag), models in flags.items():
            where = "" if len(runs) == 1 else f"[{', '.join(models)}] "
            lines.extend(_wrapped(f"- {SEVERITY_TITLES[severity]}{where}{flag}", "  "))
    return "\n".join(lines)


def _model_lines(results: ProtocolResults) -> list[str]:
    run = decode_json(results.to_results_json())
    title = f"{results.model} ({results.architecture}, r = {results.n_iterations})"
    null = results.null_control["max_abs_logit_diff"]
    lines = [
        "",
        *_wrapped(f"{title}; null control max |logit diff| {null:.2e} (0 up to float error)", ""),
    ]
    if not results.replay_realizable:
        lines.append("  replay: not realizable as the same model (dense network)")
    unvalidated = []
    for metric, decomposition in results.decompositions.items():
        if not decomposition.validated:
            unvalidated.append(metric)
            continue
        lines.append(f"  {metric}: {_quality_text(run, metric)}")
        lines.extend(_wrapped(_shares_text(decomposition), "    "))
        text, _ = verdict(run, metric)
        lines.extend(_wrapped(capitalised(text), "    "))
    if unvalidated:
        lines.extend(
            _wrapped(
                f"not validated, no verdict: {', '.join(unvalidated)} (their shares are in "
                "results.json and the report; see the flags)",
                "  ",
            )
        )
    return lines


def capitalised(text: str) -> str:
    """``text`` with every sentence starting with a capital: the verdicts join their reasons,
    each written as a clause, into sentences."""
    return re.sub(r"(^|[.!?]\s+)([a-z])", lambda m: m.group(1) + m.group(2).upper(), text)


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
    first = f", k = {truncated[0]['k']} {_number(truncated[0]['value'])}" if truncated else ""
    return f"full depth {_number(full)}{first}; mean gap over k {_number(mean_gap)}"


def _shares_text(decomposition: Decomposition) -> str:
    parts = []
    for factor in FACTORS:
        value = decomposition.shares[factor]
        low, high = (decomposition.shares.get(f"{factor}_{end}") for end in ("lo", "hi"))
        interval = (
            f" [{_number(low)}, {_number(high)}]"
            if low is not None and high is not None and math.isfinite(low) and math.isfinite(high)
            else ""
        )
        parts.append(f"{factor} {_number(value)}{interval}")
    return "point shares with 95% intervals: " + ", ".join(parts)


def _wrapped(text: str, indent: str) -> list[str]:
    return textwrap.wrap(
        text, width=WIDTH, initial_indent=indent, subsequent_indent=indent + "  "
    ) or [indent]


def _number(value: float) -> str:
    if not math.isfinite(value):
        return "n/a"
    return f"{value:.3f}" if abs(value) < 1000 else f"{value:.1f}"
