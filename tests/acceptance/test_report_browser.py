"""Acceptance: `dcp-lens run` writes report.html beside results.json and the CSVs, `dcp-lens
report` re-renders it from the folder alone, and headless Chromium with the network cut off draws
every figure from the folder's one plotly.min.js with no console message (a screenshot is saved in
the test's tmp folder). A report of a results.json whose every string is hostile (metric,
condition, model spec, architecture, metadata keys and values, tokens, the command) renders as
text: Chromium's DOM holds no injected element, attribute or script."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from dcp_lens.cli import main
from dcp_lens.protocol.metrics import METRICS
from dcp_lens.report.assets import PLOTLY_JS, plotly_js

CHROMIUM = shutil.which("chromium") or (
    "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None
)
OFFLINE_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9",
]  # fmt: skip


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> Path:
    """The bundled default pair (recurrent and dense) with small n: lens, attention, hops."""
    out = tmp_path_factory.mktemp("run") / "out"
    code = main(
        [
            "run",
            "--out",
            str(out),
            "--n-eval",
            "64",
            "--n-calibration",
            "64",
            "--bootstrap",
            "50",
            "--quiet",
        ]
    )
    assert code == 0
    return out


def test_run_writes_the_report_beside_results_and_tables(default_run) -> None:
    for name in ("report.html", "results.json", "report_data.json"):
        assert (default_run / name).is_file(), name
    for folder in ("default", "default-dense"):
        for name in (
            "results.json",
            "decomposition.csv",
            "curves.csv",
            "shares.csv",
            "report_data.json",
        ):
            assert (default_run / folder / name).is_file(), f"{folder}/{name}"
    data = json.loads((default_run / "report_data.json").read_text())
    assert data["command"].startswith("dcp-lens run --out")
    recurrent = data["runs"][0]
    r = json.loads((default_run / "results.json").read_text())["runs"][0]["n_iterations"]
    assert len(recurrent["lens"]["top_probs"]) == r + 1  # s_0 .. s_r
    assert len(recurrent["attention"]["patterns"]) == r
    assert [group["hops"] for group in recurrent["by_hops"]["groups"]] == [1, 2, 3, 4]


def test_report_rerenders_a_finished_run_without_the_model(default_run, tmp_path) -> None:
    again = tmp_path / "again.html"
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["report", str(default_run), "--out", str(again)]) == 0
    rerendered = (
        (default_run / "report.html").read_text().replace(PLOTLY_JS, f"again_files/{PLOTLY_JS}")
    )
    assert again.read_text() == rerendered
    # A report written to a file keeps plotly.js in the folder it owns, nothing else beside it.
    assert (tmp_path / "again_files" / PLOTLY_JS).read_text() == plotly_js()
    assert not (tmp_path / PLOTLY_JS).exists() and (tmp_path / "notes.txt").read_text() == "mine"


def test_a_report_file_refuses_an_asset_folder_holding_other_files(default_run, tmp_path, capsys):
    (tmp_path / "r_files").mkdir()
    (tmp_path / "r_files" / "mine.png").write_bytes(b"png")
    assert main(["report", str(default_run), "--out", str(tmp_path / "r.html")]) != 0
    assert "holds files a report did not write (mine.png)" in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()
    assert [p.name for p in (tmp_path / "r_files").iterdir()] == ["mine.png"]


def test_reports_of_a_folder_share_one_plotly_js_and_stay_small(
    default_run, tmp_path, capsys
) -> None:
    report = default_run / "report.html"
    assert report.stat().st_size < 1_000_000, report.stat().st_size  # inlined: about 5 MB
    assert (default_run / PLOTLY_JS).read_text() == plotly_js()
    assert [p.name for p in default_run.glob("*.js")] == [PLOTLY_JS]
    folder = tmp_path / "copy"
    shutil.copytree(default_run, folder)
    written = (folder / PLOTLY_JS).stat().st_mtime_ns
    assert main(["report", str(folder)]) == 0  # an identical copy is reused, not rewritten
    assert (folder / PLOTLY_JS).stat().st_mtime_ns == written
    # A plotly.js changed since is the user's: refused and kept, never overwritten.
    (folder / PLOTLY_JS).write_text("// another plotly version")
    assert main(["report", str(folder)]) != 0
    assert PLOTLY_JS in capsys.readouterr().err
    assert (folder / PLOTLY_JS).read_text() == "// another plotly version"
    (folder / PLOTLY_JS).unlink()  # moved away: the installed one is written again
    assert main(["report", str(folder)]) == 0
    assert (folder / PLOTLY_JS).read_text() == plotly_js()
    assert sorted(p.name for p in folder.glob("*.js")) == [PLOTLY_JS]


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory) -> Path:
    """`dcp-lens run` on planted:readout_shift with small n: its answer is known (S)."""
    out = tmp_path_factory.mktemp("planted") / "out"
    code = main(
        [
            "run",
            "--model",
            "planted:readout_shift",
            "--n-eval",
            "64",
            "--n-calibration",
            "64",
            "--bootstrap",
            "50",
            "--quiet",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    return out


def test_run_on_a_planted_model_writes_a_report_without_hop_counts(planted_run) -> None:
    out = planted_run
    tables = [f"planted_readout_shift/{name}.csv" for name in ("decomposition", "curves", "shares")]
    for name in ("report.html", "results.json", *tables):
        assert (out / name).is_file(), name
    html = (out / "report.html").read_text()
    assert "id='figure-lens_0'" in html
    assert "readout shift" in html  # the verdict names the planted factor
    # No empty section: hop counts are named as absent in one line, with no heading of their own.
    assert "results by hop count (the task records none)" in html
    assert "id='hops'" not in html and "By hop count" not in html
    assert main(["report", str(out / "planted_readout_shift")]) == 0  # a run's own folder too
    assert "id='figure-lens_0'" in (out / "planted_readout_shift" / "report.html").read_text()


def test_the_report_opens_with_the_answer(planted_run) -> None:
    """One sentence per validated metric, then S, B, D per k, before anything else; the metrics
    not validated folded away; verdict text rendered (no backticks), sentences capitalised and
    no path into a clone's docs/ folder."""
    html = (planted_run / "report.html").read_text()
    answer = html.split("<section id='answer'>", 1)[1].split("</section>", 1)[0]
    assert html.index("<section id='answer'>") < html.index("<p class='contents'>")
    assert "<b>accuracy</b>: At least" in answer and "<b>top1_agreement</b>: At least" in answer
    assert "readout shift" in answer and "cross_entropy" not in answer
    assert "id='figure-answer'" in answer
    folded = html.split("<details class='unvalidated'>", 1)[1].split("</details>", 1)[0]
    assert "cross_entropy" in folded and "kl_to_full" in folded
    text = re.sub(r"<script.*?</script>", "", html, flags=re.S)
    text = re.sub(r"<[^>]+>", " ", re.sub(r"<code>.*?</code>", "", text))
    assert "`" not in text
    assert "docs/" not in text
    assert not re.search(r"[.!?] [a-z]", text), re.findall(r".{40}[.!?] [a-z].{20}", text)


def test_report_of_a_folder_without_results_fails_with_a_message(tmp_path, capsys) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert "results.json does not exist" in capsys.readouterr().err


def chromium(report: Path, profiles: Path, *flags: str) -> tuple[str, list[str]]:
    """Open ``report`` from disk (file://) in headless Chromium with the network cut off.
    Returns what it printed (``--dump-dom``: the page) and the page's console messages."""
    assert CHROMIUM is not None
    profile = profiles / f"profile{len(list(profiles.iterdir()))}"
    done = subprocess.run(
        [
            CHROMIUM,
            *OFFLINE_FLAGS,
            f"--user-data-dir={profile}",
            "--enable-logging=stderr",
            "--v=0",
            *flags,
            report.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    # Chromium logs each console message as `...:CONSOLE:LINE] "message", source: URL (LINE)`.
    console = [line for line in done.stderr.splitlines() if re.search(r":CONSOLE[:(]", line)]
    return done.stdout, console


needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)"
)


@needs_chromium
def test_chromium_draws_every_figure_offline(default_run, tmp_path) -> None:
    report = default_run / "report.html"
    html = report.read_text()
    expected = re.findall(r"id='figure-([\w-]+)'", html)
    metrics = METRICS
    assert set(expected) == {
        *(f"{kind}_{metric}" for kind in ("quality", "decomposition") for metric in metrics),
        "answer",
        "probe",
        "by_hops",
        "lens_0",
        "lens_1",
        "attention_0",
        "attention_1",
    }

    dom, console = chromium(report, tmp_path, "--virtual-time-budget=5000", "--dump-dom")
    assert console == [], console
    assert '<p class="flag">The figures need' not in dom  # plotly.min.js loaded
    starts = [(m.start(), m.group(1)) for m in re.finditer(r'id="figure-([\w-]+)"', dom)]
    assert sorted(name for _, name in starts) == sorted(expected)
    data = json.loads((default_run / "report_data.json").read_text())
    for (start, name), (end, _) in zip(starts, [*starts[1:], (len(dom), "")], strict=True):
        assert 'class="main-svg"' in dom[start:end], f"figure {name} was not drawn"
        if name.startswith("lens_"):  # one readable row per iteration s_0 .. s_r
            rows = len(data["runs"][int(name[5:])]["lens"]["iterations"])
            plot = re.search(r'<rect class="nsewdrag drag"[^>]*\bheight="([\d.]+)"', dom[start:end])
            assert plot is not None and float(plot.group(1)) / rows >= 30, (name, plot)
    screenshot = tmp_path / "report.png"
    chromium(
        report,
        tmp_path,
        f"--screenshot={screenshot}",
        "--window-size=1200,1600",
        "--virtual-time-budget=5000",
    )
    assert screenshot.stat().st_size > 10_000


@needs_chromium
def test_chromium_reports_a_missing_plotly_js(default_run, tmp_path) -> None:
    """The check above can fail: without plotly.min.js beside it the same report draws nothing,
    logs console errors and tells the reader which file is missing."""
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(default_run / "report.html", alone / "report.html")
    dom, console = chromium(
        alone / "report.html", tmp_path, "--virtual-time-budget=5000", "--dump-dom"
    )
    assert console and all("Plotly is not defined" in line for line in console), console
    assert 'class="main-svg"' not in dom
    assert f'<p class="flag">The figures need {PLOTLY_JS}, which did not load' in dom


# Each hostile string tries every context of the page: closing an attribute or a tag, opening an
# element with a handler, closing the figure's <script> and opening another, opening a comment,
# and a plotly hover-template placeholder. Each carries its own marker, so that a failure names
# the field it came through.
def hostile(marker: str) -> str:
    return (
        f"{marker}'\"><img src=x class=pwned onerror=\"document.title='pwned {marker}'\">"
        f"</script><script class=pwned>document.title='pwned {marker}'</script><!-- %{{x}} &amp;"
    )


def _rename(value: Any, names: dict[str, str]) -> Any:
    """``value`` with every string (dict keys included) found in ``names`` replaced."""
    if isinstance(value, dict):
        return {names.get(k, k): _rename(v, names) for k, v in value.items()}
    if isinstance(value, list):
        return [_rename(v, names) for v in value]
    if isinstance(value, str):
        return names.get(value, value)
    return value


def _hostile_folder(run_folder: Path, folder: Path) -> dict[str, str]:
    """A copy of the top of ``run_folder`` whose strings are all hostile: every metric and model
    spec renamed; a condition, a metadata key and value, a config entry, a null-control entry and
    a calibration-identity part added; and in report_data.json the command, the environment, the
    tokens and the attention layer. Returns the names replaced."""
    results = json.loads((run_folder / "results.json").read_text())
    data = json.loads((run_folder / "report_data.json").read_text())
    first = results["runs"][0]
    names = {metric: hostile(f"metric{i}") for i, metric in enumerate(first["shares"])}
    for i, run in enumerate(results["runs"]):
        names[run["model"]] = hostile(f"model{i}")
    results = _rename(results, names)
    for run in results["runs"]:  # a condition of another sweep, beside those the run needs
        run["curves"] += [
            {**row, "condition": hostile("condition")}
            for row in run["curves"]
            if row["condition"] == "calibrate_truncate"
        ]
        run["metadata"][hostile("metadata-key")] = hostile("metadata-value")
        run["metadata"]["config"][hostile("config-key")] = [hostile("config-item")]
        run["null_control"][hostile("null-key")] = hostile("null-value")
        run["null_control"]["calibrate_full_identity_deviation"][hostile("identity")] = 0.0
    data = _rename(data, names)
    data["command"] = hostile("command")
    data["environment"] = {hostile("env-key"): hostile("env-value")}
    for i, entry in enumerate(data["runs"]):
        lens, attention = entry["lens"], entry["attention"]
        lens["tokens"] = [hostile(f"token{i}")] + lens["tokens"][1:]
        lens["targets"] = [hostile(f"target{i}")] + lens["targets"][1:]
        lens["top_tokens"] = [[hostile(f"top{i}")] + row[1:] for row in lens["top_tokens"]]
        attention["tokens"] = [hostile(f"attention-token{i}")] + attention["tokens"][1:]
        attention["layer"] = hostile(f"layer{i}")
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps(results))
    (folder / "report_data.json").write_text(json.dumps(data))
    return names


class _Elements(HTMLParser):
    """Every element of a page: its tag and attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, dict(attrs)))


def _elements(html: str) -> list[tuple[str, dict[str, str | None]]]:
    parser = _Elements()
    parser.feed(html)
    return parser.elements


@needs_chromium
def test_hostile_strings_in_every_field_stay_text(default_run, tmp_path) -> None:
    folder = tmp_path / "hostile"
    names = _hostile_folder(default_run, folder)
    assert main(["report", str(folder)]) == 0
    report = folder / "report.html"
    html = report.read_text()
    written = _elements(html)
    figures = [attrs for tag, attrs in written if tag == "div" and "data-figure" in attrs]
    # plotly.min.js, the note if it is missing, one script per figure: nothing more.
    assert sum(tag == "script" for tag, _ in written) == 2 + len(figures)
    assert {attrs["data-figure"] for attrs in figures} >= {
        f"quality_{m}" for m in names.values() if "metric" in m
    }

    dom, console = chromium(report, tmp_path, "--virtual-time-budget=5000", "--dump-dom")
    assert console == [], console
    elements = _elements(dom)
    injected = [
        (tag, attrs)
        for tag, attrs in elements
        if tag == "img"
        or "pwned" in (attrs.get("class") or "")
        or any(name.startswith("on") for name in attrs)
    ]
    assert injected == [], injected[:3]
    title = dom.split("<title>", 1)[1].split("</title>", 1)[0]
    assert title.startswith("DCP report: model0"), title  # no script set it
    scripts = [attrs for tag, attrs in elements if tag == "script"]
    assert len(scripts) == 2 + len(figures), len(scripts)
    # Every figure drawn (its JSON still parses), and the names read as written.
    assert dom.count('class="main-svg"') >= len(figures)
    text = re.sub(r"<[^>]+>", "", dom)
    assert "metric0'\"&gt;&lt;img src=x class=pwned" in text.replace("&quot;", '"')


# Written into a copy of the report: the bottom edge of each element the first screen must show,
# read back from the page's title with --dump-dom.
_FIRST_SCREEN_PROBE = """<script>window.addEventListener('load', function () {
  setTimeout(function () {
    var answer = document.querySelector('#answer .verdicts');
    var figure = document.getElementById('figure-answer');
    document.title = 'bottoms ' + answer.getBoundingClientRect().bottom + ' '
      + figure.getBoundingClientRect().bottom + ' '
      + figure.querySelectorAll('.main-svg .bars .point').length;
  }, 1000);
});</script></body>"""


@needs_chromium
def test_chromium_first_screen_shows_the_verdict_and_the_figure(planted_run, tmp_path) -> None:
    """At 1400 x 900 the first screen holds the verdict sentences and the S, B, D figure, drawn
    (its bars are on the page) and whole (its bottom edge above the fold)."""
    probed = planted_run / "first_screen.html"
    probed.write_text(
        (planted_run / "report.html").read_text().replace("</body>", _FIRST_SCREEN_PROBE)
    )
    dom, console = chromium(
        probed, tmp_path, "--window-size=1400,900", "--virtual-time-budget=8000", "--dump-dom"
    )
    assert console == [], console
    title = dom.split("<title>", 1)[1].split("</title>", 1)[0]
    assert title.startswith("bottoms "), title
    answer_bottom, figure_bottom, bars = title.split()[1:]
    assert float(answer_bottom) < float(figure_bottom) <= 900, title
    assert int(bars) > 0, title
    screenshot = tmp_path / "first_screen.png"
    flags = ["--window-size=1400,900", "--hide-scrollbars", "--virtual-time-budget=5000"]
    chromium(planted_run / "report.html", tmp_path, f"--screenshot={screenshot}", *flags)
    assert screenshot.stat().st_size > 10_000
