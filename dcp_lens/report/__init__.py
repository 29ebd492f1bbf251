"""The report stage: renders what a run saved (results.json, report_data.json) as HTML, figures
and console text. It never runs a model or recomputes the science.

``from dcp_lens.report.html import write_report`` (imported on first access).
"""

from __future__ import annotations

_EXPORTS = {
    name: "html"
    for name in (
        "format_accuracy_table",
        "headline_html",
        "render_report",
        "report_figures",
        "write_report",
    )
}
_EXPORTS.update({name: "console" for name in ("format_summaries", "format_summary")})
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if _EXPORTS.get(name) == "html":
        from dcp_lens.report import html

        return getattr(html, name)
    if _EXPORTS.get(name) == "console":
        from dcp_lens.report import console

        return getattr(console, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
