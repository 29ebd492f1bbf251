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
from html import escape
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dcp_lens.protocol.wording import row_flags

Run = Mapping[str, Any]

CONDITION_COLOURS = {
    "full": "#222222",
    "truncate": "#d62728",
    "replay": "#1f77b4",
    "calibrate_truncate": "#ff7f0e",
    "calibrate_replay": "#9467bd",
    "shift": "#2ca02c",
    "translate_truncate": "#8c564b",
    "translate_replay": "#e377c2",
    "base_rate": "#7f7f7f",
}
FACTOR_COLOURS = {"S": "#ff7f0e", "B": "#1f77b4", "D": "#2ca02c"}
FACTOR_NAMES = {"S": "S readout shift", "B": "B block applications", "D": "D distinct computation"}
_EXTRA_COLOURS = ("#bcbd22", "#17becf", "#8c564b", "#e377c2", "#7f7f7f")


# The order of the conditions in a quality figure's legend, and the views its buttons offer (each
# the conditions it shows; a condition not named here is shown in every view).
CONDITION_ORDER = (
    "full", "base_rate", "truncate", "shift", "calibrate_truncate", "translate_truncate",
    "replay", "calibrate_replay", "translate_replay",
)  # fmt: skip
CONDITION_VIEWS: dict[str, tuple[str, ...] | None] = {
    "every condition": None,
    "S: truncate, calibrated, translated": (
        "full", "base_rate", "truncate", "calibrate_truncate", "translate_truncate",
    ),
    "B: truncate, replay": ("full", "truncate", "replay", "calibrate_replay", "translate_replay"),
    "shift": ("full", "truncate", "shift"),
}  # fmt: skip
# Two curves closer than this share of the plot's value range at every k lie on top of each
# other as drawn; the legend and the hover text say so.
OVERLAP_TOLERANCE = 0.005


def plot_text(value: object) -> str:
    """``value`` as text for a plotly title, legend, axis label, tick or hover text: plotly reads
    those strings as a small subset of HTML, so ``<``, ``>`` and ``&`` become entities (shown as
    themselves) and ``%`` one too (no hover-template placeholder can be formed)."""
    return escape(str(value), quote=False).replace("%", "&#37;")


def run_title(run: Run) -> str:
    """``model (architecture, r = n)``: the column title of one run (plain text)."""
    return f"{run['model']} ({run['architecture']}, r = {run['n_iterations']})"


def metric_label(metric: str, runs: Sequence[Run] = ()) -> str:
    """The axis label of a metric, saying which way is better (as the runs' ``results.json``
    records it: ``metrics[metric]["higher_is_better"]``, from the metric registry); escaped for
    plotly (`plot_text`)."""
    records = [run.get("metrics", {}).get(metric, {}) for run in runs]
    higher = next((r["higher_is_better"] for r in records if "higher_is_better" in r), True)
    return f"{plot_text(metric)} ({'higher' if higher else 'lower'} is better)"


def quality_figure(runs: Sequence[Run], metric: str) -> go.Figure:
    """Quality against k for every condition (in the metric's units), each with its interval
    band; full depth as a horizontal line with its band. One column per run. The legend sits
    under the plot in `CONDITION_ORDER` (a click hides a condition, a double click shows it
    alone), buttons show the views of `CONDITION_VIEWS`, and a curve that lies on an earlier
    one at every k is dotted with open markers and named "(on that one)" in the legend."""
    figure = _columns(runs)
    drawn: list[str] = []  # the condition of each trace, in order (for the view buttons)
    columns = [_quality_rows(run, metric) for run in runs]
    overlaps = [_overlaps(rows) for rows in columns]
    shown: set[str] = set()
    for column, (run, rows) in enumerate(zip(runs, columns, strict=True), start=1):
        if not rows:
            continue
        ks = sorted({int(row["k"]) for points in rows.values() for row in points})
        # Full depth last, so that its dashed line is drawn over the curves that meet it at r.
        for condition in sorted(rows, key=lambda name: name == "full"):
            points = rows[condition]
            colour = CONDITION_COLOURS.get(condition, _extra_colour(condition))
            if condition == "full":
                full = points[0]
                x = [min(ks or [int(full["k"])]), int(full["k"])]
                value, low, high = ([full[key]] * 2 for key in _VALUE_KEYS)
                dash, width, symbol = "dash", 3, "circle"
            else:
                x = [int(row["k"]) for row in points]
                value, low, high = ([row[key] for row in points] for key in _VALUE_KEYS)
                dash, width, symbol = "solid", 2, "circle"
            under = overlaps[column - 1].get(condition)
            if under is not None:
                dash, symbol = "dot", "circle-open"
            if _band(figure, x, low, high, colour, column, condition):
                drawn.append(condition)
            hover = plot_text(condition) + (f" (on {plot_text(under)})" if under else "")
            figure.add_trace(
                go.Scatter(
                    x=x,
                    y=value,
                    mode="lines+markers",
                    name=_legend_name(condition, run, runs, overlaps),
                    legendgroup=condition,
                    showlegend=condition not in shown,
                    legendrank=_rank(condition),
                    line={"color": colour, "dash": dash, "width": width},
                    marker={"symbol": symbol, "size": 9 if under else 6},
                    hovertemplate=f"{hover}<br>k=%{{x}}<br>%{{y:.4g}}<extra></extra>",
                ),
                row=1,
                col=column,
            )
            drawn.append(condition)
            shown.add(condition)
        figure.update_xaxes(title_text="k (iterations)", dtick=1, row=1, col=column)
    figure.update_yaxes(title_text=metric_label(metric, runs), row=1, col=1)
    figure.update_layout(
        title={"text": f"Quality against k: {plot_text(metric)}", "y": 0.98, "yanchor": "top"},
        height=520,
        legend={
            "orientation": "h",
            "yanchor": "top",
            "y": -0.2,
            "x": 0,
            "traceorder": "normal",
            "groupclick": "togglegroup",
        },
        margin={"t": 120, "b": 150},
        updatemenus=[_view_buttons(drawn)],
    )
    return figure


def _quality_rows(run: Run, metric: str) -> dict[str, list[Mapping[str, Any]]]:
    """The curve rows of one run and metric, per condition, each sorted by k."""
    rows: dict[str, list[Mapping[str, Any]]] = {}
    for row in run["curves"]:
        if row["metric"] == metric:
            rows.setdefault(row["condition"], []).append(row)
    return {name: sorted(points, key=lambda r: r["k"]) for name, points in rows.items()}


def _overlaps(rows: Mapping[str, list[Mapping[str, Any]]]) -> dict[str, str]:
    """Each condition whose curve lies on the curve of a condition earlier in the legend at
    every k (closer than `OVERLAP_TOLERANCE` of the value range drawn), with that condition."""
    values = [
        float(r["value"]) for points in rows.values() for r in points if not _missing(r["value"])
    ]
    tolerance = OVERLAP_TOLERANCE * max(max(values, default=0.0) - min(values, default=0.0), 1e-12)
    found: dict[str, str] = {}
    ordered = sorted((name for name in rows if name != "full"), key=_rank)
    for index, name in enumerate(ordered):
        curve = {int(row["k"]): row["value"] for row in rows[name]}
        for earlier in ordered[:index]:
            other = {int(row["k"]): row["value"] for row in rows[earlier]}
            if curve.keys() == other.keys() and all(
                _close(curve[k], other[k], tolerance) for k in curve
            ):
                found[name] = found.get(earlier, earlier)
                break
    return found


def _close(a: float | int | None, b: float | int | None, tolerance: float) -> bool:
    if a is None or b is None or _missing(a) or _missing(b):
        return _missing(a) and _missing(b)
    return abs(float(a) - float(b)) <= tolerance


def _legend_name(
    condition: str, run: Run, runs: Sequence[Run], overlaps: Sequence[Mapping[str, str]]
) -> str:
    """The legend entry of a condition: its name, "(dense: ...)" for a replay that a dense model
    cannot realize, and "(on other)" where its curve lies on another's (naming the run when not
    in every run)."""
    label = plot_text(condition)
    if condition in ("replay", "calibrate_replay") and not run["replay_realizable"]:
        label += " (dense: not realizable as the same model)"
    marks = [
        (overlap[condition], plot_text(run_title(each)))
        for each, overlap in zip(runs, overlaps, strict=True)
        if condition in overlap
    ]
    if marks:
        unders = {under for under, _ in marks}
        if len(marks) == len(runs) and len(unders) == 1:
            label += f" (on {plot_text(marks[0][0])})"
        else:
            label += " (on " + "; ".join(f"{plot_text(u)} in {title}" for u, title in marks) + ")"
    return label


def _rank(condition: str) -> int:
    return (
        CONDITION_ORDER.index(condition) if condition in CONDITION_ORDER else len(CONDITION_ORDER)
    )


def _extra_colour(condition: str) -> str:
    return _EXTRA_COLOURS[sum(map(ord, condition)) % len(_EXTRA_COLOURS)]


def _view_buttons(drawn: Sequence[str]) -> dict[str, object]:
    """Buttons over the plot that show one view of `CONDITION_VIEWS` each (the others stay in
    the legend, greyed, a click away)."""
    buttons = []
    for label, view in CONDITION_VIEWS.items():
        visible = [
            True if view is None or c in view or c not in CONDITION_ORDER else "legendonly"
            for c in drawn
        ]
        buttons.append({"label": label, "method": "restyle", "args": [{"visible": visible}]})
    return {
        "type": "buttons",
        "direction": "right",
        "buttons": buttons,
        "showactive": True,
        "x": 0,
        "xanchor": "left",
        "y": 1.13,
        "yanchor": "bottom",
        "pad": {"r": 4, "t": 0},
    }


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
                + "".join(
                    f"<br>{plot_text(flag)}" for flag in row_flags(row) if flag.startswith(factor)
                )
                for row in rows
            ]
            figure.add_trace(
                go.Bar(
                    x=ks,
                    y=[row[factor] for row in rows],
                    name=FACTOR_NAMES[factor],
                    legendgroup=factor,
                    showlegend=column == 1,
                    marker={"color": FACTOR_COLOURS[factor]},
                    hovertext=hover,
                    hoverinfo="text",
                ),
                row=1,
                col=column,
            )
        gaps = [row["gap"] for row in rows]
        figure.add_trace(
            go.Scatter(
                x=ks,
                y=gaps,
                mode="markers",
                name="gap",
                legendgroup="gap",
                showlegend=column == 1,
                marker={"color": "black", "symbol": "diamond", "size": 9},
                error_y=_error_bars(
                    gaps, [row.get("gap_lo") for row in rows], [row.get("gap_hi") for row in rows]
                ),
            ),
            row=1,
            col=column,
        )
        figure.update_xaxes(title_text="k (iterations)", row=1, col=column)
    figure.update_yaxes(title_text=f"quality units of {plot_text(metric)}", row=1, col=1)
    figure.update_layout(
        barmode="relative", title=f"S, B, D per k: {plot_text(metric)}", height=420
    )
    return figure


ANSWER_HEIGHT = 380  # px: the answer's figure and the verdict sentences fit a 900 px screen


def answer_figure(runs: Sequence[Run], metric: str) -> go.Figure:
    """The figure at the top of report.html: `decomposition_figure` of the metric the verdict
    sentences above it read (the first validated one), low enough to share the first screen."""
    figure = decomposition_figure(runs, metric)
    figure.update_layout(
        title=f"The truncation gap split into S, B and D per k: {plot_text(metric)}",
        height=ANSWER_HEIGHT,
        margin={"t": 60, "b": 50},
    )
    return figure


def probe_figure(runs: Sequence[Run]) -> go.Figure:
    """The residual-stream probe over iterations: Mahalanobis distance relative to held-out
    full-depth states (noise floor line) and the two-sample AUROC (0.5 line), for s_t at every t
    and for the calibrated states calibrate(truncate(k)). One column per run."""
    figure = make_subplots(
        rows=2,
        cols=max(1, len(runs)),
        subplot_titles=[plot_text(run_title(r)) for r in runs],
        vertical_spacing=0.12,
        horizontal_spacing=0.08,
    )
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
                    x=[p["iteration"] for p in trajectory],
                    y=[p[score] for p in trajectory],
                    mode="lines+markers",
                    name="s_t (truncated states)",
                    legendgroup="s_t",
                    showlegend=column == 1 and row == 1,
                    line={"color": "#d62728"},
                ),
                row=row,
                col=column,
            )
            figure.add_trace(
                go.Scatter(
                    x=[p["k"] for p in calibrated],
                    y=[p[score] for p in calibrated],
                    mode="markers",
                    name="calibrate(truncate(k))",
                    legendgroup="calibrated",
                    showlegend=column == 1 and row == 1,
                    marker={"color": "#ff7f0e", "symbol": "x", "size": 10},
                ),
                row=row,
                col=column,
            )
            figure.add_trace(
                go.Scatter(
                    x=[min(ts), max(ts)],
                    y=[reference] * 2,
                    mode="lines",
                    name=name,
                    showlegend=column == 1,
                    line={"color": "grey", "dash": "dot"},
                ),
                row=row,
                col=column,
            )
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
            name = plot_text(f"{group['hops']} hop{'s' if group['hops'] != 1 else ''}")
            figure.add_trace(
                go.Scatter(
                    x=table["k_grid"],
                    y=group["truncate"],
                    mode="lines+markers",
                    name=name,
                    legendgroup=name,
                    showlegend=column == 1,
                    line={"color": colour},
                ),
                row=1,
                col=column,
            )
            figure.add_trace(
                go.Scatter(
                    x=[table["k_grid"][0], run["n_iterations"]],
                    y=[group["full"]] * 2,
                    mode="lines",
                    legendgroup=name,
                    showlegend=False,
                    line={"color": colour, "dash": "dash"},
                    name=f"{name}, full depth",
                ),
                row=1,
                col=column,
            )
        figure.update_xaxes(title_text="k (iterations)", row=1, col=column)
    figure.update_yaxes(title_text="accuracy of truncate(k)", row=1, col=1)
    figure.update_layout(title="Truncation by hop count (dashed: full depth)", height=420)
    return figure


LENS_ROW_PX = 34  # height of one iteration's row in the logit-lens heatmap


def lens_figure(run: Run, lens: Mapping[str, Any]) -> go.Figure:
    """The per-iteration logit lens of one example: the readout applied to every s_t; colour is
    the top-1 probability, text the top-1 token (iterations x positions). One row of
    `LENS_ROW_PX` per iteration, each labelled s_t, so that r + 1 rows stay readable."""
    tokens = [plot_text(token) for token in lens["tokens"]]
    x = [f"{i}:{token}" for i, token in enumerate(tokens)]
    y = [f"s_{t}" for t in lens["iterations"]]
    top = [[plot_text(token) for token in row] for row in lens["top_tokens"]]
    hover = [
        [
            f"{y[t]}, position {x[p]}<br>top-1 {plot_text(repr(lens['top_tokens'][t][p]))} "
            f"p={lens['top_probs'][t][p]:.3f}" + _target_hover(lens, t, p)
            for p in range(len(tokens))
        ]
        for t in range(len(lens["iterations"]))
    ]
    figure = go.Figure(
        go.Heatmap(
            z=lens["top_probs"],
            x=x,
            y=y,
            text=top,
            texttemplate="%{text}",
            textfont={"size": 11},
            colorscale="Blues",
            zmin=0,
            zmax=1,
            hovertext=hover,
            hoverinfo="text",
            colorbar={"title": {"text": "top-1 p"}, "thickness": 14},
            xgap=1,
            ygap=1,
        )
    )
    margin = {"t": 60, "b": 110, "l": 70, "r": 30}
    figure.update_layout(
        title=f"Logit lens over iterations: {plot_text(run_title(run))}",
        xaxis={
            "title": {"text": "position: input token"},
            "tickangle": -45,
            "automargin": True,
            "type": "category",
        },
        yaxis={"title": {"text": "readout of s_t"}, "type": "category", "automargin": True},
        height=margin["t"] + margin["b"] + LENS_ROW_PX * len(y),
        margin=margin,
    )
    return figure


def attention_figure(run: Run, attention: Mapping[str, Any]) -> go.Figure:
    """Attention of one layer across iterations (one example): a heatmap of each iteration's
    pattern, averaged over heads, with a slider over iterations."""
    tokens = attention["tokens"]
    labels = [f"{i}:{plot_text(token)}" for i, token in enumerate(tokens)]
    patterns = attention["patterns"]  # [iteration][head][dest][src]
    figure = go.Figure()
    for index, heads in enumerate(patterns):
        mean = [
            [sum(head[d][s] for head in heads) / len(heads) for s in range(len(tokens))]
            for d in range(len(tokens))
        ]
        figure.add_trace(
            go.Heatmap(
                z=mean,
                x=labels,
                y=labels,
                colorscale="Viridis",
                zmin=0,
                zmax=1,
                visible=index == 0,
                name=plot_text(f"t={attention['iterations'][index]}"),
                colorbar={"title": {"text": "attention"}},
            )
        )
    steps = [
        {
            "method": "update",
            "label": plot_text(t),
            "args": [{"visible": [j == i for j in range(len(patterns))]}],
        }
        for i, t in enumerate(attention["iterations"])
    ]
    figure.update_layout(
        title=(
            f"Attention ({plot_text(attention['layer'])}, mean over heads): "
            f"{plot_text(run_title(run))}"
        ),
        sliders=[{"steps": steps, "currentvalue": {"prefix": "iteration t = "}}],
        xaxis_title="source position",
        yaxis_title="destination position",
        yaxis={"autorange": "reversed"},
        height=560,
    )
    return figure


# ----------------------------------------------------------------------------- internals

_VALUE_KEYS = ("value", "value_lo", "value_hi")


def _columns(runs: Sequence[Run]) -> go.Figure:
    return make_subplots(
        rows=1,
        cols=max(1, len(runs)),
        subplot_titles=[plot_text(run_title(r)) for r in runs],
        horizontal_spacing=0.08,
    )


def _band(
    figure: go.Figure,
    x: list[int],
    low: list[float],
    high: list[float],
    colour: str,
    column: int,
    group: str,
) -> bool:
    """A shaded interval between ``low`` and ``high``; False (nothing drawn) when it has no
    finite end."""
    if all(_missing(v) for v in (*low, *high)):
        return False
    figure.add_trace(
        go.Scatter(
            x=[*x, *reversed(x)],
            y=[*high, *reversed(low)],
            fill="toself",
            fillcolor=colour,
            opacity=0.15,
            line={"width": 0},
            hoverinfo="skip",
            showlegend=False,
            legendgroup=group,
        ),
        row=1,
        col=column,
    )
    return True


def _error_bars(
    values: list[float], low: list[float | None], high: list[float | None]
) -> dict[str, object]:
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
    return f"<br>target {plot_text(repr(lens['targets'][p]))} p={targets[t][p]:.3f}"


def _missing(value: object) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _number(value: float | int | None) -> str:
    return "nan" if value is None or _missing(value) else f"{float(value):.3f}"
