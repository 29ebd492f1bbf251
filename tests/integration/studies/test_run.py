"""`dcp-lens run` and `dcp_lens.studies.run.run` on a retrofitted-recurrence fixture with its
dense parent as the negative control: both models run, and both results and the report record
which parent layers became the prelude, the core and the coda."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import data_path

from dcp_lens.cli import main
from dcp_lens.protocol.config import ProtocolConfig
from dcp_lens.studies.run import RunOptions, TextOptions, run

SHAKESPEARE = data_path("tinyshakespeare.txt")
# What the fixtures' READMEs say the converter did (prelude first, coda last, core before it).
EXPECTED = {
    "llama": {"prelude": [0, 1], "core": [3, 4], "coda": [5, 6], "dropped": [2]},
    "olmo": {"prelude": [0, 1], "core": [2, 3], "coda": [4, 5], "dropped": []},
}


def _specs(variant: str) -> tuple[str, str]:
    folder = data_path("fixtures", f"retrofit_{variant}_tiny")
    return f"raven-retrofit:{folder}", f"bridge:{folder / 'parent'}"


def _check(out: Path, variant: str) -> None:
    runs = json.loads((out / "results.json").read_text())["runs"]
    model, parent = _specs(variant)
    assert [(r["model"], r["architecture"]) for r in runs] == [
        (model, "recurrent"),
        (parent, "dense"),
    ]
    for record in runs:
        pairing = record["metadata"]["layer_pairing"]
        assert {k: pairing[k] for k in EXPECTED[variant]} == EXPECTED[variant]
        assert pairing["found_by"] == "weights" and pairing["min_similarity"] > 0.999
        assert record["null_control"]["max_abs_logit_diff"] <= 1e-4
        rows = [row for row in record["decomposition"] if row["metric"] == "cross_entropy"]
        assert [row["k"] for row in rows] == [1, 2]
        for row in rows:  # the decomposition adds up to the truncation gap
            assert abs(row["S"] + row["B"] + row["D"] - row["gap"]) <= 1e-9
    report = (out / "report.html").read_text()
    assert report.count("layer_pairing / core") == 2 and model in report and parent in report


def test_cli_runs_a_retrofit_with_its_dense_parent_as_the_control(tmp_path: Path) -> None:
    model, parent = _specs("llama")
    code = main(
        [
            "run",
            "--model",
            model,
            "--dense-control",
            parent,
            "--task",
            f"text:{SHAKESPEARE}",
            "--max-tokens",
            "1200",
            "--seq-len",
            "16",
            "--k",
            "1,2",
            "--bootstrap",
            "10",
            "--probe",
            "none",
            "--quiet",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    assert code == 0
    _check(tmp_path / "out", "llama")


def test_api_runs_a_retrofit_with_its_dense_parent_as_the_control(tmp_path: Path) -> None:
    model, parent = _specs("olmo")
    config = ProtocolConfig(k_grid=(1, 2), n_bootstrap=10, probe="none")
    options = RunOptions(text=TextOptions(seq_len=16, max_tokens=1200), progress=False)
    run(tmp_path / "out", model, parent, f"text:{SHAKESPEARE}", config, options)
    _check(tmp_path / "out", "olmo")


def test_a_control_whose_weights_do_not_match_falls_back_to_the_convention() -> None:
    """Another model's layers share no weights with the retrofit: the converter's layout is
    recorded instead, and says so."""
    from dcp_lens.zoo.registry import layer_pairing

    model, _ = _specs("llama")
    _, unrelated = _specs("olmo")
    pairing = layer_pairing(model, unrelated)
    assert pairing is not None and pairing["found_by"] == "convention"
    assert pairing["min_similarity"] < 0.5
    assert (pairing["prelude"], pairing["core"], pairing["coda"]) == ([0, 1], [2, 3], [4, 5])
    assert layer_pairing("default", "default-dense") is None


def test_a_dry_run_at_huginns_shape_without_a_batch_size_fits_an_80_gb_card(
    monkeypatch, capsys, tmp_path
) -> None:
    """`dcp-lens run --dry-run` at Huginn-0125's shape (its layout and width in bfloat16 on the
    meta device: no weights), 512 + 512 sequences of 1024 tokens, on an empty 80 GB card and no
    --batch-size: the batch is chosen from the budget and printed, the estimated peak fits the
    budget, and host memory is printed beside the device's."""
    import re

    import torch

    import dcp_lens.protocol.budget as budget
    import dcp_lens.protocol.evaluation_set as evaluation_set
    import dcp_lens.studies.run as run_module
    from dcp_lens import EvaluationSet, HookedRecurrentTransformer
    from dcp_lens.studies.bench import bench_config

    card = 80 * 10**9

    def huginn(spec: str, options: RunOptions) -> HookedRecurrentTransformer:
        with torch.device("meta"):
            return HookedRecurrentTransformer(bench_config("huginn")).to(torch.bfloat16).eval()

    def tokens(model, task, n_eval, n_calibration, seed, **text):
        rows = torch.zeros(1024, 1024, dtype=torch.long)
        rows[:, 0] = torch.arange(1024)  # distinct examples
        return EvaluationSet.from_tokens(rows[:512]), EvaluationSet.from_tokens(rows[512:])

    monkeypatch.setattr(run_module, "_load_model", huginn)
    monkeypatch.setattr(evaluation_set, "task_data", tokens)
    monkeypatch.setattr(budget, "free_device_bytes", lambda device: card)
    assert main(["run", "--model", "huginn-shaped", "--dry-run", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    chosen = re.search(r"batch size (\d+): the largest up to (\d+)", printed)
    assert chosen is not None, printed
    peak = re.search(r"peak \([a-z ]+\): ([\d.]+) GiB", printed)
    host = re.search(r"host memory beside it: ([\d.]+) GiB", printed)
    assert peak is not None and host is not None, printed
    assert float(peak.group(1)) * 2**30 <= budget.DEFAULT_BUDGET_SHARE * card
    assert float(host.group(1)) > 0  # the calibration groups parked off the device
    assert "512 + 512 sequences of 1024 tokens" in printed
