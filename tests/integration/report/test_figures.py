"""How report.html shows what a run saved: the null controls as a table with a mark per check,
the full-depth line drawn over the curves, shares outside [0, 1] not called "most of"."""

from __future__ import annotations

import copy
import re
from html import unescape

import pytest

from dcp_lens import DepthControlProtocol, load
from dcp_lens.protocol.conditions import SWEEP
from dcp_lens.report.html import render_report, run_record, verdict
from dcp_lens.tasks import task_of


@pytest.fixture(scope="module")
def planted_run() -> dict:
    model = load("planted:readout_shift")
    protocol = DepthControlProtocol(model, n_bootstrap=20, probe="none", progress=False)
    task = task_of(model)
    return run_record(protocol.run(task.evaluation(64), task.calibration(64)))


def null_rows(html: str) -> list[list[str]]:
    """The null-control table's body rows as plain text cells."""
    table = html.split("<table class='null-controls'>", 1)[1].split("</table>", 1)[0]
    body = table.split("<tbody>", 1)[1]
    rows = re.findall(r"<tr>(.*?)</tr>", body)
    return [
        [unescape(re.sub(r"<[^>]+>", "", c)) for c in re.findall(r"<td>(.*?)</td>", row)]
        for row in rows
    ]


def test_null_controls_are_a_table_with_a_mark_per_check(planted_run) -> None:
    rows = null_rows(render_report([planted_run]))
    checks = [row[0] for row in rows]
    assert checks[:4] == [
        "truncate(r) and replay(r) reproduce full depth",
        "calibrate(full) reproduces full depth",
        "shift(r) reproduces full depth",
        "calibrate(full), fitted onto itself, is the identity map",
    ]
    metrics = list(planted_run["null_control"]["calibrate_full_halves_metric_change"])
    halves = [check for check in checks[4:] if check.startswith("calibration null")]
    assert [check.split(")")[0] for check in halves] == [
        f"calibration null ({metric}" for metric in metrics
    ]
    for row in rows:  # check, criterion, one run's value with its mark
        assert len(row) == 3 and row[2].endswith("✓ pass"), row
        assert "{" not in row[2] and not re.search(r"\de[+-]\d", row[2]), row  # no JSON, no 1e-06


def test_a_failed_null_control_is_marked_failed(planted_run) -> None:
    broken = copy.deepcopy(planted_run)
    broken["null_control"]["max_abs_logit_diff"] = 2.78
    broken["null_control"]["calibrate_full_identity_deviation"]["offset"] = 0.5
    broken["null_control"]["shift_at_r_max_abs_logit_diff"] = float("nan")
    rows = {row[0]: row[2] for row in null_rows(render_report([broken, planted_run]))}
    assert rows["truncate(r) and replay(r) reproduce full depth"] == "2.78 ✗ fail"
    assert rows["calibrate(full), fitted onto itself, is the identity map"].endswith("✗ fail")
    assert rows["shift(r) reproduces full depth"] == "n/a not measured"


def test_full_depth_is_drawn_over_the_other_curves(planted_run) -> None:
    from dcp_lens.report.figures import quality_figure

    figure = quality_figure([planted_run, planted_run], "accuracy")
    for axis in ("x", "x2"):
        lines = [t for t in figure.data if t.mode == "lines+markers" and t.xaxis == axis]
        assert len(lines) == len(SWEEP) + 1 and lines[-1].name == "full", [t.name for t in lines]
        assert lines[-1].line.dash == "dash" and lines[-1].line.width > lines[0].line.width
    legend = sorted((t for t in figure.data if t.showlegend), key=lambda t: t.legendrank)
    assert legend[0].name == "full"  # still first in the legend


@pytest.mark.parametrize(
    ("share", "start"),
    [
        (0.7, "At least 70% of the truncation gap"),
        (0.9, "At least 90% of the truncation gap"),
        (1.71, "More than the whole truncation gap (at least 171%; the other factors sum below"),
    ],
)
def test_a_share_above_one_is_not_called_most_of_the_gap(planted_run, share, start) -> None:
    run = copy.deepcopy(planted_run)
    run["shares"]["accuracy"].update(S=share, B=(1 - share) / 2, D=(1 - share) / 2)
    run["bracket"]["accuracy"].update(verdict="S", S_lower_lo=share)
    text, _ = verdict(run, "accuracy")
    assert text.startswith(start), text


def test_hostile_names_stay_text_in_the_page(planted_run) -> None:
    """A metric, model and metadata key that try to close a tag, an attribute or the figure's
    script come out as text: the page has exactly its own elements and scripts (the browser
    test checks the same in Chromium's DOM)."""
    from html.parser import HTMLParser

    bad = "x'\"><img src=x onerror=alert(1)></script><script>alert(2)</script><!--"
    run = copy.deepcopy(planted_run)
    for key in ("shares", "share_intervals", "bracket", "metrics"):
        run[key] = {bad if m == "accuracy" else m: v for m, v in run[key].items()}
    for row in (*run["curves"], *run["decomposition"]):
        row["metric"] = bad if row["metric"] == "accuracy" else row["metric"]
    run["model"], run["metadata"][bad] = bad, bad

    class Tags(HTMLParser):
        tags: list[str] = []

        def handle_starttag(self, tag, attrs) -> None:
            self.tags.append(tag)

    parser = Tags()
    html = render_report([run], plotly_src="plotly.min.js")
    parser.feed(html)
    figures = html.count("class='figure'")
    assert "img" not in parser.tags
    assert parser.tags.count("script") == 2 + figures  # plotly.js, its note, one per figure
    assert "&lt;img src=x onerror=alert(1)&gt;&lt;/script&gt;" in html


def test_the_configuration_is_a_table_of_one_setting_per_row(planted_run) -> None:
    html = render_report([planted_run])
    table = html.split("<h2 id='configuration'>", 1)[1].split("<table class='settings'>", 1)[1]
    rows = dict(re.findall(r"<tr><th>(.*?)</th><td>(.*?)</td></tr>", table.split("</table>")[0]))
    config = planted_run["metadata"]["config"]
    assert rows["config / seed"] == str(config["seed"])
    assert rows["config / metrics"] == ", ".join(config["metrics"])
    assert rows["k_grid"] == ", ".join(str(k) for k in planted_run["metadata"]["k_grid"])
    assert not any(value.startswith(("{", "[")) for value in rows.values()), rows
