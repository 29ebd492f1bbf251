"""Run results (dcp_lens.protocol.results): exact save and load round trips, equality to the last
bit, the ``results.json`` schema, the tables, and the checks of a run's metadata."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from dcp_lens.protocol.conditions import DECOMPOSED as CONDITIONS
from dcp_lens.protocol.decomposition import decompose
from dcp_lens.protocol.records import NullControlRecord, ProbeSummaryRecord
from dcp_lens.protocol.results import (
    Decomposition,
    ProtocolResults,
    read_results_json,
    write_results_json,
)
from tests.unit.protocol.test_decomposition import GRID, R, noisy_values


def make_run(architecture: str = "dense") -> ProtocolResults:
    accuracy_values = noisy_values("D", n=300, seed=11)
    bool_values = {
        c: (
            torch.from_numpy(v > 0)
            if isinstance(v, np.ndarray)
            else {k: torch.from_numpy(x > 0) for k, x in v.items()}
        )
        for c, v in accuracy_values.items()
    }
    accuracy = decompose(bool_values, GRID, n_iterations=R, n_bootstrap=100, seed=3)
    loss_values = noisy_values("S", n=300, seed=12)
    loss_values = {
        c: np.exp(-v) if isinstance(v, np.ndarray) else {k: np.exp(-x) for k, x in v.items()}
        for c, v in loss_values.items()
    }
    loss_values["replay"][2][5] = np.inf  # type: ignore[index]
    loss = decompose(
        loss_values,
        GRID,
        n_iterations=R,
        metric="cross_entropy",
        higher_is_better=False,
        n_bootstrap=100,
        seed=3,
    )
    return ProtocolResults(
        model="llama2c:stories260K",
        architecture=architecture,
        n_iterations=R,
        decompositions={"accuracy": accuracy, "cross_entropy": loss},
        null_control=NullControlRecord(max_abs_logit_diff=1.1920928955078125e-07),
        probe=ProbeSummaryRecord.from_json(
            {
                "reference_auroc": 0.5123456789012345,
                "trajectory": [
                    {"iteration": t, "mahalanobis": 1.0 / 3 + t, "auroc": None} for t in range(3)
                ],
                "replay_mahalanobis": np.array([np.inf, 2.5]),
            }
        ),
        metadata={"task": "char_lm", "seed": 0},
    )


def test_save_and_load_round_trip_exactly(tmp_path) -> None:
    run = make_run()
    assert not run.replay_realizable  # dense
    loaded = ProtocolResults.load(run.save(tmp_path / "out"))
    assert loaded == run
    loss = loaded.decompositions["cross_entropy"]
    assert np.isnan(loss.cells["S"][1])  # the NaN cell survived
    original = run.decompositions["cross_entropy"]
    for key in original.cells:
        assert loss.cells[key].tobytes() == original.cells[key].tobytes()
    assert loaded.probe["trajectory"][0]["auroc"] != loaded.probe["trajectory"][0]["auroc"]
    assert loaded.probe["replay_mahalanobis"] == [math.inf, 2.5]
    assert loaded.probe.other["replay_mahalanobis"] == [math.inf, 2.5]
    assert math.isnan(loaded.probe.trajectory[1]["auroc"])

    text = (tmp_path / "out" / "results.json").read_text()

    def reject(constant: str) -> None:
        raise AssertionError(f"results.json holds the non-standard constant {constant}")

    json.loads(text, parse_constant=reject)
    for name in ("decomposition.csv", "curves.csv", "shares.csv"):
        assert (tmp_path / "out" / name).stat().st_size > 0


def test_equality_sees_a_one_ulp_change() -> None:
    run = make_run()
    accuracy = run.decompositions["accuracy"]
    cells = dict(accuracy.cells)
    cells["S"] = cells["S"].copy()
    cells["S"][0] = np.nextafter(cells["S"][0], np.inf)
    changed = Decomposition(**{**accuracy.__dict__, "cells": cells})
    assert changed != accuracy
    assert Decomposition(**accuracy.__dict__) == accuracy


def test_several_runs_round_trip_through_one_results_json(tmp_path) -> None:
    runs = [make_run("recurrent"), make_run("dense")]
    path = write_results_json(runs, tmp_path / "results.json")
    assert read_results_json(path) == runs
    with pytest.raises(ValueError, match="2 runs"):
        ProtocolResults.load(tmp_path)


def test_results_json_follows_the_design_schema() -> None:
    run = make_run("recurrent").to_results_json()
    assert run["model"] == "llama2c:stories260K"
    assert run["architecture"] == "recurrent" and run["n_iterations"] == R
    assert run["replay_realizable"] is True
    required = {"metric", "k", "gap", "S", "B", "D", "I_BS"}
    required |= {"S_lo", "S_hi", "B_lo", "B_hi", "D_lo", "D_hi"}
    assert len(run["decomposition"]) == 2 * len(GRID)
    assert all(required <= set(row) for row in run["decomposition"])
    assert run["shares"].keys() == {"accuracy", "cross_entropy"}
    assert all(set(shares) == {"S", "B", "D", "stable"} for shares in run["shares"].values())
    conditions = {row["condition"] for row in run["curves"]}
    assert conditions == {"full", *CONDITIONS}
    assert len(run["curves"]) == 2 * (1 + len(CONDITIONS) * len(GRID))
    assert all({"metric", "condition", "k", "value"} <= set(row) for row in run["curves"])
    assert run["null_control"]["max_abs_logit_diff"] == 1.1920928955078125e-07
    assert {"reference_auroc", "trajectory"} <= set(run["probe"])
    assert run["probe"]["trajectory"][0]["auroc"] is None  # NaN is null in JSON


def test_tables_have_one_row_per_metric_and_k() -> None:
    run = make_run()
    table = run.table()
    assert len(table) == 2 * len(GRID)
    assert list(table.columns[:8]) == ["model", "architecture", "metric", "k", "gap", "S", "B", "D"]
    decomposed = table[~table["nonfinite"]]
    assert len(decomposed) == len(table) - 1  # cross_entropy's replay(2) holds an inf
    np.testing.assert_allclose(
        decomposed["S"] + decomposed["B"] + decomposed["D"], decomposed["gap"], atol=1e-9
    )
    curves = run.curves()
    assert len(curves) == 2 * (1 + len(CONDITIONS) * len(GRID))
    full = curves[(curves.metric == "accuracy") & (curves.condition == "full")]
    assert full["k"].tolist() == [R]
    assert len(run.shares()) == 2 and run.shares()["metric"].tolist() == list(run.metrics)


def test_the_gap_has_one_name_per_quantity() -> None:
    """shares() names the gap's area (what the shares divide) and its mean over k (what the
    console and the report show) apart; the mean is the number the summary prints."""
    run = make_run()
    shares = run.shares().set_index("metric")
    assert "gap" not in shares.columns
    table = run.table()
    for metric, row in shares.iterrows():
        per_k = table[table.metric == metric]
        finite = per_k["gap"][np.isfinite(per_k["gap"])]
        assert row["gap_mean"] == pytest.approx(finite.mean())
        used = per_k[per_k["k"].isin(run.decompositions[metric].share_k_grid)]
        assert row["gap_area"] == pytest.approx(used["gap"].sum())
        assert row["gap_area_lo"] <= row["gap_area"] <= row["gap_area_hi"]
    # The summary prints validated metrics only: mark every metric validated to read them all.
    marked = {m: dataclasses.replace(d, validated=True) for m, d in run.decompositions.items()}
    printed = dataclasses.replace(run, decompositions=marked).summary()
    for metric in run.metrics:
        assert f"mean gap over k {shares.loc[metric, 'gap_mean']:.3f}" in printed


def test_protocol_results_validate_their_metadata() -> None:
    accuracy = make_run().decompositions["accuracy"]
    with pytest.raises(ValueError, match="architecture='moe'"):
        ProtocolResults("m", "moe", R, {"accuracy": accuracy})
    with pytest.raises(ValueError, match="n_iterations=4"):
        ProtocolResults("m", "recurrent", 4, {"accuracy": accuracy})
    with pytest.raises(ValueError, match="max_abs_logit_diff"):
        NullControlRecord.from_json({"diff": 0.0})
    with pytest.raises(ValueError, match="decompositions is empty"):
        ProtocolResults("m", "recurrent", R, {})
    with pytest.raises(ValueError, match="holds metric 'accuracy'"):
        ProtocolResults("m", "recurrent", R, {"cross_entropy": accuracy})
