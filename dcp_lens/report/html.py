"""Every rendering of dcp-lens results: the training table, the headline and report.html (plotly
figures from `dcp_lens.report.figures`, imported only when drawing). Functions here read results
objects and never recompute science."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dcp_lens.protocol.results import FACTORS, ProtocolResults, decode_json
from dcp_lens.protocol.verdicts import NULL_TOLERANCE
from dcp_lens.protocol.wording import below_r as _below_r
from dcp_lens.protocol.wording import finite_mean as _mean
from dcp_lens.protocol.wording import format_number as _number
from dcp_lens.protocol.wording import verdict  # the report reads the verdicts the protocol builds
from dcp_lens.report.assets import (
    PLOTLY_JS,
    asset_folder,
    figure_html,
    figure_ids,
    plotly_script,
    write_plotly_js,
)
from dcp_lens.report.console import capitalised
from dcp_lens.utils.errors import ConfigError
from dcp_lens.utils.files import write_text_atomically

if TYPE_CHECKING:  # annotations only: rendering a table needs no training code
    from dcp_lens.training.evaluation import AccuracyTable


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


# ------------------------------------------------------------------ report.html

REPORT_FILE = "report.html"


def run_record(results: ProtocolResults | Mapping[str, Any]) -> dict[str, Any]:
    """One run in its ``results.json`` form with NaN as NaN: what every renderer reads, so that
    keys added to results (validity flags) reach the report without a change here."""
    if isinstance(results, ProtocolResults):
        results = results.to_results_json()
    return decode_json(dict(results))


def headline_html(results: ProtocolResults | Mapping[str, Any]) -> str:
    """The headline of one run as HTML (no scripts): per metric the shares with intervals, the
    classic slope, the gap in the metric's units, then the verdict and its flags; the metrics
    not validated on the planted models folded into a ``<details>`` element below."""
    run = run_record(results)
    validated = [metric for metric in run["shares"] if _validated(run, metric)]
    others = [metric for metric in run["shares"] if metric not in validated]
    parts = [f"<div class='headline'><h3>{escape(_run_title(run))}</h3>"]
    if validated:
        parts.append(_metrics_html(run, validated))
    else:
        parts.append(
            "<p class='flag'>No metric of this run is validated on the planted models: "
            "none of its verdicts is to be read.</p>"
        )
    if others:
        parts.append(
            "<details class='unvalidated'><summary>Not validated on the planted models, do not "
            f"read: {escape(', '.join(others))} (shares, verdicts and flags)</summary>"
            f"{_metrics_html(run, others)}</details>"
        )
    parts.append(
        "<p class='note'>Shares: S, B, D as shares of the truncation gap's area over k, with "
        "95% paired bootstrap intervals; slope: quality against k / r, the classic reading; gap: "
        "its mean over k (a loss gap is the rise in loss).</p></div>"
    )
    return "".join(parts)


def answer_html(results: ProtocolResults | Mapping[str, Any]) -> str:
    """The answer of one run in a sentence per validated metric (the first sentence of its
    verdict), as HTML: what report.html shows first."""
    run = run_record(results)
    items = [
        f"<li><b>{escape(metric)}</b>: {prose_html(_first_sentence(verdict(run, metric)[0]))}</li>"
        for metric in run["shares"]
        if _validated(run, metric)
    ]
    if not items:
        items = [
            "<li>No metric of this run is validated on the planted models, so it has no "
            "answer to read (the headline lists every metric).</li>"
        ]
    return (
        f"<div class='answer'><h3>{escape(_run_title(run))}</h3>"
        f"<ul class='verdicts'>{''.join(items)}</ul></div>"
    )


def answer_metric(runs: Sequence[Mapping[str, Any]]) -> str | None:
    """The metric the answer's figure draws: the first validated one of any run, else None."""
    for run in runs:
        for metric in run["shares"]:
            if _validated(run, metric):
                return str(metric)
    return None


def prose_html(text: str) -> str:
    """A verdict's or a flag's plain text as HTML: escaped, every sentence starting with a
    capital, and `code` spans (between backticks) set as ``<code>``."""
    pieces = capitalised(text).split("`")
    if len(pieces) % 2 == 0:  # an unpaired backtick: no code span to set
        return escape(capitalised(text))
    return "".join(
        f"<code>{escape(piece)}</code>" if index % 2 else escape(piece)
        for index, piece in enumerate(pieces)
    )


def _first_sentence(text: str) -> str:
    """``text`` up to the end of its first sentence (a full stop followed by a capital)."""
    return re.split(r"(?<=[.!?])\s+(?=[A-Z])", text.strip(), maxsplit=1)[0]


def _validated(run: Mapping[str, Any], metric: str) -> bool:
    return bool(run.get("metrics", {}).get(metric, {}).get("validated"))


def _metrics_html(run: Mapping[str, Any], metrics: Sequence[str]) -> str:
    """The headline's table (one row per metric) and verdict list for ``metrics`` of ``run``."""
    rows, verdicts = [], []
    for metric in metrics:
        shares = {**run["shares"][metric], **run.get("share_intervals", {}).get(metric, {})}
        record = run.get("metrics", {}).get(metric, {})
        mark = "validated" if record.get("validated") else "not validated: do not read"
        cells = [
            f"{escape(metric)} ({mark})",
            *(_interval_text(shares, factor) for factor in FACTORS),
        ]
        cells += [_interval_text(record, "truncation_slope"), _gap_text(run, metric)]
        rows.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")
        text, flags = verdict(run, metric)
        flag_items = "".join(f"<li class='flag'>{prose_html(flag)}</li>" for flag in flags)
        verdicts.append(
            f"<li><b>{escape(metric)}</b>: {prose_html(text)}"
            + (f"<ul>{flag_items}</ul>" if flags else "")
            + "</li>"
        )
    head = "".join(
        f"<th>{name}</th>"
        for name in (
            "metric",
            "S share",
            "B share",
            "D share",
            "truncation slope",
            "gap (metric's units)",
        )
    )
    return (
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
        f"<ul class='verdicts'>{''.join(verdicts)}</ul>"
    )


def report_figures(
    runs: Sequence[ProtocolResults | Mapping[str, Any]],
    report_data: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Every figure of report.html as plotly figures, keyed ``answer`` (S, B, D per k of the first
    validated metric; absent where no metric is validated), ``quality_<metric>``,
    ``decomposition_<metric>``, ``probe``, ``by_hops``, ``lens_<i>``, ``attention_<i>`` (i: the
    run's index; the last three only with ``report_data`` holding them)."""
    from dcp_lens.report import figures

    records = [run_record(run) for run in runs]
    extras = _extras(records, report_data)
    drawn: dict[str, Any] = {}
    answer = answer_metric(records)
    if answer is not None:
        drawn["answer"] = figures.answer_figure(records, answer)
    for metric in dict.fromkeys(m for run in records for m in run["shares"]):
        drawn[f"quality_{metric}"] = figures.quality_figure(records, metric)
        drawn[f"decomposition_{metric}"] = figures.decomposition_figure(records, metric)
    if any(run.get("probe", {}).get("trajectory") for run in records):
        drawn["probe"] = figures.probe_figure(records)
    by_hops = [extra.get("by_hops") for extra in extras]
    if any(by_hops):
        drawn["by_hops"] = figures.hops_figure(records, by_hops)
    for index, (run, extra) in enumerate(zip(records, extras, strict=True)):
        if extra.get("lens"):
            drawn[f"lens_{index}"] = figures.lens_figure(run, extra["lens"])
        if extra.get("attention"):
            drawn[f"attention_{index}"] = figures.attention_figure(run, extra["attention"])
    return drawn


def render_report(
    runs: Sequence[ProtocolResults | Mapping[str, Any]],
    report_data: Mapping[str, Any] | None = None,
    plotly_src: str | None = None,
) -> str:
    """report.html for one or several runs (side by side) as one HTML page that needs no network
    access. ``report_data``: a `read_report_data` document (lens, attention, hop counts, command,
    environment), optional. ``plotly_src``: where the page loads plotly.js from, relative to it
    (`write_report` passes the shared copy's path); None inlines it, for a page that must stand
    alone. A section with nothing to show is left out and named in the contents line instead.
    Every string the runs carry is escaped for where it lands (`dcp_lens.report.assets`)."""
    records = [run_record(run) for run in runs]
    if not records:
        raise ValueError("no runs to report; pass at least one ProtocolResults.")
    report_data = report_data or {}
    drawn = report_figures(records, report_data)
    extras = _extras(records, report_data)
    ids = figure_ids(drawn)

    def figure(name: str) -> str:
        return (
            f"<div class='figure' data-figure='{escape(name)}'>"
            f"{figure_html(drawn[name], ids[name])}</div>"
        )

    metrics = list(dict.fromkeys(m for run in records for m in run["shares"]))
    sections: list[tuple[str, str, list[str]]] = [
        (
            "headline",
            "Headline",
            ["<div class='runs'>", *(headline_html(run) for run in records), "</div>"],
        ),
        (
            "quality",
            "Quality against k, every condition",
            [figure(f"quality_{metric}") for metric in metrics],
        ),
        (
            "decomposition",
            "The gap split into S, B and D, per k",
            [figure(f"decomposition_{metric}") for metric in metrics],
        ),
    ]
    missing: list[str] = []
    if "probe" in drawn:
        sections.append(("probe", "The residual-stream probe", [figure("probe")]))
    else:
        missing.append("the residual-stream probe (run with --probe trajectory)")
    for kind, title, absent in (
        ("lens", "Logit lens over iterations (one example)", "the logit lens"),
        ("attention", "Attention across iterations (one example)", "attention across iterations"),
    ):
        present = [index for index in range(len(records)) if f"{kind}_{index}" in drawn]
        if not present:
            missing.append(f"{absent} (written by dcp-lens run, which holds the model)")
            continue
        parts = [figure(f"{kind}_{index}") for index in present]
        parts += [
            f"<p class='note'>{escape(_run_title(run))}: no {absent} recorded.</p>"
            for index, run in enumerate(records)
            if index not in present
        ]
        sections.append((kind, title, parts))
    if "by_hops" in drawn:
        sections.append(("hops", "By hop count", [figure("by_hops"), _hops_table(records, extras)]))
    else:
        missing.append("results by hop count (the task records none)")
    sections.append(("null-controls", "Null controls", [_null_control_table(records)]))
    sections.append(
        (
            "configuration",
            "Configuration, seed, versions",
            [_configuration_html(records, report_data)],
        )
    )
    contents = " &middot; ".join(
        f"<a href='#{key}'>{escape(title)}</a>" for key, title, _ in sections
    )
    answer = ["<div class='runs'>", *(answer_html(run) for run in records), "</div>"]
    if "answer" in drawn:
        answer.append(figure("answer"))
    body = [
        "<h1>Depth Control Protocol report</h1>",
        "<section id='answer'>",
        *answer,
        "</section>",
        f"<p class='contents'>{contents}</p>",
        _command_html(report_data),
    ]
    if missing:
        body.append(f"<p class='note'>Not in these results: {escape('; '.join(missing))}.</p>")
    for key, title, parts in sections:
        body.append(f"<h2 id='{key}'>{escape(title)}</h2>")
        body += parts
    title = " vs ".join(str(run["model"]) for run in records)
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>DCP report: {escape(title)}</title><style>{_STYLE}</style>"
        f"{plotly_script(plotly_src)}</head>"
        f"<body>{''.join(body)}</body></html>\n"
    )


REPORT_SUFFIXES = (".html", ".htm")


def write_report(
    runs: Sequence[ProtocolResults | Mapping[str, Any]],
    path: str | Path,
    report_data: Mapping[str, Any] | None = None,
) -> Path:
    """Write `render_report` to ``path`` and its copy of plotly.js (`dcp_lens.report.assets`),
    written first. ``path`` is a folder (one that exists, or a name without a suffix): the
    report is ``report.html`` in it, beside the folder's one ``plotly.min.js``, which every report
    of the folder shares. Or ``path`` is a file ending in .html: plotly.js goes into the folder
    ``<name>_files/`` beside it, which the report owns, so that no other file beside the report
    is touched. Returns the report's path."""
    path = Path(path)
    if path.is_dir() or not path.suffix:
        path.mkdir(parents=True, exist_ok=True)
        write_plotly_js(path)
        return write_text_atomically(
            path / REPORT_FILE, render_report(runs, report_data, PLOTLY_JS)
        )
    if path.suffix.lower() not in REPORT_SUFFIXES:
        raise ConfigError(
            f"a report is written to a .html file or to a folder, got {str(path)!r}; name a file "
            "ending in .html (or a folder, which then holds report.html)"
        )
    assets = asset_folder(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_plotly_js(assets)
    src = f"{assets.name}/{PLOTLY_JS}"
    return write_text_atomically(path, render_report(runs, report_data, src))


def _extras(
    records: Sequence[Mapping[str, Any]], report_data: Mapping[str, Any] | None
) -> list[dict[str, Any]]:
    by_model = (report_data or {}).get("runs", {})
    entries = [by_model.get(run["model"]) or {} for run in records]
    # Only parts that are there: a null in report_data.json reads back as NaN.
    return [{key: value for key, value in e.items() if isinstance(value, dict)} for e in entries]


def _hops_table(records: Sequence[Mapping[str, Any]], extras: Sequence[Mapping[str, Any]]) -> str:
    rows = []
    for run, extra in zip(records, extras, strict=True):
        for group in (extra.get("by_hops") or {}).get("groups", []):
            cells = [run["model"], str(group["hops"]), str(group["n_answers"])]
            cells += [_interval_text(group["shares"], factor) for factor in FACTORS]
            cells.append(_number(group["full"]))
            rows.append("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in cells) + "</tr>")
    head = "".join(
        f"<th>{name}</th>"
        for name in ("model", "hops", "answers", "S share", "B share", "D share", "full accuracy")
    )
    return (
        f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"
        "<p class='note'>DCP on the answers of each hop count alone (accuracy; intervals "
        "resample answers, so answers of one example count as independent).</p>"
    )


def _null_control_table(records: Sequence[Mapping[str, Any]]) -> str:
    """The null controls at k = r as a table: one check per row, what it must satisfy, and per
    run the measured value with a pass or fail mark."""
    checks = list(dict.fromkeys(check for run in records for check in _null_checks(run)))
    head = "<th>check at k = r</th><th>passes when</th>" + "".join(
        f"<th>{escape(run['model'])}</th>" for run in records
    )
    cells = [_null_checks(run) for run in records]
    rows = []
    for check in checks:
        row = "".join(
            f"<td>{per_run[check] if check in per_run else 'not recorded'}</td>"
            for per_run in cells
        )
        rows.append(f"<tr><td>{escape(check[0])}</td><td>{escape(check[1])}</td>{row}</tr>")
    spread = ", ".join(
        f"{_readable(run['null_control'].get(_HALVES_LOGITS, math.nan))} ({escape(run['model'])})"
        for run in records
    )
    return (
        f"<table class='null-controls'><thead><tr>{head}</tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
        "<p class='note'>At k = r every intervention must reproduce full depth: truncate and "
        "replay exactly, maps fitted from full depth onto itself up to float error. The "
        "calibration null fits the same kind of map between two disjoint halves of the "
        "calibration split: it must leave full depth's quality about where it is (its largest "
        f"change of a single logit, {spread}, is not a check: one map fitted on half the data "
        "moves individual logits).</p>"
    )


NullCheck = tuple[str, str]  # (what is checked, when it passes)
APPROXIMATE_TOLERANCE = 1e-3  # max |logit diff| of a map that is the identity up to float error
IDENTITY_TOLERANCE = 1e-4  # max |A - I| and max |b| of calibrate(full), fitted onto itself
HALVES_SHARE = 0.1  # the calibration null may move quality by this share of the largest gap
_HALVES_LOGITS = "calibrate_full_halves_max_abs_logit_diff"


def _null_checks(run: Mapping[str, Any]) -> dict[NullCheck, str]:
    """Each null control of one run: its check, and the measured value with its mark (HTML)."""
    null = run["null_control"]
    exact = f"max |logit diff| ≤ {NULL_TOLERANCE:g} (exact but for float error)"
    approximate = f"max |logit diff| ≤ {APPROXIMATE_TOLERANCE:g} (a fitted map's float error)"
    checks: dict[NullCheck, str] = {}
    for key, value in null.items():
        if key == "max_abs_logit_diff":
            check = ("truncate(r) and replay(r) reproduce full depth", exact)
            checks[check] = _within(value, NULL_TOLERANCE)
        elif key == "calibrate_full_identity_deviation" and isinstance(value, Mapping):
            check = (
                "calibrate(full), fitted onto itself, is the identity map",
                f"max |A - I| and max |b| ≤ {IDENTITY_TOLERANCE:g}",
            )
            parts = ", ".join(f"{escape(str(name))} {_readable(v)}" for name, v in value.items())
            checks[check] = _marked_text(
                parts, _all_finite(value.values()), max(value.values()) <= IDENTITY_TOLERANCE
            )
        elif key == "calibrate_full_halves_metric_change" and isinstance(value, Mapping):
            for metric, change in value.items():
                largest = max(
                    (abs(row["gap"]) for row in _below_r(run, metric) if math.isfinite(row["gap"])),
                    default=math.nan,
                )
                check = (
                    f"calibration null ({metric}): change of full depth's quality under a map "
                    "fitted between two halves of the calibration split",
                    f"|change| ≤ {HALVES_SHARE:g} × the largest |gap| over k < r",
                )
                bound = HALVES_SHARE * largest
                text = f"{_readable(change)} (bound {_readable(bound)})"
                passed = _all_finite([change, bound]) and bound > 0 and abs(change) <= bound
                checks[check] = _marked_text(text, _all_finite([change, bound]), passed)
        elif key.endswith("max_abs_logit_diff") and key != _HALVES_LOGITS:
            name = {"calibrate_full_max_abs_logit_diff": "calibrate(full)"}.get(
                key, key.removesuffix("_at_r_max_abs_logit_diff") + "(r)"
            )
            check = (f"{name} reproduces full depth", approximate)
            checks[check] = _within(value, APPROXIMATE_TOLERANCE)
        elif key != _HALVES_LOGITS:
            text = _readable(value) if isinstance(value, float | int) else escape(str(value))
            checks[(key, "no criterion")] = f"{text} <span class='mark'>-</span>"
    return checks


def _within(value: object, tolerance: float) -> str:
    """``value`` with a pass mark when it is at most ``tolerance``."""
    finite = _all_finite([value])
    passed = finite and isinstance(value, float | int) and value <= tolerance
    return _marked_text(_readable(value), finite, passed)


def _marked_text(text: str, measured: bool, passed: bool) -> str:
    """``text`` (HTML) with its mark: pass, fail, or not measured (NaN: not run)."""
    if not measured:
        return f"{text} <span class='mark'>not measured</span>"
    if passed:
        return f"{text} <span class='mark pass'>&#10003; pass</span>"
    return f"{text} <span class='mark fail'>&#10007; fail</span>"


def _all_finite(values: Iterable[object]) -> bool:
    return all(
        isinstance(v, float | int) and not isinstance(v, bool) and math.isfinite(v) for v in values
    )


def _readable(value: object) -> str:
    """A number as a reader reads it (HTML): three significant digits, a small one as
    m x 10^e; NaN and non-numbers as n/a."""
    if isinstance(value, bool) or not isinstance(value, float | int) or not math.isfinite(value):
        return "n/a"
    if value == 0:
        return "0"
    if abs(value) >= 1e-3:
        return f"{value:.3g}"
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa} &times; 10<sup>{int(exponent)}</sup>"


def _configuration_html(
    records: Sequence[Mapping[str, Any]], report_data: Mapping[str, Any]
) -> str:
    """Per run, its settings as a table of one setting per row (nested settings such as the
    protocol's config flattened to ``config / name``), then the versions."""
    parts = ["<div class='runs'>"]
    for run in records:
        settings = {**run.get("metadata", {})}
        for metric, record in run.get("metrics", {}).items():
            settings[f"{metric}: n_bootstrap, confidence"] = (
                f"{record.get('n_bootstrap')}, {record.get('confidence')}"
            )
        parts.append(f"<div class='run'><h3>{escape(_run_title(run))}</h3>{_dl(settings)}</div>")
    parts.append("</div>")
    environment = report_data.get("environment") or _current_environment()
    parts.append(f"<h3>Versions</h3>{_dl(environment)}")
    return "".join(parts)


def _command_html(report_data: Mapping[str, Any]) -> str:
    command = report_data.get("command")
    if not isinstance(command, str) or not command:
        return "<p class='note'>Written from Python (no command line recorded).</p>"
    return f"<p>Reproduce with: <code>{escape(command)}</code></p>"


def _current_environment() -> dict[str, str | None]:
    from dcp_lens.utils.environment import environment

    return environment()


def _dl(items: Mapping[str, object]) -> str:
    """A table of settings, one per row: a nested mapping becomes one row per entry under its
    key (``config / seed``), a list its items joined by commas, an empty one "none"."""
    rows = "".join(
        f"<tr><th>{escape(key)}</th><td>{escape(value)}</td></tr>" for key, value in _flatten(items)
    )
    return f"<table class='settings'>{rows}</table>"


def _flatten(items: Mapping[str, object], prefix: str = "") -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for key, value in items.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            rows += _flatten(value, f"{name} / ")
        else:
            rows.append((name, _setting_text(value)))
    return rows


def _setting_text(value: object) -> str:
    """One setting as plain text: lists joined by commas, mappings as ``key: value`` pairs,
    numbers as they are, nothing as "none"."""
    if value is None or (isinstance(value, list | tuple | Mapping) and not value):
        return "none"
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    if isinstance(value, list | tuple):
        return ", ".join(_setting_text(item) for item in value)
    if isinstance(value, Mapping):
        return "; ".join(f"{key}: {_setting_text(item)}" for key, item in value.items())
    return str(value)


def _run_title(run: Mapping[str, Any]) -> str:
    return f"{run['model']} ({run['architecture']}, r = {run['n_iterations']})"


def _interval_text(values: Mapping[str, Any], name: str) -> str:
    value = values.get(name, math.nan)
    low, high = values.get(f"{name}_lo", math.nan), values.get(f"{name}_hi", math.nan)
    return f"{_number(value)} [{_number(low)}, {_number(high)}]"


def _gap_text(run: Mapping[str, Any], metric: str) -> str:
    """The mean gap over k in the metric's units and the metric at full depth and at the
    smallest k (a loss gap is the rise in loss)."""
    gaps = [row["gap"] for row in run["decomposition"] if row["metric"] == metric]
    curves = [row for row in run["curves"] if row["metric"] == metric]
    full = next((row["value"] for row in curves if row["condition"] == "full"), math.nan)
    truncated = sorted(
        (row for row in curves if row["condition"] == "truncate"), key=lambda row: row["k"]
    )
    first = f"; k = {truncated[0]['k']}: {_number(truncated[0]['value'])}" if truncated else ""
    return escape(f"{_number(_mean(gaps))} (full: {_number(full)}{first})")


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em auto; padding: 0 1em; max-width: 1400px;
  color: #222; box-sizing: border-box; }
.figure { max-width: 100%; overflow-x: auto; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ccc; padding-top: 0.6em; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
thead th { background: #f3f3f3; }
.runs { display: flex; flex-wrap: wrap; gap: 1.5em; }
.runs > div { flex: 1 1 520px; min-width: 0; }
.verdicts { padding-left: 1.2em; font-size: 0.92em; }
.flag { color: #a33; } .note { color: #666; font-size: 0.85em; }
.mark { color: #666; white-space: nowrap; } .mark.pass { color: #2a7a2a; }
.mark.fail { color: #a33; font-weight: bold; }
code { background: #f3f3f3; padding: 0.1em 0.3em; }
.contents { font-size: 0.92em; }
#answer h3 { margin: 0.3em 0 0.1em; } #answer .verdicts { font-size: 1em; margin: 0.2em 0; }
details.unvalidated { margin: 0.6em 0; } details.unvalidated summary { cursor: pointer; }
table.settings th { font-weight: normal; color: #444; }
"""
