"""report.html and the notebook face of results: figures, the headline, validity flags, a
self-contained page, task batches and a loaded model's task and spec."""

from __future__ import annotations

import copy
import re

import plotly.graph_objects as go
import plotly.offline
import pytest
import torch
from helpers import make_model

from dcp_lens import DepthControlProtocol, EvaluationSet, load
from dcp_lens.protocol.conditions import SWEEP
from dcp_lens.protocol.metrics import METRICS
from dcp_lens.protocol.results import ProtocolResults
from dcp_lens.protocol.wording import S_BRACKET_WIDE
from dcp_lens.report.assets import PLOTLY_JS
from dcp_lens.report.html import render_report, run_record, verdict
from dcp_lens.tasks import task_of


@pytest.fixture(scope="module")
def planted_results() -> ProtocolResults:
    model = load("planted:readout_shift")
    protocol = DepthControlProtocol(model, n_bootstrap=50, progress=False)
    return protocol.run(task_of(model).evaluation(64), task_of(model).calibration(64))


def test_a_loaded_model_names_its_results(planted_results) -> None:
    assert planted_results.model == "planted:readout_shift"


def test_figures_draw_every_condition_and_factor(planted_results) -> None:
    figures = planted_results.figures()
    assert set(figures) == {
        *(f"{kind}_{metric}" for kind in ("quality", "decomposition") for metric in METRICS),
        "probe",
        "answer",  # the first screen's S, B, D per k, of the first validated metric
    }
    first = next(m for m, d in planted_results.decompositions.items() if d.validated)
    answer = [trace.y for trace in figures["answer"].data]
    assert answer == [trace.y for trace in figures[f"decomposition_{first}"].data]
    assert all(isinstance(figure, go.Figure) for figure in figures.values())
    legend = [trace for trace in figures["quality_accuracy"].data if trace.showlegend]
    lines = {trace.legendgroup for trace in legend}
    # Every registered sweep condition, the S bracket's translators and base rate included.
    assert lines == {"full", *SWEEP}
    assert {"translate_truncate", "translate_replay", "base_rate"} <= lines
    # A curve drawn on top of another says so and is dotted with open markers, so both show.
    marked = [trace for trace in legend if " (on " in trace.name]
    assert marked and all(t.line.dash == "dot" and t.marker.symbol == "circle-open" for t in marked)
    assert all(" (on " not in t.name and t.line.dash != "dot" for t in legend if t not in marked)
    bars = [trace for trace in figures["decomposition_accuracy"].data if trace.type == "bar"]
    table = planted_results.table()
    accuracy = table[table["metric"] == "accuracy"]
    for bar, factor in zip(bars, ("S", "B", "D"), strict=True):
        assert list(bar.y) == pytest.approx(list(accuracy[factor]))


def test_the_headline_reads_the_planted_factor(planted_results) -> None:
    html = planted_results._repr_html_()
    assert "<script" not in html and "S share" in html
    text, flags = verdict(run_record(planted_results), "accuracy")
    # The bracket's verdict: S, named with its bracket.
    assert "of the truncation gap is readout shift" in text and "S bracket [" in text
    assert "readout shift" in text
    assert not any("lower bound" in flag or "not validated" in flag for flag in flags)


def test_validity_flags_are_shown_when_results_carry_them(planted_results) -> None:
    run = copy.deepcopy(run_record(planted_results))
    for row in run["decomposition"]:
        if row["metric"] == "accuracy" and row["k"] in (1, 2):
            row.update(S_identified=False, B_identified=False, residual_auroc=0.9)
    run["shares"]["accuracy"]["stable"] = False
    run["metrics"]["accuracy"].update(validated=False, reason="misses the planted B factor")
    _, flags = verdict(run, "accuracy")
    # Rows that carry the S bracket say why S is not identified in its words.
    assert f"{S_BRACKET_WIDE} at k = 1, 2" in flags
    assert "B not identified at k = 1, 2" in flags
    assert any(flag.startswith("unstable share") for flag in flags)
    assert "metric not validated: misses the planted B factor" in flags
    html = render_report([run])
    assert "Metric not validated: misses the planted B factor" in html  # a sentence, capitalised


def test_the_report_loads_only_the_plotly_js_beside_it(planted_results, tmp_path) -> None:
    path = planted_results.report(tmp_path / "fresh")  # a new folder: the report's own
    html = path.read_text()
    assert path.name == "report.html"
    assert re.findall(r"<script[^>]*\bsrc='([^']*)'", html) == [PLOTLY_JS]  # relative: offline
    shared = (tmp_path / "fresh" / PLOTLY_JS).read_text()
    assert shared == plotly.offline.get_plotlyjs()  # the installed plotly's own bundle
    assert shared[:2000] not in html and len(html.encode()) < 1_000_000
    assert render_report([planted_results]).count(shared[:2000]) == 1  # standalone: inlined once
    for name in planted_results.figures():
        assert f"id='figure-{name}'" in html
    # Sections with nothing to show are named once, not drawn empty.
    assert "Not in these results: the logit lens" in html and "id='lens'" not in html
    assert "results by hop count (the task records none)" in html and "id='hops'" not in html


def test_the_protocol_takes_task_batches_and_a_bundled_models_task() -> None:
    model = load("default")
    protocol = DepthControlProtocol(
        model, k_grid=[1, 4], n_bootstrap=0, probe="none", progress=False
    )
    results = protocol.run(task_of(model).evaluation(16), task_of(model).calibration(16))
    assert results.model == "default" and results.metrics[0] == "accuracy"
    with pytest.raises(TypeError, match="EvaluationSet.from_task_batch"):
        protocol.run(torch.zeros(2, 3), task_of(model).calibration(16))  # type: ignore[arg-type]
    assert isinstance(EvaluationSet.from_task_batch(task_of(model).evaluation(2)), EvaluationSet)


def test_a_model_without_a_task_says_how_to_get_one() -> None:
    with pytest.raises(ValueError, match="records no task"):
        task_of(make_model())


def test_the_console_summary_answers_per_validated_metric_within_100_columns(
    planted_results,
) -> None:
    """`results.summary()` (what `dcp-lens run` prints): the verdict sentence of every validated
    metric (the report's, word for word), the quality at full depth and the smallest k, the legend,
    unvalidated metrics named without a verdict; every line within 100 characters."""
    text = planted_results.summary()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100
    flat = " ".join(line.strip() for line in lines)
    run = run_record(planted_results)
    for metric, decomposition in planted_results.decompositions.items():
        sentence, _ = verdict(run, metric)
        if decomposition.validated:
            assert f"{metric}: full depth" in text
            assert " ".join(sentence.split()) in flat, (metric, sentence)
        else:
            assert sentence not in flat
            assert metric in flat.split("not validated, no verdict:")[1].split(")")[0]
    assert "S: readout shift" in flat and "B: block applications" in flat
    assert "D: distinct computation" in flat
    assert "\n" not in repr(planted_results) and len(repr(planted_results)) < 300


def test_the_console_names_each_shared_flag_once_with_its_models(planted_results) -> None:
    from dcp_lens.report.console import format_summaries

    other = copy.copy(planted_results)
    object.__setattr__(other, "model", "planted:other")
    text = format_summaries([planted_results, other])
    flags = [line.strip() for line in text.split("flags:")[1].splitlines()]
    flags = [line for line in flags if line.startswith("- ")]
    shared = [line for line in flags if line.startswith("- [planted:readout_shift, planted:other]")]
    assert shared, text  # a flag of both runs is printed once, naming both
    assert len(flags) == len(set(flags))
    assert max(len(line) for line in text.splitlines()) <= 100
