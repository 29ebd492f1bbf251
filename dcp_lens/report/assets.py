"""What a report loads and embeds: the one copy of plotly.js it shares, and each figure as a
``<div>`` plus a ``<script>`` that draws it, escaped so that no string of a results.json can
leave its context.

Inlined, plotly.js (about 4.7 MB) made every report.html about 5 MB. A report references
``plotly.min.js`` by a relative ``<script src>``, which a browser opening the report from disk
(file://) loads with no network access: beside the report in a run or report folder, where every
report of the folder shares the one copy, or in the folder ``<name>_files/`` that a report written
to a file of its own owns (`asset_folder`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from dcp_lens.utils.errors import ConfigError
from dcp_lens.utils.files import write_text_atomically
from dcp_lens.utils.folders import RESERVED

if TYPE_CHECKING:  # annotations only: plotly is imported when a figure is drawn
    import plotly.graph_objects as go

PLOTLY_JS = "plotly.min.js"
ASSETS_SUFFIX = "_files"
FIGURE_CONFIG = {"displaylogo": False, "responsive": True}


def plotly_js() -> str:
    """The plotly.js bundled with the installed plotly package (the version its figures need)."""
    import plotly.offline

    return plotly.offline.get_plotlyjs()


def write_plotly_js(folder: str | Path) -> Path:
    """Write `PLOTLY_JS` into ``folder`` (made if missing) unless an identical copy is there
    already (another report of the folder wrote it); a copy from another plotly version is
    replaced. Returns its path."""
    path = Path(folder) / PLOTLY_JS
    text = plotly_js()
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomically(path, text)


def asset_folder(report: str | Path) -> Path:
    """The folder that holds the assets of a report written to the file ``report``:
    ``<stem>_files`` beside it. Raises ConfigError, naming what is there, when that name is taken
    by a file or by a folder that holds anything but a report's assets."""
    report = Path(report)
    folder = report.with_name(report.stem + ASSETS_SUFFIX)
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise ConfigError(
            f"{report} keeps its plotly.js in {folder}, which is not a folder of its own "
            f"({'a link' if folder.is_symlink() else 'a file'}); move it away or name the report "
            "differently"
        )
    if folder.is_dir():
        foreign = sorted(p.name for p in folder.iterdir() if p.name not in (PLOTLY_JS, *RESERVED))
        if foreign:
            listed = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            raise ConfigError(
                f"{report} keeps its plotly.js in {folder}, which holds files a report did not "
                f"write ({listed}); move them away or name the report differently"
            )
    return folder


def plotly_script(src: str | None) -> str:
    """The ``<script>`` that gives a report plotly.js: a reference to ``src`` (a path relative to
    the report, URL-quoted here), or plotly.js inlined when ``src`` is None (a page that must
    stand alone). A referenced copy that does not load leaves a note at the top of the page
    saying what to do."""
    if src is None:
        return f"<script type='text/javascript'>{plotly_js()}</script>"
    missing = (
        f"<p class='flag'>The figures need {escape(src)}, which did not load: keep it beside "
        "this report (dcp-lens report FOLDER writes it again).</p>"
    )
    return (
        f"<script type='text/javascript' src='{escape(quote(src))}' charset='utf-8'></script>"
        "<script type='text/javascript'>if (typeof Plotly === 'undefined') {"
        "document.addEventListener('DOMContentLoaded', function () {"
        f"document.body.insertAdjacentHTML('afterbegin', {script_json(missing)});}});}}</script>"
    )


def script_json(value: object) -> str:
    """``value`` as JSON that is safe inside an HTML ``<script>`` (`script_safe`)."""
    return script_safe(json.dumps(value))


def script_safe(json_text: str) -> str:
    """JSON text made safe inside an HTML ``<script>``: ``<``, ``>`` and ``&`` as ``\\u``
    escapes, so that no ``</script>`` or ``<!--`` can form, and the line separators U+2028 and
    U+2029 escaped too. Those characters occur in JSON only inside strings, where JSON and
    JavaScript read the escapes back as the same characters."""
    for char, code in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        json_text = json_text.replace(char, code)
    return json_text


def figure_ids(names: Iterable[str]) -> dict[str, str]:
    """An HTML id per figure name: ``figure-<name>`` where the name is made of letters, digits,
    ``_`` and ``-`` only, else those characters of it and a hash of the whole name (a metric
    read from a results.json may hold anything)."""
    ids: dict[str, str] = {}
    for name in names:
        if re.fullmatch(r"[A-Za-z0-9_-]+", name):
            ids[name] = f"figure-{name}"
        else:
            digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:10]
            ids[name] = f"figure-{re.sub(r'[^A-Za-z0-9_-]+', '_', name)[:40]}-{digest}"
    return ids


def figure_html(figure: go.Figure, div_id: str, config: Mapping[str, bool] = FIGURE_CONFIG) -> str:
    """A plotly figure as a ``<div>`` and the ``<script>`` that draws it into the div (plotly.js
    loaded by the page), its JSON escaped by `script_safe`."""
    import plotly.io

    height = figure.layout.height
    style = f"height:{int(height)}px; width:100%;" if height else "width:100%;"
    payload = script_safe(plotly.io.to_json(figure, validate=False))
    return (
        f"<div id='{escape(div_id)}' class='plotly-graph-div' style='{style}'></div>"
        "<script type='text/javascript'>(function () {"
        f"var figure = {payload};"
        f"Plotly.newPlot({script_json(div_id)}, figure.data, figure.layout, "
        f"{script_json(dict(config))});}})();</script>"
    )
