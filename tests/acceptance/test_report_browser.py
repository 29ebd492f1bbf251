"""Acceptance: `dcp-lens run` writes report.html beside results.json and the CSVs, `dcp-lens
report` re-renders it from the folder alone, and headless Chromium with the network cut off draws
every figure from the folder's one plotly.min.js with no console message (a screenshot is saved in
the test's tmp folder)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dcp_lens.cli import main
from dcp_lens.protocol.metrics import METRICS
from dcp_lens.report.assets import PLOTLY_JS, plotly_js

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists()
                                        else None)  # fmt: skip
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
        ["run", "--out", str(out), "--n-eval", "64", "--n-calibration", "64",
         "--bootstrap", "50", "--quiet"]
    )  # fmt: skip
    assert code == 0
    return out


def test_run_writes_the_report_beside_results_and_tables(default_run) -> None:
    for name in ("report.html", "results.json", "report_data.json"):
        assert (default_run / name).is_file(), name
    for folder in ("default", "default-dense"):
        for name in ("results.json", "decomposition.csv", "curves.csv", "shares.csv",
                     "report_data.json"):  # fmt: skip
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
    assert main(["report", str(default_run), "--out", str(again)]) == 0
    assert again.read_text() == (default_run / "report.html").read_text()
    assert (tmp_path / PLOTLY_JS).read_text() == plotly_js()  # its own folder's copy


def test_reports_of_a_folder_share_one_plotly_js_and_stay_small(default_run, tmp_path) -> None:
    report = default_run / "report.html"
    assert report.stat().st_size < 1_000_000, report.stat().st_size  # inlined: about 5 MB
    assert (default_run / PLOTLY_JS).read_text() == plotly_js()
    assert [p.name for p in default_run.glob("*.js")] == [PLOTLY_JS]
    folder = tmp_path / "copy"
    shutil.copytree(default_run, folder)
    written = (folder / PLOTLY_JS).stat().st_mtime_ns
    assert main(["report", str(folder)]) == 0  # an identical copy is reused, not rewritten
    assert (folder / PLOTLY_JS).stat().st_mtime_ns == written
    (folder / PLOTLY_JS).write_text("// another plotly version")
    assert main(["report", str(folder), "--out", str(folder / "second.html")]) == 0
    assert (folder / PLOTLY_JS).read_text() == plotly_js()  # replaced by the installed one
    assert sorted(p.name for p in folder.glob("*.js")) == [PLOTLY_JS]


def test_run_on_a_planted_model_writes_a_report_without_hop_counts(tmp_path) -> None:
    out = tmp_path / "out"
    code = main(
        ["run", "--model", "planted:readout_shift", "--n-eval", "64", "--n-calibration", "64",
         "--bootstrap", "50", "--quiet", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    tables = [f"planted_readout_shift/{name}.csv" for name in ("decomposition", "curves", "shares")]
    for name in ("report.html", "results.json", *tables):
        assert (out / name).is_file(), name
    html = (out / "report.html").read_text()
    assert "record no hop counts" in html and 'id="figure-lens_0"' in html
    assert "readout shift" in html  # the verdict names the planted factor
    assert main(["report", str(out / "planted_readout_shift")]) == 0  # a run's own folder too
    assert 'id="figure-lens_0"' in (out / "planted_readout_shift" / "report.html").read_text()


def test_report_of_a_folder_without_results_fails_with_a_message(tmp_path, capsys) -> None:
    assert main(["report", str(tmp_path)]) == 2
    assert "results.json does not exist" in capsys.readouterr().err


def chromium(report: Path, profiles: Path, *flags: str) -> tuple[str, list[str]]:
    """Open ``report`` from disk (file://) in headless Chromium with the network cut off.
    Returns what it printed (``--dump-dom``: the page) and the page's console messages."""
    assert CHROMIUM is not None
    profile = profiles / f"profile{len(list(profiles.iterdir()))}"
    done = subprocess.run(
        [CHROMIUM, *OFFLINE_FLAGS, f"--user-data-dir={profile}", "--enable-logging=stderr",
         "--v=0", *flags, report.as_uri()],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
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
    expected = re.findall(r'id="figure-([\w-]+)"', html)
    metrics = METRICS
    assert set(expected) == {
        *(f"{kind}_{metric}" for kind in ("quality", "decomposition") for metric in metrics),
        "probe", "by_hops", "lens_0", "lens_1", "attention_0", "attention_1",
    }  # fmt: skip

    dom, console = chromium(report, tmp_path, "--virtual-time-budget=5000", "--dump-dom")
    assert console == [], console
    assert '<p class="flag">The figures need' not in dom  # plotly.min.js loaded
    starts = [(m.start(), m.group(1)) for m in re.finditer(r'id="figure-([\w-]+)"', dom)]
    assert sorted(name for _, name in starts) == sorted(expected)
    for (start, name), (end, _) in zip(starts, [*starts[1:], (len(dom), "")], strict=True):
        assert 'class="main-svg"' in dom[start:end], f"figure {name} was not drawn"
    screenshot = tmp_path / "report.png"
    chromium(report, tmp_path, f"--screenshot={screenshot}", "--window-size=1200,1600",
             "--virtual-time-budget=5000")  # fmt: skip
    assert screenshot.stat().st_size > 10_000


@needs_chromium
def test_chromium_reports_a_missing_plotly_js(default_run, tmp_path) -> None:
    """The check above can fail: without plotly.min.js beside it the same report draws nothing,
    logs console errors and tells the reader which file is missing."""
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(default_run / "report.html", alone / "report.html")
    dom, console = chromium(alone / "report.html", tmp_path, "--virtual-time-budget=5000",
                            "--dump-dom")  # fmt: skip
    assert console and all("Plotly is not defined" in line for line in console), console
    assert 'class="main-svg"' not in dom
    assert f'<p class="flag">The figures need {PLOTLY_JS}, which did not load' in dom
