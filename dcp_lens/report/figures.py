"""Plotly figures of DCP results, for `dcp_lens.report.html` and notebooks (``results.figures()``).

Every builder reads runs in their ``results.json`` form (`ProtocolResults.to_results_json`, read
back with `dcp_lens.protocol.results.decode_json`, so NaN is NaN) and, for the lens, attention and
hop-count figures, the run's entry of ``report_data.json`` (`dcp_lens.studies.report_extras`).
Nothing here
computes science: each figure draws numbers the protocol stored. Runs sit side by side as
subplot columns (the recurrent model beside its dense control).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dcp_lens.protocol.verdicts import row_flags

Run = Mapping[str, Any]

CONDITION_COLOURS = {
    "full": "#222222",
    "truncate": "#d62728",
    "replay": "#1f77b4",
    "calibrate_truncate": "#ff7f0e",
    "calibrate_replay": "#9467bd",
    "shift": "#2ca02c",
}
FACTOR_COLOURS = {"S": "#ff7f0e", "B": "#1f77b4", "D": "#2ca02c"}
FACTOR_NAMES = {"S": "S readout shift", "B": "B block applications", "D": "D distinct computation"}
_EXTRA_COLOURS = ("#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def run_title(run: Run) -> str:
    """``model (architecture, r = n)``: the column title of one run."""
    return f"{run['model']} ({run['architecture']}, r = {run['n_iterations']})"


def metric_label(metric: str, runs: Sequence[Run] = ()) -> str:
    """The axis label of a metric, saying which way is better (as the runs' ``results.json``
    records it: ``metrics[metric]["higher_is_better"]``, from the metric registry)."""
    records = [run.get("metrics", {}).get(metric, {}) for run in runs]
    higher = next((r["higher_is_better"] for r in records if "higher_is_better" in r), True)
    return f"{metric} ({'higher' if higher else 'lower'} is better)"


def quality_figure(runs: Sequence[Run], metric: str) -> go.Figure:
    """Quality against k for every condition (in the metric's units), each with its interval
    band; full depth as a horizontal line with its band. One column per run."""
    figure = _columns(runs)
    shown: set[str] = set()
    for column, run in enumerate(runs, start=1):
        rows = [row for row in run["curves"] if row["metric"] == metric]
        if not rows:
            continue
        ks = sorted({int(row["k"]) for row in rows if row["condition"] != "full"})
        # Full depth last, so that its dashed line is drawn over the curves that meet it at r.
        conditions = sorted(
            dict.fromkeys(row["condition"] for row in rows), key=lambda name: name == "full"
        )
        for index, condition in enumerate(conditions):
            colour = CONDITION_COLOURS.get(condition, _EXTRA_COLOURS[index % len(_EXTRA_COLOURS)])
            points = sorted(
                (row for row in rows if row["condition"] == condition), key=lambda r: r["k"]
            )
            if condition == "full":
                (full,) = points
                x = [min(ks or [full["k"]]), int(full["k"])]
                value, low, high = ([full[key]] * 2 for key in ("value", "value_lo", "value_hi"))
                dash, width = "dash", 3
            else:
                x = [int(row["k"]) for row in points]
                value, low, high = ([row[key] for row in points] for key in _VALUE_KEYS)
                dash, width = "solid", 2
            label = condition
            if condition in ("replay", "calibrate_replay") and not run["replay_realizable"]:
                label = f"{condition} (dense: not realizable as the same model)"
            _band(figure, x, low, high, colour, column, condition)
            figure.add_trace(
                go.Scatter(
                    x=x, y=value, mode="lines+markers", name=label, legendgroup=condition,
                    showlegend=condition not in shown, legendrank=1 if condition == "full" else 2,
                    line={"color": colour, "dash": dash, "width": width},
                    hovertemplate=f"{condition}<br>k=%{{x}}<br>%{{y:.4g}}<extra></extra>",
                ),
                row=1, col=column,
            )  # fmt: skip
            shown.add(condition)
        figure.update_xaxes(title_text="k (iterations)", row=1, col=column)
    figure.update_yaxes(title_text=metric_label(metric, runs), row=1, col=1)
    figure.update_layout(title=f"Quality against k: {metric}", height=420)
    return figure


def decomposition_figure(runs: Sequence[Run], metric: str) -> go.Figure:
    """S, B and D stacked per k (quality units, so a bar above zero means truncation hurts), with
    the gap and its interval as markers. One column per run; flags show in the hover text."""
    figure = _columns(runs)
    for column, run in enumerate(runs, start=1):
        rows = sorted(
            (row for row in run["decomposition"] if row["metric"] == metric),
            key=lambda row: row["k"],
        )
        if not rows:
            continue
        ks = [int(row["k"]) for row in rows]
        for factor in ("S", "B", "D"):
            hover = [
                f"{factor}(k={row['k']}) = {_number(row[factor])} "
                f"[{_number(row.get(factor + '_lo'))}, {_number(row.get(factor + '_hi'))}]"
                + (
                    f"<br>residual AUROC {_number(row['residual_auroc'])}"
                    if factor == "S" and "residual_auroc" in row
                    else ""
                )
                + "".join(f"<br>{flag}" for flag in row_flags(row) if flag.startswith(factor))
                for row in rows
            ]
            figure.add_trace(
                go.Bar(
                    x=ks, y=[row[factor] for row in rows], name=FACTOR_NAMES[factor],
                    legendgroup=factor, showlegend=column == 1,
                    marker={"color": FACTOR_COLOURS[factor]}, hovertext=hover,
                    hoverinfo="text",
                ),
                row=1, col=column,
            )  # fmt: skip
        gaps = [row["gap"] for row in rows]
        figure.add_trace(
            go.Scatter(
                x=ks, y=gaps, mode="markers", name="gap", legendgroup="gap",
                showlegend=column == 1, marker={"color": "black", "symbol": "diamond", "size": 9},
                error_y=_error_bars(gaps, [row.get("gap_lo") for row in rows],
                                    [row.get("gap_hi") for row in rows]),
            ),
            row=1, col=column,
        )  # fmt: skip
        figure.update_xaxes(title_text="k (iterations)", row=1, col=column)
    figure.update_yaxes(title_text=f"quality units of {metric}", row=1, col=1)
    figure.update_layout(barmode="relative", title=f"S, B, D per k: {metric}", height=420)
    return figure


def probe_figure(runs: Sequence[Run]) -> go.Figure:
    """The residual-stream probe over iterations: Mahalanobis distance relative to held-out
    full-depth states (noise floor line) and the two-sample AUROC (0.5 line), for s_t at every t
    and for the calibrated states calibrate(truncate(k)). One column per run."""
    figure = make_subplots(
        rows=2, cols=max(1, len(runs)), subplot_titles=[run_title(r) for r in runs],
        vertical_spacing=0.12, horizontal_spacing=0.08,
    )  # fmt: skip
    for column, run in enumerate(runs, start=1):
        probe = run.get("probe") or {}
        trajectory = probe.get("trajectory") or []
        calibrated = probe.get("calibrate_truncate") or []
        ts = [p["iteration"] for p in trajectory] or [0, run["n_iterations"]]
        # Both scores' references: held-out full-depth states score 1 (Mahalanobis over the
        # noise floor) and 0.5 (AUROC) by construction.
        for row, score, reference, name in (
            (1, "mahalanobis", 1.0, "noise floor (held-out full depth)"),
            (2, "auroc", 0.5, "indistinguishable (AUROC 0.5)"),
        ):
            figure.add_trace(
                go.Scatter(
                    x=[p["iteration"] for p in trajectory], y=[p[score] for p in trajectory],
                    mode="lines+markers", name="s_t (truncated states)", legendgroup="s_t",
                    showlegend=column == 1 and row == 1, line={"color": "#d62728"},
                ),
                row=row, col=column,
            )  # fmt: skip
            figure.add_trace(
                go.Scatter(
                    x=[p["k"] for p in calibrated], y=[p[score] for p in calibrated],
                    mode="markers", name="calibrate(truncate(k))", legendgroup="calibrated",
                    showlegend=column == 1 and row == 1,
                    marker={"color": "#ff7f0e", "symbol": "x", "size": 10},
                ),
                row=row, col=column,
            )  # fmt: skip
            figure.add_trace(
                go.Scatter(
                    x=[min(ts), max(ts)], y=[reference] * 2, mode="lines", name=name,
                    showlegend=column == 1, line={"color": "grey", "dash": "dot"},
                ),
                row=row, col=column,
            )  # fmt: skip
        distances = [p["mahalanobis"] for p in (*trajectory, *calibrated)]
        if any(isinstance(d, float) and d > 10 for d in distances):
            figure.update_yaxes(type="log", row=1, col=column)  # far-off states: orders apart
        figure.update_xaxes(title_text="iteration t (or k)", row=2, col=column)
    figure.update_yaxes(title_text="Mahalanobis / held-out", row=1, col=1)
    figure.update_yaxes(title_text="two-sample AUROC", row=2, col=1)
    figure.update_layout(title="Readout shift measured directly: the probe", height=560)
    return figure


def hops_figure(runs: Sequence[Run], by_hops: Sequence[Mapping[str, Any] | None]) -> go.Figure:
    """Accuracy of truncate(k) per hop count (solid) and of full depth (dashed), one column per
    run (``by_hops``: each run's ``report_data["by_hops"]`` or None)."""
    figure = _columns(runs)
    for column, (run, table) in enumerate(zip(runs, by_hops, strict=True), start=1):
        if not table:
            continue
        for index, group in enumerate(table["groups"]):
            colour = _EXTRA_COLOURS[index % len(_EXTRA_COLOURS)]
            name = f"{group['hops']} hop{'s' if group['hops'] != 1 else ''}"
            figure.add_trace(
                go.Scatter(
                    x=table["k_grid"], y=group["truncate"], mode="lines+markers", name=name,
                    legendgroup=name, showlegend=column == 1, line={"color": colour},
                ),
                row=1, col=column,
            )  # fmt: skip
            figure.add_trace(
                go.Scatter(
                    x=[table["k_grid"][0], run["n_iterations"]], y=[group["full"]] * 2,
                    mode="lines", legendgroup=name, showlegend=False,
                    line={"color": colour, "dash": "dash"}, name=f"{name}, full depth",
                ),
                row=1, col=column,
            )  # fmt: skip
        figure.update_xaxes(title_text="k (iterations)", row=1, col=column)
    figure.update_yaxes(title_text="accuracy of truncate(k)", row=1, col=1)
    figure.update_layout(title="Truncation by hop count (dashed: full depth)", height=420)
    return figure


def lens_figure(run: Run, lens: Mapping[str, Any]) -> go.Figure:
    """The per-iteration logit lens of one example: the readout applied to every s_t; colour is
    the top-1 probability, text the top-1 token (iterations x positions)."""
    tokens = lens["tokens"]
    x = [f"{i}:{token}" for i, token in enumerate(tokens)]
    hover = [
        [
            f"t={t}, position {x[p]}<br>top-1 {lens['top_tokens'][t][p]!r} "
            f"p={lens['top_probs'][t][p]:.3f}" + _target_hover(lens, t, p)
            for p in range(len(tokens))
        ]
        for t in range(len(lens["iterations"]))
    ]
    figure = go.Figure(
        go.Heatmap(
            z=lens["top_probs"], x=x, y=lens["iterations"], text=lens["top_tokens"],
            texttemplate="%{text}", colorscale="Blues", zmin=0, zmax=1, hovertext=hover,
            hoverinfo="text", colorbar={"title": "top-1 p"},
        )
    )  # fmt: skip
    figure.update_layout(
        title=f"Logit lens over iterations: {run_title(run)}",
        xaxis_title="position: input token", yaxis_title="iteration t (readout of s_t)",
        height=max(300, 60 + 28 * len(lens["iterations"])),
    )  # fmt: skip
    return figure


def attention_figure(run: Run, attention: Mapping[str, Any]) -> go.Figure:
    """Attention of one layer across iterations (one example): a heatmap of each iteration's
    pattern, averaged over heads, with a slider over iterations."""
    tokens = attention["tokens"]
    labels = [f"{i}:{token}" for i, token in enumerate(tokens)]
    patterns = attention["patterns"]  # [iteration][head][dest][src]
    figure = go.Figure()
    for index, heads in enumerate(patterns):
        mean = [
            [sum(head[d][s] for head in heads) / len(heads) for s in range(len(tokens))]
            for d in range(len(tokens))
        ]
        figure.add_trace(
            go.Heatmap(
                z=mean, x=labels, y=labels, colorscale="Viridis", zmin=0, zmax=1,
                visible=index == 0, name=f"t={attention['iterations'][index]}",
                colorbar={"title": "attention"},
            )
        )  # fmt: skip
    steps = [
        {
            "method": "update",
            "label": str(t),
            "args": [{"visible": [j == i for j in range(len(patterns))]}],
        }
        for i, t in enumerate(attention["iterations"])
    ]
    figure.update_layout(
        title=f"Attention ({attention['layer']}, mean over heads): {run_title(run)}",
        sliders=[{"steps": steps, "currentvalue": {"prefix": "iteration t = "}}],
        xaxis_title="source position", yaxis_title="destination position",
        yaxis={"autorange": "reversed"}, height=560,
    )  # fmt: skip
    return figure


# ----------------------------------------------------------------------------- internals

_VALUE_KEYS = ("value", "value_lo", "value_hi")


def _columns(runs: Sequence[Run]) -> go.Figure:
    return make_subplots(
        rows=1, cols=max(1, len(runs)), subplot_titles=[run_title(run) for run in runs],
        horizontal_spacing=0.08,
    )  # fmt: skip


def _band(
    figure: go.Figure,
    x: list[int],
    low: list[float],
    high: list[float],
    colour: str,
    column: int,
    group: str,
) -> None:
    """A shaded interval between ``low`` and ``high``."""
    if all(_missing(v) for v in (*low, *high)):
        return
    figure.add_trace(
        go.Scatter(
            x=[*x, *reversed(x)], y=[*high, *reversed(low)], fill="toself", fillcolor=colour,
            opacity=0.15, line={"width": 0}, hoverinfo="skip", showlegend=False,
            legendgroup=group,
        ),
        row=1, col=column,
    )  # fmt: skip


def _error_bars(
    values: list[float], low: list[float | None], high: list[float | None]
) -> dict[str, Any]:
    def distance(a: float | None, b: float) -> float:
        return math.nan if _missing(a) or _missing(b) else abs(float(a) - b)  # type: ignore[arg-type]

    return {
        "type": "data",
        "symmetric": False,
        "array": [distance(h, v) for h, v in zip(high, values, strict=True)],
        "arrayminus": [distance(lo, v) for lo, v in zip(low, values, strict=True)],
        "color": "black",
    }


def _target_hover(lens: Mapping[str, Any], t: int, p: int) -> str:
    targets = lens.get("target_probs")
    if not targets or targets[t][p] is None or _missing(targets[t][p]):
        return ""
    return f"<br>target {lens['targets'][p]!r} p={targets[t][p]:.3f}"


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _number(value: Any) -> str:
    return "nan" if _missing(value) else f"{float(value):.3f}"
