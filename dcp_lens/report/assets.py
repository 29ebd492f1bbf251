"""The file a report loads from beside it: one copy of plotly.js per output folder.

Inlined, plotly.js (about 4.7 MB) made every report.html about 5 MB. Each report now references
``plotly.min.js`` in its own folder by a relative ``<script src>``, which a browser opening the
folder from disk (file://) loads with no network access; every report written to that folder
shares the one copy.
"""

from __future__ import annotations

from pathlib import Path

from dcp_lens.utils.files import write_text_atomically

PLOTLY_JS = "plotly.min.js"


def plotly_js() -> str:
    """The plotly.js bundled with the installed plotly package (the version its figures need)."""
    import plotly.offline

    return plotly.offline.get_plotlyjs()


def write_plotly_js(folder: str | Path) -> Path:
    """Write `PLOTLY_JS` into ``folder`` unless an identical copy is there already (another
    report of the folder wrote it); a copy from another plotly version is replaced. Returns its
    path."""
    path = Path(folder) / PLOTLY_JS
    text = plotly_js()
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return path
    return write_text_atomically(path, text)


def plotly_script(src: str | None) -> str:
    """The ``<script>`` that gives a report plotly.js: a reference to ``src`` (relative to the
    report), or plotly.js inlined when ``src`` is None (a page that must stand alone). A
    referenced copy that does not load leaves a note at the top of the page saying what to do."""
    if src is None:
        return f"<script type='text/javascript'>{plotly_js()}</script>"
    missing = (
        f"<p class='flag'>The figures need {src}, which did not load: keep it in the folder "
        "beside this report (dcp-lens report FOLDER writes it again).</p>"
    )
    return (
        f"<script type='text/javascript' src='{src}' charset='utf-8'></script>"
        "<script type='text/javascript'>if (typeof Plotly === 'undefined') {"
        "document.addEventListener('DOMContentLoaded', function () {"
        f"document.body.insertAdjacentHTML('afterbegin', {_js_string(missing)});}});}}</script>"
    )


def _js_string(text: str) -> str:
    """``text`` as a JavaScript string literal (it holds no backslash or newline)."""
    return "'" + text.replace("'", "\\'") + "'"
