"""The report stage: renders what a run saved (results.json, report_data.json) as HTML, figures
and console text. It never runs a model or recomputes the science.

``from dcp_lens.report.html import write_report`` (imported on first access).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    name: "dcp_lens.report.html"
    for name in (
        "explain_verdict",
        "format_accuracy_table",
        "format_markdown",
        "headline_html",
        "render_report",
        "report_figures",
        "write_report",
    )
}
_EXPORTS.update(
    {name: "dcp_lens.report.console" for name in ("format_summaries", "format_summary")}
)
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
