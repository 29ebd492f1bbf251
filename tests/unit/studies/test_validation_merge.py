"""`dcp-lens validate --merge` on committed validation records cut into parts: the merged suite
and coverage equal what one process wrote, and parts that cannot be merged are refused."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from dcp_lens.cli import main
from dcp_lens.protocol.results import decode_json
from dcp_lens.studies.validation_merge import merge, read_part
from dcp_lens.studies.validation_rules import summarize
from dcp_lens.utils.errors import ConfigError

DATA = Path(__file__).resolve().parents[3] / "docs" / "data"


def suite_document() -> dict[str, Any]:
    return json.loads((DATA / "validation_w256_seed0.json").read_text())


def coverage_document() -> dict[str, Any]:
    return json.loads((DATA / "validation_coverage_w256.json").read_text())


def suite_parts(document: dict[str, Any], cut: int) -> list[dict[str, Any]]:
    """The suite cut after its ``cut``-th model, as two processes would have written it."""
    models = list(dict.fromkeys(row["model"] for row in document["rows"]))
    parts = []
    for chosen in (models[:cut], models[cut:]):
        part = copy.deepcopy(document)
        part["rows"] = [row for row in part["rows"] if row["model"] in chosen]
        part["settings"]["seconds"] = 1.5
        parts.append(part)
    return parts


def coverage_parts(document: dict[str, Any], cut: int) -> list[dict[str, Any]]:
    """The coverage record cut after its ``cut``-th seed, as two processes at seeds s and
    s + cut would have written it (their tables left stale: merge must recompute them)."""
    seeds = document["coverage"]["seeds"]
    parts = []
    for chosen in (slice(0, cut), slice(cut, None)):
        part = copy.deepcopy(document)
        table = part["coverage"]
        table["seeds"] = seeds[chosen]
        table["draws"] = {
            model: {metric: draws[chosen] for metric, draws in per_metric.items()}
            for model, per_metric in table["draws"].items()
        }
        part["settings"]["seed"] = part["settings"]["config"]["seed"] = seeds[chosen][0]
        table["models"] = {}
        parts.append(part)
    return parts


def test_a_suite_cut_into_parts_merges_into_the_rows_and_summary_of_one_run():
    whole = suite_document()
    rows, settings, table = merge(suite_parts(whole, 7))
    assert table is None
    assert [(r.model, r.metric) for r in rows] == [(r["model"], r["metric"]) for r in whole["rows"]]
    assert json.loads(json.dumps(summarize(rows))) == whole["summary"]
    assert settings["seconds"] == 3.0
    assert settings["models_run"] == list(dict.fromkeys(r["model"] for r in whole["rows"]))
    assert settings["width"] == whole["settings"]["width"]


def test_coverage_cut_by_seed_merges_into_the_table_of_one_run():
    whole = coverage_document()
    _, settings, table = merge(coverage_parts(whole, 8)[::-1])  # part order must not matter
    assert table is not None
    assert table["seeds"] == whole["coverage"]["seeds"]
    assert table["models"] == decode_json(whole["coverage"]["models"])
    assert table["passed"] == whole["coverage"]["passed"]
    assert settings["seed"] == whole["coverage"]["seeds"][0]
    assert [s["seeds"][0] for s in settings["replicates_from"]][:1] == [8]


def test_a_model_run_twice_a_mixed_kind_or_a_differing_setting_is_refused():
    suite = suite_parts(suite_document(), 7)
    with pytest.raises(ConfigError, match="merge each model once"):
        merge([suite[0], suite[0]])
    with pytest.raises(ConfigError, match="merge each replicate once"):
        part = coverage_parts(coverage_document(), 8)[0]
        merge([part, part])
    with pytest.raises(ConfigError, match="suite parts and coverage parts"):
        merge([suite[0], coverage_parts(coverage_document(), 8)[0]])
    suite[1]["settings"]["width"] = 1024
    with pytest.raises(ConfigError, match="width = 1024"):
        merge(suite)
    suite[1]["settings"]["width"] = suite[0]["settings"]["width"]
    suite[1]["settings"]["config"]["n_bootstrap"] = 100
    with pytest.raises(ConfigError, match="config.n_bootstrap"):
        merge(suite)
    suite[1]["settings"]["config"]["n_bootstrap"] = suite[0]["settings"]["config"]["n_bootstrap"]
    suite[1]["settings"]["config"]["memory_budget"] = 3.0  # sets chunk sizes only
    assert len(merge(suite)[0]) == len(suite_document()["rows"])
    with pytest.raises(ConfigError, match="at least two parts"):
        merge(suite[:1])


def test_the_command_merges_folders_and_refuses_what_it_cannot(tmp_path, capsys):
    folders = []
    for i, part in enumerate(suite_parts(suite_document(), 3)):
        folder = tmp_path / f"part{i}"
        folder.mkdir()
        (folder / "validation.json").write_text(json.dumps(part))
        folders.append(str(folder))
    out = tmp_path / "merged"
    assert main(["validate", "--merge", ",".join(folders), "--out", str(out)]) == 0
    merged = read_part(out)
    assert merged["rows"] == suite_document()["rows"]
    assert (out / "validation.md").read_text().count("\n") > len(merged["rows"])
    assert "merged 2 parts" in capsys.readouterr().out
    assert main(["validate", "--merge", ",".join(folders), "--width", "64"]) == 2
    assert "runs nothing" in capsys.readouterr().err
    assert main(["validate", "--merge", f"{folders[0]},{tmp_path}", "--out", str(out)]) == 2
    assert "holds no validation.json" in capsys.readouterr().err
    assert read_part(out)["rows"] == suite_document()["rows"]  # the refused merge lost nothing
