"""The command line: `dcp-lens run` on planted models writes results.json in the design schema."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dcp_lens.cli import main
from dcp_lens.protocol.results import read_results_json


@pytest.mark.parametrize(
    "name,factor", [("readout_shift", "S"), ("distinct_computation", "D"), ("block_count", "B")]
)
def test_run_on_planted_models_recovers_the_factor(tmp_path, capsys, name, factor):
    code = main(
        [
            "run",
            "--model",
            f"planted:{name}",
            "--seed",
            "3",
            "--n-eval",
            "256",
            "--n-calibration",
            "256",
            "--bootstrap",
            "200",
            "--probe",
            "none",
            "--quiet",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out.strip().splitlines()  # ends: summary, then the report
    assert printed[-1].endswith(str(tmp_path / "report.html"))
    assert any("null control max |logit diff|" in line for line in printed)
    assert any(line.startswith("  accuracy: full depth") for line in printed)  # the verdict
    assert max(len(line) for line in printed[:-1]) <= 100  # the last names the report's path
    data = json.loads((tmp_path / "results.json").read_text())
    (run,) = data["runs"]
    assert run["model"] == f"planted:{name}" and run["architecture"] == "recurrent"
    assert run["n_iterations"] == 8
    assert run["shares"]["accuracy"][factor] >= 0.9
    assert run["share_intervals"]["accuracy"][f"{factor}_lo"] > 0
    for row in run["decomposition"]:
        assert {"metric", "k", "gap", "S", "B", "D", "I_BS", "S_lo", "S_hi"} <= set(row)
    conditions = {row["condition"] for row in run["curves"]}
    assert conditions == {
        "full",
        "truncate",
        "replay",
        "calibrate_truncate",
        "calibrate_replay",
        "shift",
        "translate_truncate",
        "translate_replay",
        "base_rate",
    }
    # The bracket names the planted factor, except on distinct_computation: its remaining
    # computation is a fixed permutation of a one-hot state, a frame change that a paired map
    # performs, so its S bracket spans [0, 1] and the verdict must stay inconclusive
    # (docs/bracket.md); the truth D is inside the bracket.
    shares = run["shares"]["accuracy"]
    assert shares["verdict"] == ("inconclusive" if factor == "D" else factor)
    if factor == "D":
        assert shares["S_lower"] <= 0.05 and shares["S_identified"] is False
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
        [
            "bench",
            "--json",
            "--d-model",
            "32",
            "--iterations",
            "3",
            "--batch-size",
            "2",
            "--seq",
            "8",
            "--repeats",
            "1",
        ]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("sweep_over_forward", "naive_over_sweep", "hooks_off_over_plain", "peak_memory_mb"):
        assert result[key] > 0, key
    assert result["model"]["n_layers"] == 1 + 2 * 3 + 1
    # Throughput: tokens through the sweep (calibration + evaluation) and through one forward.
    assert result["sweep_tokens_per_second"] == pytest.approx(2 * 2 * 8 / result["sweep_seconds"])
    assert result["forward_tokens_per_second"] == pytest.approx(2 * 8 / result["forward_seconds"])
    assert result["sweep_seconds_per_million_tokens"] == pytest.approx(
        1e6 / result["sweep_tokens_per_second"]
    )
    assert math.isfinite(result["sweep_memory_per_batch_token_mb"])
    assert result["plain_max_abs_logit_diff"] <= 1e-4  # the plain loop is the same model
    # One sweep, timed between two forwards and between two runs of its irreducible work.
    assert result["repeats"] == {
        "forward": 2,
        "forward_materialised": 1,
        "plain": 1,
        "irreducible": 2,
        "sweep": 1,
    }
    assert result["materialised_over_fused_forward"] > 0
    assert result["sweep_over_forward_fastest"] == pytest.approx(
        result["sweep_seconds"] / result["forward_seconds"]
    )
    sweep, irreducible = result["rounds_seconds"]["sweep"], result["rounds_seconds"]["irreducible"]
    assert result["sweep_over_irreducible"] == pytest.approx(
        sweep[0] / ((irreducible[0] + irreducible[1]) / 2)
    )
    assert result["irreducible_seconds"] == min(irreducible)
    parts = result["irreducible_parts_seconds"]
    assert set(parts) == {
        "calibration_pass",
        "matching_readouts",
        "evaluation_pass",
        "evaluation_readouts",
    }
    assert all(seconds > 0 for seconds in parts.values()), parts
    assert sum(parts.values()) <= result["irreducible_seconds_median"] * 1.01
    # k grid 1, 2, 3 of r = 3: five conditions and two translators need a readout below r (not
    # the base rate, which is full depth's logits rearranged); at r every condition is full depth
    # (calibrate(full) and shift(r) map full depth onto itself: the identity, read once).
    readouts = result["irreducible_readouts"]
    assert readouts["evaluation"] == {"1": 7, "2": 7, "3": 0}
    assert readouts["matching"] == {"1": 5, "2": 5, "3": 2}
    # The floor: the maps before those readouts (five mapped conditions at k < r, the calibration
    # null's map, the jackknife's) and every readout scored (full depth's, the fourteen above, the
    # null's and the jackknife's).
    others = readouts["null"] + sum(readouts["jackknife"].values())
    assert result["floor_calls"] == {"maps": 5 + 5 + others, "metrics": 1 + 14 + others}
    assert set(result["floor_parts_seconds"]) == {"maps", "metrics"}
    assert all(seconds > 0 for seconds in result["floor_parts_seconds"].values())
    assert result["sweep_floor_over_irreducible"] == pytest.approx(
        1 + sum(result["floor_parts_seconds"].values()) / result["irreducible_seconds_median"]
    )


def test_the_bench_floor_times_every_map_and_score_the_sweep_does_with_the_jackknife():
    from dcp_lens.studies.bench import run_bench

    result = run_bench(d_model=16, n_iterations=3, batch=20, seq=4, repeats=1, naive=False)
    readouts = result["irreducible_readouts"]
    jackknife = sum(readouts["jackknife"].values())
    assert readouts["null"] == 1 and jackknife > 0  # the null and the jackknife are on here
    # Every jackknife readout is a left-out group's map or translator, then its score.
    assert result["floor_calls"] == {
        "maps": 5 + 5 + 1 + jackknife,
        "metrics": 1 + 14 + 1 + jackknife,
    }
    assert result["sweep_floor_over_irreducible"] > 1.0


def test_the_bench_floor_times_every_batch_and_the_jackknife_where_its_examples_are():
    # The jackknife reads the examples whose key is 0 mod its stride, a share that differs from
    # batch to batch: the floor must time each batch, not scale the first one up.
    from dcp_lens.model.hooked_recurrent_transformer import HookedRecurrentTransformer
    from dcp_lens.protocol.dcp import DepthControlProtocol, EvaluationSet
    from dcp_lens.protocol.sweep import jackknife_examples
    from dcp_lens.studies.bench import BENCH_CONFIG, bench_config
    from dcp_lens.studies.bench_floor import irreducible_readouts, overhead_floor

    cfg = bench_config("small", 16, None, 3, None, 4, 0)
    model = HookedRecurrentTransformer(cfg).eval()
    tokens = torch.randint(0, cfg.d_vocab, (90, 4), generator=torch.Generator().manual_seed(3))
    calibration = EvaluationSet.from_tokens(tokens[:30])
    evaluation = EvaluationSet.from_tokens(tokens[30:])
    size = 12  # five batches, the last of twelve
    protocol = DepthControlProtocol(model, BENCH_CONFIG.replace(batch_size=size), progress=False)
    with torch.no_grad():
        protocol.fit(calibration)
        seconds, calls = overhead_floor(protocol, evaluation)
    chosen = jackknife_examples(evaluation.example_keys(), 4)
    batches = [chosen[start : start + size] for start in range(0, len(evaluation), size)]
    with_jackknife = sum(bool(part.any()) for part in batches)
    # This draw has batches with and without the jackknife's examples, in uneven numbers.
    assert 0 < with_jackknife < len(batches)
    assert len({int(part.sum()) for part in batches}) > 1
    jackknife = sum(irreducible_readouts(protocol)["jackknife"].values())
    assert jackknife > 0
    assert calls == {
        "maps": len(batches) * (5 + 5 + 1) + with_jackknife * jackknife,
        "metrics": len(batches) * (1 + 14 + 1) + with_jackknife * jackknife,
    }
    assert all(value > 0 for value in seconds.values())


def test_the_bench_printout_says_when_its_batches_are_fewer_than_a_runs(capsys):
    from dcp_lens.studies.bench import RUN_BATCHES, print_bench

    data = Path(__file__).parents[2] / "docs" / "data" / "bench_threads1.json"
    result = json.loads(data.read_text())
    for batches, hinted in ((1, True), (RUN_BATCHES, False)):
        print_bench({**result, "batches": batches}, as_json=False)
        out = capsys.readouterr().out
        assert "sweep_over_irreducible" in out
        assert (f"--batches {RUN_BATCHES} measures that" in out) is hinted


def test_the_paired_ratio_cancels_a_drifting_machine():
    from dcp_lens.studies.bench import paired_ratio

    # A machine slowing down steadily: each sweep costs four of the forwards around it, while
    # the fastest sweep over the fastest forward reads 6.
    forwards, sweeps = [1.0, 2.0, 3.0, 4.0], [6.0, 10.0, 14.0]
    assert paired_ratio(sweeps, forwards) == pytest.approx(4.0)
    assert min(sweeps) / min(forwards) == pytest.approx(6.0)
    # A burst of interference during one sweep moves the median by nothing.
    assert paired_ratio([4.0, 40.0, 4.0], [1.0, 1.0, 1.0, 1.0]) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="before and after each long one"):
        paired_ratio([4.0, 4.0], [1.0, 1.0])


# ------------------------------------------------------------------ arguments before torch

ARGUMENT_ERRORS = """
import json, sys, tempfile
from pathlib import Path
from dcp_lens.cli import main
folder = Path(tempfile.mkdtemp())
(folder / "file").write_text("not a folder")
cases = [
    ["run", "--k", "x", "--out", str(folder / "o")],
    ["run", "--out", str(folder / "file")],
    ["run", "--out", str(folder / "file" / "below")],
    ["run", "--threads", "0", "--out", str(folder / "o")],
    ["run", "--model", "huginn:" + str(folder / "absent"), "--out", str(folder / "o")],
    ["run", "--model", " ", "--out", str(folder / "o")],
    ["run", "--task", "text:" + str(folder / "absent.txt"), "--out", str(folder / "o")],
    ["report", str(folder)],
    ["bench", "--d-model", "0"],
    ["experiment", "training-intervention", "--seeds", "0,a", "--out", str(folder / "o")],
    ["run", "--out"],
    ["run", "--out", ""],  # not the current folder
    ["run", "--version-typo", "--out", str(folder / "o")],
]
codes = []
for argv in cases:
    try:
        codes.append(main(argv))
    except SystemExit as exit:
        codes.append(exit.code)
print(json.dumps({"codes": codes, "torch": "torch" in sys.modules,
                  "written": sorted(p.name for p in folder.iterdir())}))
"""


def test_argument_errors_exit_2_before_torch_is_imported():
    """`dcp-lens --help` and argument errors are instant because nothing heavy is imported."""
    done = subprocess.run(
        [sys.executable, "-c", ARGUMENT_ERRORS], capture_output=True, text=True, check=True
    )
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["codes"] == [2] * 13
    assert result["torch"] is False, "an argument error imported torch"
    assert result["written"] == ["file"]  # no work started: no output folder made
    errors = done.stderr.strip().splitlines()
    assert len(errors) == 13 and all(": error: " in line for line in errors), errors


def test_help_is_plain_text_with_defaults_specs_and_an_example(capsys):
    for command in ("", "run", "report", "train", "experiment", "validate", "bench"):
        with pytest.raises(SystemExit) as exit:
            main([*command.split(), "--help"])
        assert exit.value.code == 0
        text = capsys.readouterr().out
        assert "``" not in text and "§" not in text, command
        assert "example:\n  dcp-lens " in text, command
        if command:
            assert "(default: " in text, command
        if command == "run":
            assert "paired bootstrap draws (default: 1000)" in " ".join(text.split())


def test_help_lists_every_registered_model_spec(capsys):
    from dcp_lens.zoo import planted
    from dcp_lens.zoo.registry import LOADERS, NAMED, _import_builtin_kinds

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    _import_builtin_kinds()
    for kind in LOADERS:
        assert f"{kind}:" in text, kind
    for name in [*NAMED, *planted.BRACKET_PLANTED]:
        assert name in text, name


def test_version_prints_the_package_version(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.strip() == f"dcp-lens {metadata.version('dcp-lens')}"


def test_an_unwritable_out_folder_is_refused(tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.geteuid() == 0:  # root writes anywhere: let the permission check see what a user would
        real_access = os.access
        monkeypatch.setattr(
            os, "access", lambda path, mode: Path(path) != locked and real_access(path, mode)
        )
    try:
        assert main(["run", "--out", str(locked / "run")]) == 2
    finally:
        locked.chmod(0o700)
    assert "is not writable" in capsys.readouterr().err


def test_threads_applies_to_the_command_and_is_restored(capsys):
    before = torch.get_num_threads()
    code = main(
        [
            "bench",
            "--json",
            "--threads",
            "2",
            "--d-model",
            "16",
            "--iterations",
            "2",
            "--batch-size",
            "1",
            "--seq",
            "4",
            "--repeats",
            "1",
            "--no-naive",
        ]
    )
    assert code == 0
    assert json.loads(capsys.readouterr().out)["threads"] == 2
    assert torch.get_num_threads() == before


def test_the_package_imports_its_names_lazily():
    code = (
        "import sys, dcp_lens\n"
        "assert 'torch' not in sys.modules\n"
        "from dcp_lens import DepthControlProtocol, load\n"
        "assert callable(load) and dcp_lens.DepthControlProtocol is DepthControlProtocol\n"
        "assert dcp_lens.hooks.truncate is not None\n"
        "assert set(dcp_lens.__all__) <= set(dir(dcp_lens))\n"
        "try:\n    dcp_lens.no_such_name\nexcept AttributeError:\n    print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.strip() == "ok", done.stderr


def test_the_allocator_setting_reads_its_variable(monkeypatch):
    from dcp_lens.utils import memory

    glibc = memory._glibc() is not None
    monkeypatch.delenv(memory.THRESHOLD_VARIABLE, raising=False)
    assert memory.limit_heap_fragmentation() is glibc  # unset: the batch-loop setting
    assert memory.fixed_threshold() is None
    monkeypatch.setenv(memory.THRESHOLD_VARIABLE, "0")
    assert memory.limit_heap_fragmentation() is glibc and memory.fixed_threshold() is None
    monkeypatch.setenv(memory.THRESHOLD_VARIABLE, "131072")
    assert memory.fixed_threshold() == 131072
    monkeypatch.setenv(memory.THRESHOLD_VARIABLE, "12kB")
    with pytest.raises(ValueError, match="must be a number of bytes"):
        memory.limit_heap_fragmentation()
    monkeypatch.setenv(memory.TRIM_VARIABLE, "0")
    assert memory.release_free_memory(keep=0) is False
    monkeypatch.delenv(memory.TRIM_VARIABLE)
    assert memory.release_free_memory(keep=0) is glibc
    monkeypatch.setenv(memory.KEEP_VARIABLE, "lots")
    with pytest.raises(ValueError, match="DCP_LENS_TRIM_KEEP='lots' must be a number of bytes"):
        memory.release_free_memory()


def test_the_heap_is_trimmed_only_past_what_it_may_keep(monkeypatch):
    """Free heap up to `keep` bytes stays for the next batch (trimming it would only have the
    kernel fault and zero the pages again); past it, or where glibc cannot say, it is trimmed."""
    from dcp_lens.utils import memory

    if memory._glibc() is None:
        pytest.skip("no glibc")
    trims = []

    class Libc:
        def malloc_trim(self, pad):
            trims.append(pad)

    monkeypatch.setattr(memory, "_glibc", lambda: Libc())
    for free, keep, trimmed in [
        (100, 200, False),
        (200, 200, False),
        (201, 200, True),
        (None, 10**12, True),
        (1, 0, True),
    ]:
        monkeypatch.setattr(memory, "free_heap_bytes", lambda free=free: free)
        assert memory.release_free_memory(keep) is trimmed
    assert trims == [0, 0, 0]
    monkeypatch.setattr(memory, "free_heap_bytes", lambda: memory.TRIM_KEEP_BYTES + 1)
    monkeypatch.setenv(memory.KEEP_VARIABLE, str(memory.TRIM_KEEP_BYTES + 1))
    assert memory.release_free_memory() is False  # the variable sets the default keep
    monkeypatch.delenv(memory.KEEP_VARIABLE)
    assert memory.release_free_memory() is True


def test_glibc_reports_its_free_heap():
    from dcp_lens.utils import memory

    libc = memory._glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        pytest.skip("no glibc >= 2.33")
    memory.limit_heap_fragmentation()  # 8 MB then comes from the heap (threshold 32 MB)
    block = torch.ones(8 * 2**20, dtype=torch.uint8)
    held = memory.free_heap_bytes()
    del block
    freed = memory.free_heap_bytes()
    assert held is not None and freed is not None and freed - held >= 8 * 2**20


def test_the_protocol_returns_free_heap_pages_after_every_batch(monkeypatch):
    """Peak memory is set by one batch: the heap's free pages go back after each batch of the
    calibration and evaluation loops (dcp_lens.utils.memory), not only at the end."""
    from dcp_lens import DepthControlProtocol, load
    from dcp_lens.protocol import context as stages  # every stage's loop goes through it
    from dcp_lens.protocol.dcp import task_data

    calls = []
    monkeypatch.setattr(stages, "release_free_memory", lambda: calls.append(1) or True)
    model = load("planted:distinct_computation")
    evaluation, calibration = task_data(model, None, 24, 16, 0)
    protocol = DepthControlProtocol(
        model,
        k_grid=[1, model.n_iterations],
        batch_size=8,
        n_bootstrap=0,
        probe="none",
        progress=False,
    )
    protocol.run(evaluation, calibration)
    # The calibration pass and the evaluation pass: one release per batch of each (the
    # translators are fitted from states the calibration pass kept, with no pass of their own).
    # One per calibration and evaluation batch, one per stream the jackknife refits (full
    # depth, truncate(1) and replay(1)).
    assert len(calls) == 16 // 8 + 24 // 8 + 3
