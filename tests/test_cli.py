"""The command line: `dcp-lens run` on planted models writes results.json in the design schema."""

from __future__ import annotations

import json

import pytest

from dcp_lens.cli import main
from dcp_lens.results import read_results_json


@pytest.mark.parametrize(
    "name,factor", [("readout_shift", "S"), ("distinct_computation", "D"), ("block_count", "B")]
)
def test_run_on_planted_models_recovers_the_factor(tmp_path, name, factor):
    code = main(
        ["run", "--model", f"planted:{name}", "--seed", "3", "--n-eval", "256",
         "--n-calibration", "256", "--bootstrap", "200", "--probe", "none", "--quiet",
         "--out", str(tmp_path)]
    )  # fmt: skip
    assert code == 0
    data = json.loads((tmp_path / "results.json").read_text())
    (run,) = data["runs"]
    assert run["model"] == f"planted:{name}" and run["architecture"] == "recurrent"
    assert run["n_iterations"] == 8
    assert run["shares"]["accuracy"][factor] >= 0.9
    assert run["share_intervals"]["accuracy"][f"{factor}_lo"] > 0
    for row in run["decomposition"]:
        assert {"metric", "k", "gap", "S", "B", "D", "I_BS", "S_lo", "S_hi"} <= set(row)
    conditions = {row["condition"] for row in run["curves"]}
    assert conditions == {"full", "truncate", "replay", "calibrate_truncate",
                          "calibrate_replay", "shift"}  # fmt: skip
    assert run["null_control"]["max_abs_logit_diff"] <= 1e-5
    (loaded,) = read_results_json(tmp_path / "results.json")
    assert loaded.shares()["S"].notna().all()


def test_bad_arguments_exit_with_a_message(tmp_path, capsys):
    assert main(["run", "--model", "planted:nothing", "--out", str(tmp_path)]) == 2
    assert "unknown planted model 'nothing'" in capsys.readouterr().err
    assert (
        main(["run", "--model", "planted:block_count", "--k", "1,x", "--out", str(tmp_path)]) == 2
    )


def test_bench_json_reports_the_design_keys(capsys):
    code = main(
        ["bench", "--json", "--d-model", "32", "--iterations", "3", "--batch", "2", "--seq", "8",
         "--repeats", "1"]
    )  # fmt: skip
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("sweep_over_forward", "naive_over_sweep", "hooks_off_over_plain", "peak_memory_mb"):
        assert result[key] > 0, key
    assert result["model"]["n_layers"] == 1 + 2 * 3 + 1
    assert result["plain_max_abs_logit_diff"] <= 1e-4  # the plain loop is the same model
