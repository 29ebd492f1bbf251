"""The bundled default checkpoints: they load with the library's own loader, reproduce the
accuracy table written beside them, record how they were made, and `dcp-lens run` with no
``--model`` diagnoses the default pair."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import dcp_lens
from dcp_lens.cli import main
from dcp_lens.model.config import RecurrentConfig
from dcp_lens.tasks import get_task
from dcp_lens.training import AccuracyTable, evaluate_accuracy
from dcp_lens.zoo.bundled import (
    BUNDLE_FILES,
    BUNDLED,
    MAX_BYTES,
    bundle,
    bundled_path,
    load_bundled_from,
    stored_accuracy_table,
    stored_train_config,
)

NAMES = sorted(BUNDLED)
# What a bundle folder must hold, spelled out independently of the module's own list.
EXPECTED_FILES = {
    "accuracy_table.json",
    "config.json",
    "model.safetensors",
    "provenance.json",
    "task.json",
    "train_config.json",
}


@pytest.mark.parametrize("name", NAMES)
def test_bundled_files_are_small_and_record_how_they_were_made(name: str) -> None:
    folder = bundled_path(name)
    files = sorted(path.name for path in folder.iterdir())
    assert set(files) == EXPECTED_FILES == set(BUNDLE_FILES)
    size = sum(path.stat().st_size for path in folder.iterdir())
    assert size < MAX_BYTES
    config = stored_train_config(name)
    provenance = json.loads((folder / "provenance.json").read_text())
    assert config["regime"]["name"] == provenance["regime"] == BUNDLED[name]
    assert provenance["seed"] == config["seed"] == 0
    assert f"--regime {BUNDLED[name]} --seed 0" in provenance["command"]
    # The bundled model is the preset's: its settings are those `preset("default")` builds.
    from dcp_lens.training import preset

    expected = json.loads(json.dumps(preset("default", regime=BUNDLED[name], seed=0).to_dict()))
    # Fields added to RecurrentConfig after the bundle was trained read back at their defaults.
    model = RecurrentConfig.from_dict(config.pop("model")).to_dict()
    assert json.loads(json.dumps(model)) == expected.pop("model")
    assert config == expected


@pytest.mark.parametrize("name", NAMES)
def test_bundled_checkpoints_reproduce_their_accuracy_tables(name: str) -> None:
    model = dcp_lens.load(name)
    assert model.is_dense == (BUNDLED[name] == "dense")
    task = get_task(**model.task_config)
    stored = stored_accuracy_table(name)
    table = evaluate_accuracy(
        model,
        task,
        stored.n_programs,
        stored.k_values,
        split=stored.split,  # type: ignore[arg-type]
    )
    assert table.k_values == stored.k_values
    assert table.queries_per_hop == stored.queries_per_hop
    # Same programs, same weights: every cell agrees to within one query (a near-tie may flip
    # on another CPU's float rounding); in practice they are identical.
    for hops, per_k in stored.by_hops.items():
        for k, accuracy in per_k.items():
            assert abs(table.at(hops, k) - accuracy) <= 1 / stored.queries_per_hop[hops] + 1e-12
    for k, accuracy in stored.overall.items():
        assert abs(table.overall[k] - accuracy) <= 1 / sum(stored.queries_per_hop.values()) + 1e-12


def test_the_fixed_default_has_learned_the_task_and_needs_its_iterations() -> None:
    table = stored_accuracy_table("default")
    task = get_task(**dcp_lens.load("default").task_config)
    r = table.full_depth
    assert sorted(table.by_hops) == list(range(1, task.max_hops + 1))
    for hops in table.by_hops:
        assert table.at(hops, r) >= 0.9, f"h = {hops}: {table.at(hops, r):.3f} at full depth"
    # Accuracy rises with k up to r, and one iteration leaves most of the mix unsolved.
    overall = [table.overall[k] for k in range(1, r + 1)]
    assert overall == sorted(overall) and overall[-1] - overall[0] > 0.1
    assert table.overall[1] <= 0.5
    assert table.at(task.max_hops, 1) <= 0.5


def test_bundle_refuses_a_run_of_another_regime_or_an_unfinished_run(tmp_path) -> None:
    with pytest.raises(ValueError, match="not a finished training run"):
        bundle(tmp_path, "default", destination=tmp_path / "out")
    with pytest.raises(ValueError, match="unknown bundled checkpoint 'fancy'"):
        bundle(tmp_path, "fancy", destination=tmp_path / "out")
    with pytest.raises(ValueError, match="unknown bundled checkpoint"):
        bundled_path("fancy")


def test_bundle_copies_a_finished_run(tmp_path) -> None:
    from dcp_lens.training import preset, train

    run = tmp_path / "run"
    train(preset("tiny", regime="dense", seed=0), run, progress=False)
    with pytest.raises(ValueError, match="'default' is the 'fixed' model"):
        bundle(run, "default", destination=tmp_path / "out")
    target = bundle(run, "default-dense", destination=tmp_path / "out")
    copied = sorted(path.name for path in target.iterdir())
    assert set(copied) == EXPECTED_FILES
    # Stored in float16: the run's weights, rounded; the table is measured on the rounded ones.
    stored, trained = (
        load_file(str(folder / "model.safetensors")) for folder in (target, run / "model")
    )
    assert stored.keys() == trained.keys()
    for key, value in trained.items():
        assert stored[key].dtype == torch.float16
        assert torch.equal(stored[key], value.to(torch.float16)), key
    model = load_bundled_from(target)
    assert next(model.parameters()).dtype == torch.float32
    table = AccuracyTable.from_dict(json.loads((target / "accuracy_table.json").read_text()))
    recomputed = evaluate_accuracy(
        model, get_task(**model.task_config), table.n_programs, table.k_values
    )
    assert recomputed == table
    provenance = json.loads((target / "provenance.json").read_text())
    assert provenance["storage_dtype"] == "float16"
    assert 0 <= provenance["max_accuracy_difference_from_training_table"] <= 1


def test_dcp_lens_run_without_a_model_diagnoses_the_default_pair(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    code = main(
        [
            "run",
            "--out",
            str(out),
            "--n-eval",
            "128",
            "--n-calibration",
            "128",
            "--bootstrap",
            "20",
            "--probe",
            "none",
            "--quiet",
        ]
    )
    assert code == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [run["model"] for run in runs] == ["default", "default-dense"]
    assert [run["architecture"] for run in runs] == ["recurrent", "dense"]
    # On the mix `run` evaluates, the default model needs more than one iteration.
    truncated = {
        row["k"]: row["value"]
        for row in runs[0]["curves"]
        if row["metric"] == "accuracy" and row["condition"] == "truncate"
    }
    assert truncated[1] <= 0.5
    assert truncated[runs[0]["n_iterations"]] >= 0.9
    printed = capsys.readouterr().out
    assert "default (recurrent" in printed and "default-dense (dense" in printed


@pytest.mark.slow
def test_the_documented_command_rebuilds_the_bundled_default(tmp_path) -> None:
    """`dcp-lens train --preset default --regime fixed --seed 0` (about 5 minutes on one CPU
    thread) gives the bundled weights again, bit for bit after rounding to float16."""
    run = tmp_path / "run"
    assert (
        main(
            ["train", "--preset", "default", "--regime", "fixed", "--seed", "0", "--out", str(run)]
        )
        == 0
    )
    trained = load_file(str(run / "model" / "model.safetensors"))
    stored = load_file(str(bundled_path("default") / "model.safetensors"))
    assert trained.keys() == stored.keys()
    for key, value in trained.items():
        assert torch.equal(value.to(torch.float16), stored[key]), key
