"""Inputs a fuzz pass found without a clear error, each now refused cleanly.

Each test names the case it covers; the error must be a `DCPLensError` whose message names the
file, field or tensor and the value.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from helpers import data_path, save_tiny_model, tiny_config, write_llama2c
from safetensors.torch import load_file, save_file

from dcp_lens import HookedRecurrentTransformer, load
from dcp_lens.cli import main
from dcp_lens.model.config import RecurrentConfig
from dcp_lens.protocol.calibration import CalibrationFallbackWarning
from dcp_lens.protocol.dcp import DepthControlProtocol, EvaluationSet
from dcp_lens.protocol.results import ProtocolResults
from dcp_lens.utils.devices import check_device
from dcp_lens.utils.errors import (
    ConfigError,
    ConfigTypeError,
    DamagedFileError,
    DCPLensError,
    DeviceError,
    IncompleteRunError,
    ResourceLimitError,
    WeightsError,
)

# A device this machine surely lacks (on a CUDA machine, a CUDA index past its last GPU).
ABSENT_DEVICE = "cuda:99" if torch.cuda.is_available() else "cuda"


# Small sizes for runs in tests (seconds each).
SMALL = ["--n-eval", "16", "--n-calibration", "16", "--bootstrap", "5", "--probe", "none"]


def rewrite_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run the CLI, which must fail with exit code 2 and exactly one line on stderr."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    return err


# ------------------------------------------------------------------- configs validated by type


@pytest.mark.parametrize("content", ["[1, 2]", '"a string"', "7"])
def test_config_json_that_is_not_an_object_names_the_file(tmp_path, content):
    save_tiny_model(tmp_path)
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ConfigError, match=r"config\.json must hold a JSON object"):
        HookedRecurrentTransformer.from_pretrained(tmp_path)


@pytest.mark.parametrize("kind", ["huginn", "ouro"])
def test_loader_config_json_that_is_a_list_names_the_file(tmp_path, kind):
    folder = shutil.copytree(data_path("fixtures", f"{kind}_tiny"), tmp_path / kind)
    (folder / "config.json").chmod(0o644)
    (folder / "config.json").write_text("[]")
    with pytest.raises(ConfigError, match=r"config\.json must hold a JSON object"):
        load(f"{kind}:{folder}")


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("seed", "1", "seed='1' .* is not an integer"),
        ("seed", 1.5, "seed=1.5 .* is not an integer"),
        ("state_init_seed", "3", "state_init_seed='3' .* is not an integer"),
        ("final_norm", "false", "final_norm='false' .* is not a boolean"),
        ("tie_unembed", 0, "tie_unembed=0 .* is not a boolean"),
        ("eps", "1e-5", "eps='1e-5' .* is not a finite number"),
    ],
)
def test_config_fields_are_checked_by_type_naming_file_field_and_value(
    tmp_path, field, value, expected
):
    with pytest.raises(ConfigTypeError, match=expected):
        RecurrentConfig.from_dict({**tiny_config().to_dict(), field: value})
    save_tiny_model(tmp_path)
    rewrite_json(tmp_path / "config.json", **{field: value})
    with pytest.raises(ConfigTypeError, match=rf"config\.json: .*{expected}"):
        HookedRecurrentTransformer.from_pretrained(tmp_path)


def test_huginn_init_values_as_a_string_is_refused(tmp_path):
    folder = shutil.copytree(data_path("fixtures", "huginn_tiny"), tmp_path / "huginn")
    (folder / "config.json").chmod(0o644)
    rewrite_json(folder / "config.json", init_values="std=0.02")
    with pytest.raises(ConfigTypeError, match=r"config\.json: field init_values='std=0.02'"):
        load(f"huginn:{folder}")
    rewrite_json(folder / "config.json", init_values={"std": 0.02}, qk_bias="false")
    with pytest.raises(ConfigTypeError, match="qk_bias='false'.*boolean"):
        load(f"huginn:{folder}")


@pytest.mark.parametrize(
    ("changes", "error", "expected"),
    [
        ({"rope_parameters": "default"}, ConfigTypeError, "rope_parameters='default'"),
        ({"num_attention_heads": 0}, ConfigError, "num_attention_heads=0 must be > 0"),
        ({"max_position_embeddings": 10**10}, ResourceLimitError, "n_ctx=10000000000 exceeds"),
        ({"rms_norm_eps": "tiny"}, ConfigTypeError, "rms_norm_eps='tiny'"),
    ],
)
def test_ouro_source_config_is_checked_before_use(tmp_path, changes, error, expected):
    folder = shutil.copytree(data_path("fixtures", "ouro_tiny"), tmp_path / "ouro")
    (folder / "config.json").chmod(0o644)
    rewrite_json(folder / "config.json", **changes)
    with pytest.raises(error, match=expected):
        load(f"ouro:{folder}")


@pytest.mark.parametrize("name", ["config.json", "task.json"])
@pytest.mark.parametrize(
    ("content", "expected"),
    [(b'{"d_model": 16,', "is not valid JSON"), (b"\x89PNG\r\n\x1a\n\xff\xfe", "is not UTF-8")],
)
def test_invalid_or_binary_json_names_the_file(tmp_path, name, content, expected):
    save_tiny_model(tmp_path)
    (tmp_path / "task.json").write_text(json.dumps({"name": "variable_binding"}))
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ConfigError, match=rf"{name} {expected}"):
        HookedRecurrentTransformer.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    ("task", "expected"),
    [
        ([{"name": "variable_binding"}], "must hold a JSON object"),
        ({"name": "variable_binding", "seed": "0"}, "seed='0' .* is not an integer"),
        ({"name": "variable_binding", "show_answers": "false"}, "show_answers='false'"),
        ({"name": "nope"}, "unknown task 'nope'"),
    ],
)
def test_task_json_is_validated_on_load(tmp_path, task, expected):
    """`load(folder)` checks task.json whole; the model stage checks its form at from_pretrained
    (a JSON object), the tasks stage its fields when the task is built (`task_of`)."""
    from dcp_lens.tasks import task_of

    save_tiny_model(tmp_path)
    (tmp_path / "task.json").write_text(json.dumps(task))
    with pytest.raises(ConfigError, match=expected):
        load(str(tmp_path))
    if isinstance(task, dict):
        with pytest.raises(ConfigError, match=expected):
            task_of(HookedRecurrentTransformer.from_pretrained(tmp_path))
    else:
        with pytest.raises(ConfigError, match=expected):
            HookedRecurrentTransformer.from_pretrained(tmp_path)


def test_training_config_fields_are_checked_by_type(tmp_path):
    from dcp_lens.training import TrainConfig, preset

    saved = preset("tiny").to_dict()
    for field, value in (("seed", "0"), ("seed", 0.5), ("lr", "fast"), ("grad_clip", math.nan)):
        with pytest.raises(ConfigTypeError, match=f"field {field}="):
            TrainConfig.from_dict({**saved, field: value})
    (tmp_path / "train_config.json").write_text(json.dumps({**saved, "regime": "fixed"}))
    with pytest.raises(ConfigTypeError, match=r"train_config\.json: .*field regime='fixed'"):
        TrainConfig.from_json(tmp_path / "train_config.json")


# ------------------------------------------------------------------- weights of the wrong kind


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float8_e4m3fn, torch.int32])
def test_weights_of_an_unsupported_dtype_are_refused_naming_the_tensor(tmp_path, dtype):
    save_tiny_model(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["embed.W_E"] = state["embed.W_E"].to(dtype)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(WeightsError, match=r"tensor 'embed\.W_E' has dtype"):
        HookedRecurrentTransformer.from_pretrained(tmp_path)


def test_huginn_weights_of_complex_dtype_are_refused(tmp_path):
    folder = shutil.copytree(data_path("fixtures", "huginn_tiny"), tmp_path / "huginn")
    (folder / "model.safetensors").chmod(0o644)
    state = load_file(folder / "model.safetensors")
    state["transformer.ln_f.weight"] = state["transformer.ln_f.weight"].to(torch.complex64)
    save_file(state, folder / "model.safetensors")
    with pytest.raises(WeightsError, match=r"'transformer\.ln_f\.weight' has dtype C64"):
        load(f"huginn:{folder}")


def test_nan_in_llama2c_rope_tables_is_refused_naming_the_table(tmp_path):
    def poison(table: torch.Tensor) -> torch.Tensor:
        table[1, 0] = math.nan
        return table

    good = write_llama2c(tmp_path / "good.bin")
    assert load(f"llama2c:{good}").cfg.d_model == 8
    bad = write_llama2c(tmp_path / "bad.bin", tables=poison)
    with pytest.raises(WeightsError, match="'freq_cis_real' holds 1 non-finite"):
        load(f"llama2c:{bad}")


# ------------------------------------------------------------------- devices and dtypes


def test_an_unavailable_device_is_one_clear_error_in_every_loader(tmp_path):
    save_tiny_model(tmp_path / "model")
    attempts = [
        lambda: HookedRecurrentTransformer.from_pretrained(
            tmp_path / "model", device=ABSENT_DEVICE
        ),
        lambda: load(str(tmp_path / "model"), device=ABSENT_DEVICE),
        lambda: load(f"huginn:{data_path('fixtures', 'huginn_tiny')}", device=ABSENT_DEVICE),
        lambda: load(f"ouro:{data_path('fixtures', 'ouro_tiny')}", device=ABSENT_DEVICE),
        lambda: load(f"llama2c:{data_path('stories260K')}", device=ABSENT_DEVICE),
    ]
    for attempt in attempts:
        with pytest.raises(DeviceError, match=rf"device '{ABSENT_DEVICE}' is not available; "):
            attempt()
    with pytest.raises(DeviceError, match="'tpu9' is not a device name; available here: cpu"):
        check_device("tpu9")
    with pytest.raises(DeviceError, match="dtype=torch.int32 is not one of"):
        load(f"huginn:{data_path('fixtures', 'huginn_tiny')}", dtype=torch.int32)


def test_an_unavailable_device_fails_train_experiment_and_bench_before_work(tmp_path):
    from dcp_lens.studies.bench import run_bench
    from dcp_lens.studies.intervention import run_training_intervention
    from dcp_lens.training import preset, train

    with pytest.raises(DeviceError, match="is not available"):
        train(preset("tiny", device=ABSENT_DEVICE), tmp_path / "train", progress=False)
    assert not (tmp_path / "train" / "checkpoint").exists()
    with pytest.raises(DeviceError, match="is not available"):
        run_training_intervention(tmp_path / "experiment", preset="tiny", device=ABSENT_DEVICE)
    with pytest.raises(DeviceError, match="is not available"):
        run_bench(device=ABSENT_DEVICE)


@pytest.mark.parametrize("command", ["run", "experiment training-intervention", "bench"])
def test_cli_refuses_an_unavailable_device_in_one_line(capsys, tmp_path, command):
    argv = [*command.split(), "--device", ABSENT_DEVICE]
    argv += [] if command == "bench" else ["--out", str(tmp_path / "out")]
    assert "is not available; available here: cpu" in one_line_error(capsys, argv)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------- late failures, now early


def test_train_out_on_an_existing_file_is_refused_up_front(capsys, tmp_path):
    existing = tmp_path / "taken"
    existing.write_text("not a folder")
    err = one_line_error(capsys, ["train", "--preset", "tiny", "--out", str(existing)])
    assert "is an existing file, not a folder" in err


def test_bench_with_a_sequence_that_cannot_fit_fails_before_allocating(capsys, monkeypatch):
    import dcp_lens.studies.bench

    real = dcp_lens.studies.bench.HookedRecurrentTransformer

    def no_model(*args, **kwargs):
        # Counting parameters on the meta device allocates nothing; a real model would.
        if torch.empty(0).device.type != "meta":
            raise AssertionError("the bench built its model before checking the sizes")
        return real(*args, **kwargs)

    monkeypatch.setattr(dcp_lens.studies.bench, "HookedRecurrentTransformer", no_model)
    err = one_line_error(capsys, ["bench", "--seq", "100000"])
    assert "lower the sequence length, the batch or the model size" in err


def test_resume_over_a_truncated_checkpoint_names_it_and_how_to_recover(tmp_path):
    from dcp_lens.training import preset, train

    config = preset("tiny", steps=4, checkpoint_interval=2, eval_interval=2)
    train(config, tmp_path, stop_at_step=2, progress=False)
    tensors = tmp_path / "checkpoint" / "state.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:100])
    with pytest.raises(
        DamagedFileError, match=r"state\.safetensors is not a readable .*--no-resume"
    ):
        train(config, tmp_path, progress=False)
    (tmp_path / "checkpoint" / "trainer_state.json").write_text('{"step": ')
    with pytest.raises(DamagedFileError, match=r"trainer_state\.json is not valid JSON"):
        train(config, tmp_path, progress=False)


def test_results_json_truncated_names_the_file_and_how_to_recover(tmp_path):
    (tmp_path / "results.json").write_text('{"runs": [{"model": "default", ')
    with pytest.raises(DamagedFileError, match=r"results\.json is not valid JSON .*Delete it"):
        ProtocolResults.load(tmp_path)


# ------------------------------------------------------------------- hooks across views


@pytest.mark.parametrize("permanent", [False, True])
def test_reset_hooks_removes_hooks_left_on_blocks_of_another_view(permanent):
    model = HookedRecurrentTransformer(tiny_config(n_iterations=4)).eval()
    tokens = torch.randint(0, 20, (1, 6))
    fired: list[str] = []

    def record(tensor: torch.Tensor, hook) -> None:
        fired.append(hook.name)

    with model.iterations(8):
        name = model.hook_name(7, 0, "hook_resid_post")  # a block that exists only at k = 8
        model.add_hook(name, record, is_permanent=permanent)
    model.reset_hooks(including_permanent=permanent)
    model(tokens, n_iterations=8)
    assert fired == []
    model.run_with_hooks(tokens, n_iterations=8, fwd_hooks=[(name, record)], reset_hooks_end=False)
    assert fired == [name]
    model.reset_hooks()
    model(tokens, n_iterations=8)
    assert fired == [name]


def test_reset_hooks_clears_contexts_and_keeps_permanent_hooks_unless_told():
    model = HookedRecurrentTransformer(tiny_config(n_iterations=4)).eval()
    tokens = torch.randint(0, 20, (1, 6))
    name = model.hook_name(3, 0, "hook_resid_post")
    fired: list[str] = []

    def remember(tensor: torch.Tensor, hook) -> None:
        hook.ctx["seen"] = True
        fired.append(hook.name)

    model.add_hook(name, remember, is_permanent=True)
    model(tokens)
    point = model.hook_dict[name]
    assert point.ctx == {"seen": True}
    model.reset_hooks(clear_contexts=False)
    assert point.ctx == {"seen": True}
    model.reset_hooks()  # clears contexts; permanent hooks stay
    assert point.ctx == {}
    model(tokens)
    assert fired == [name, name]
    model.reset_hooks(including_permanent=True)
    model(tokens)
    assert fired == [name, name]


# ------------------------------------------------------------------- huge declared sizes


def test_save_pretrained_folder_checks_shapes_before_building_the_model(tmp_path, monkeypatch):
    save_tiny_model(tmp_path)
    rewrite_json(tmp_path / "config.json", d_vocab=2_000_000)
    initialise = HookedRecurrentTransformer._init_weights

    def only_on_meta(model: HookedRecurrentTransformer) -> None:
        # Building it first took 18 s and 3.4 GB: nothing may be materialised before the check.
        assert all(p.device.type == "meta" for p in model.parameters()), "materialised first"
        initialise(model)

    monkeypatch.setattr(HookedRecurrentTransformer, "_init_weights", only_on_meta)
    with pytest.raises(WeightsError, match=r"'embed\.W_E' has shape \(20, 16\), expected"):
        HookedRecurrentTransformer.from_pretrained(tmp_path)
    monkeypatch.setattr(HookedRecurrentTransformer, "_init_weights", initialise)
    rewrite_json(tmp_path / "config.json", d_vocab=10**10)
    with pytest.raises(ResourceLimitError, match="d_vocab=10000000000 exceeds"):
        HookedRecurrentTransformer.from_pretrained(tmp_path)


def test_block_size_and_iteration_counts_are_bounded_before_allocation(tmp_path):
    folder = shutil.copytree(data_path("fixtures", "huginn_tiny"), tmp_path / "huginn")
    (folder / "config.json").chmod(0o644)
    rewrite_json(folder / "config.json", block_size=10**10)
    with pytest.raises(ResourceLimitError, match="n_ctx=10000000000 exceeds"):
        load(f"huginn:{folder}")
    save_tiny_model(tmp_path / "model")
    model = load(str(tmp_path / "model"))
    copies = len(model._core)
    with pytest.raises(ResourceLimitError, match="n_iterations=10000 exceeds"):
        load(str(tmp_path / "model"), n_iterations=10_000)
    with pytest.raises(ResourceLimitError, match="n_iterations=10000 exceeds"):
        model(torch.zeros(1, 3, dtype=torch.long), n_iterations=10_000)
    assert len(model._core) == copies  # refused before a single block was unrolled


# ------------------------------------------------------------------- pickle and links


def test_bridge_refuses_pickle_weights_without_torchs_unsafe_advice(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")  # a pickle of 1
    with pytest.raises(WeightsError, match="pickle-based checkpoint") as caught:
        load(f"bridge:{tmp_path}")
    assert "weights_only" not in str(caught.value)
    (tmp_path / "config.json").write_text("[]")
    with pytest.raises(ConfigError, match=r"config\.json must hold a JSON object"):
        load(f"bridge:{tmp_path}")


def test_weight_files_linked_from_outside_the_folder_are_refused(tmp_path):
    outside = save_tiny_model(tmp_path / "outside")
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(outside / "config.json", folder / "config.json")
    (folder / "model.safetensors").symlink_to(outside / "model.safetensors")
    with pytest.raises(WeightsError, match="links to .* outside"):
        HookedRecurrentTransformer.from_pretrained(folder)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(data_path("fixtures", "huginn_tiny") / "config.json", sharded / "config.json")
    huginn = data_path("fixtures", "huginn_tiny") / "model.safetensors"
    (sharded / "shard-1.safetensors").symlink_to(huginn)
    keys = list(load_file(huginn))
    index = {"weight_map": dict.fromkeys(keys, "shard-1.safetensors")}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightsError, match=r"shard-1\.safetensors links to .* outside"):
        load(f"huginn:{sharded}")
    linked = tmp_path / "llama"
    linked.mkdir()
    (linked / "model.bin").symlink_to(write_llama2c(tmp_path / "elsewhere.bin"))
    with pytest.raises(WeightsError, match="links to .* outside"):
        load(f"llama2c:{linked}")


# ------------------------------------------------------------------- silent oddities


@pytest.mark.parametrize("flag", ["--model", "--k", "--dense", "--metrics"])
def test_empty_cli_values_are_errors_not_defaults(capsys, tmp_path, flag):
    err = one_line_error(capsys, ["run", flag, "", "--out", str(tmp_path / "out")])
    assert f"{flag} is empty" in err


def tiny_protocol_sets(model, n_eval: int, n_calibration: int) -> tuple[EvaluationSet, ...]:
    task = model.planted_task
    return task.evaluation(n_eval), task.calibration(n_calibration)


def test_one_calibration_sequence_falls_back_with_a_warning_the_results_record():
    model = load("planted:readout_shift")
    evaluation, calibration = tiny_protocol_sets(model, 32, 1)
    protocol = DepthControlProtocol(model, n_bootstrap=10, probe="none", progress=False)
    with pytest.warns(CalibrationFallbackWarning, match="mode 'full' needs at least"):
        results = protocol.run(evaluation, calibration)
    assert results.metadata["calibration_fallbacks"]
    assert all(
        note.endswith(("diag", "mean")) for note in results.metadata["calibration_fallbacks"]
    )
    enough = protocol.run(*tiny_protocol_sets(model, 32, 256))
    assert enough.metadata["calibration_fallbacks"] == []


def test_nan_weights_never_read_as_a_passing_null_control():
    model = HookedRecurrentTransformer(tiny_config()).eval()
    with torch.no_grad():
        model.W_U_untied.fill_(math.nan)
    tokens = torch.randint(0, 20, (16, 8), generator=torch.Generator().manual_seed(0))
    evaluation = EvaluationSet.from_tokens(tokens[:8])
    calibration = EvaluationSet.from_tokens(tokens[8:])
    protocol = DepthControlProtocol(model, n_bootstrap=5, probe="none", progress=False)
    results = protocol.run(evaluation, calibration)
    assert math.isnan(results.null_control["max_abs_logit_diff"])


# ------------------------------------------------------------------- partial output


def test_a_run_that_fails_its_checks_leaves_no_folder(capsys, tmp_path):
    out = tmp_path / "out"
    argv = ["run", "--model", "planted:readout_shift", "--dense", "no-such-model"]
    argv += ["--out", str(out), *SMALL, "--quiet"]
    assert "unknown model spec 'no-such-model'" in one_line_error(capsys, argv)
    assert not out.exists()


def test_a_run_refused_by_the_sweeps_own_checks_leaves_no_folder(capsys, tmp_path, monkeypatch):
    def refuse(*_: object) -> None:
        raise ValueError("the calibration split overlaps the evaluation split")

    monkeypatch.setattr(DepthControlProtocol, "run", refuse)
    out = tmp_path / "out"
    argv = ["run", "--model", "planted:readout_shift", "--out", str(out), *SMALL]
    assert "overlaps" in one_line_error(capsys, argv)
    assert not out.exists()


def test_a_run_stopped_after_its_first_model_is_marked_incomplete_and_resumes(
    capsys, tmp_path, monkeypatch
):
    import dcp_lens.utils.snapshots as snapshots

    def stop_after_first_model(point: str) -> None:
        if point == "model:1":
            raise KeyboardInterrupt

    out = tmp_path / "out"
    argv = ["run", "--out", str(out), *SMALL, "--quiet"]  # default, then default-dense
    with monkeypatch.context() as patch:
        patch.setattr(snapshots, "die_if_asked", stop_after_first_model)
        assert main(argv) == 130
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "stopped by SIGINT" in err and "--resume" in err, err
    assert (out / "default" / "results.json").is_file()
    assert not (out / "default-dense").exists() and not (out / "results.json").exists()
    with pytest.raises(IncompleteRunError, match="marked incomplete .*Rerun the command"):
        ProtocolResults.load(out / "default")
    assert main([*argv, "--resume"]) == 0
    assert ProtocolResults.load(out / "default-dense").model == "default-dense"
    assert (out / "results.json").is_file() and not (out / "INCOMPLETE").exists()


def test_every_library_error_is_a_value_error():
    for error in (ConfigError, ConfigTypeError, DamagedFileError, DeviceError, WeightsError):
        assert issubclass(error, DCPLensError) and issubclass(error, ValueError)
    assert issubclass(ConfigTypeError, TypeError)


# ------------------------------------------------------------ outputs, folders, faults, last inputs


def run_argv(out: Path, *extra: str) -> list[str]:
    return ["run", "--model", "planted:readout_shift", *SMALL, "--quiet", "--out", str(out), *extra]


def tree(folder: Path) -> dict[str, str]:
    """Every file below ``folder`` (relative path -> content hash)."""
    import hashlib

    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished planted run (copied by tests that change it)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(run_argv(out)) == 0
    return out


def test_model_folder_names_never_leave_the_output_folder():
    from dcp_lens.utils.files import safe_name

    for spec in ("..", ".", "", "/", "../../etc", "/abs/path", "huginn:../x", ".hidden", "a/../.."):
        name = safe_name(spec)
        assert name and not name.startswith(".") and "/" not in name, (spec, name)
        assert (Path("/out") / name).resolve().parent == Path("/out"), (spec, name)


def test_a_model_given_as_a_parent_path_writes_inside_out(capsys, tmp_path, monkeypatch):
    from dcp_lens.zoo.bundled import bundled_path

    model = shutil.copytree(bundled_path("default"), tmp_path / "model")
    (model / "sub").mkdir()
    before = tree(tmp_path / "model")
    monkeypatch.chdir(model / "sub")
    out = tmp_path / "out"
    assert main(["run", "--model", "..", *SMALL, "--quiet", "--out", str(out)]) == 0
    assert tree(tmp_path / "model") == before  # nothing written beside the model or --out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]
    assert (out / "__" / "results.json").is_file()


@pytest.mark.parametrize("target", ["results.json", "planted_readout_shift/shares.csv", "sub"])
def test_report_refuses_an_out_that_would_overwrite_the_run(capsys, tmp_path, finished_run, target):
    run = shutil.copytree(finished_run, tmp_path / "run")
    before = tree(run)
    out = run / target
    if target == "sub":  # a folder holding a file of another kind named report.html
        out.mkdir()
        (out / "report.html").write_text("not a report")
        before = tree(run)
    err = one_line_error(capsys, ["report", str(run), "--out", str(out)])
    assert "--out" in err and ("html" in err or "not a report" in err), err
    assert tree(run) == before
    assert main(["report", str(run)]) == 0  # the run is intact and still reads


def test_report_writes_a_new_html_file_and_replaces_its_own(capsys, tmp_path, finished_run):
    run = shutil.copytree(finished_run, tmp_path / "run")
    assert main(["report", str(run), "--out", str(tmp_path / "copy.html")]) == 0
    assert main(["report", str(run), "--out", str(tmp_path / "copy.html")]) == 0
    assert "<html" in (tmp_path / "copy.html").read_text().lower()


def test_overwrite_with_a_bad_argument_leaves_the_finished_run_readable(
    capsys, tmp_path, finished_run
):
    run = shutil.copytree(finished_run, tmp_path / "run")
    before = tree(run)
    argv = ["run", "--model", "planted:no_such", *SMALL, "--out", str(run), "--overwrite"]
    assert "unknown planted model" in one_line_error(capsys, argv)
    assert tree(run) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no sibling left either
    ProtocolResults.load(run / "planted_readout_shift")


def test_overwrite_replaces_the_run_whole_and_leaves_no_sibling(capsys, tmp_path, finished_run):
    """Every file the old run wrote (its manifest lists them) goes; a file added since stays."""
    run = shutil.copytree(finished_run, tmp_path / "run")
    from dcp_lens.utils.ownership import identity

    (run / "stale.txt").write_text("a file of the old run")
    manifest = json.loads((run / ".dcp-lens.json").read_text())
    manifest["files"]["stale.txt"] = identity((run / "stale.txt").stat(), run / "stale.txt")
    (run / ".dcp-lens.json").write_text(json.dumps(manifest))
    (run / "notes.txt").write_text("the user's")
    argv = run_argv(run, "--overwrite", "--seed", "3")
    assert main(argv) == 0
    assert not (run / "stale.txt").exists() and not (run / "INCOMPLETE").exists()
    assert (run / "notes.txt").read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert json.loads((run / "results.json").read_text())["runs"][0]["metadata"]["seed"] == 3


def test_overwrite_stopped_midway_keeps_the_old_finished_run(
    capsys, tmp_path, finished_run, monkeypatch
):
    import dcp_lens.utils.snapshots as snapshots

    def stop(point: str) -> None:
        if point == "model:1":
            raise KeyboardInterrupt

    run = shutil.copytree(finished_run, tmp_path / "run")
    before = tree(run)
    monkeypatch.setattr(snapshots, "die_if_asked", stop)
    assert main(run_argv(run, "--overwrite", "--seed", "3")) == 130
    assert "stopped by SIGINT" in capsys.readouterr().err
    assert tree(run) == before  # the old run, whole; the new one waits beside it, incomplete
    monkeypatch.undo()
    assert main(run_argv(run, "--overwrite", "--seed", "3")) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_second_run_into_a_busy_out_is_refused_by_the_lock(capsys, tmp_path):
    from dcp_lens.utils.locks import FolderLock

    out = tmp_path / "out"
    with FolderLock(out):
        err = one_line_error(capsys, run_argv(out))
    assert "is being written by another dcp-lens process" in err
    assert main(run_argv(out)) == 0  # the lock is gone with its holder


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGHUP", "SIGQUIT"])
def test_stop_signals_end_the_run_in_one_line_and_it_resumes(capsys, tmp_path, monkeypatch, signum):
    import os
    import signal

    import dcp_lens.utils.snapshots as snapshots

    def stop(point: str) -> None:
        if point == "calibration:1":
            os.kill(os.getpid(), getattr(signal, signum))

    out = tmp_path / "out"
    monkeypatch.setattr(snapshots, "die_if_asked", stop)
    code = main(run_argv(out, "--checkpoint-every", "1", "--batch-size", "8"))
    assert code == 128 + getattr(signal, signum)
    err = capsys.readouterr().err.strip()
    assert err == err.splitlines()[0] and f"stopped by {signum}" in err and "--resume" in err
    assert (out / "INCOMPLETE").is_file()
    monkeypatch.undo()
    assert main(run_argv(out, "--checkpoint-every", "1", "--batch-size", "8", "--resume")) == 0


@pytest.fixture
def interrupted_run(tmp_path, monkeypatch) -> Path:
    """A run stopped after its first calibration snapshot (snapshots on disk)."""
    import dcp_lens.utils.snapshots as snapshots

    def stop(point: str) -> None:
        if point == "calibration:1":
            raise KeyboardInterrupt

    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        patch.setattr(snapshots, "die_if_asked", stop)
        assert main(run_argv(out, "--checkpoint-every", "1", "--batch-size", "8")) == 130
    assert list((out / ".checkpoints").rglob("calibration*.pt"))
    return out


@pytest.mark.parametrize("damage", ["empty", "random", "foreign", "pickled", "state"])
def test_damaged_snapshots_name_the_file_and_say_start_again(capsys, interrupted_run, damage):
    snapshot = next((interrupted_run / ".checkpoints").rglob("calibration*.pt"))
    if damage == "empty":
        snapshot.write_bytes(b"")
    elif damage == "random":
        snapshot.write_bytes(bytes(range(256)) * 7)
    elif damage == "foreign":
        torch.save(torch.zeros(3, 3), snapshot)
    elif damage == "pickled":
        torch.save({"done": 1, "state": math.sqrt}, snapshot)  # not loadable with weights_only
    else:
        torch.save({"done": 1, "state": {"unexpected": torch.zeros(2)}}, snapshot)
    capsys.readouterr()
    argv = run_argv(interrupted_run, "--checkpoint-every", "1", "--batch-size", "8", "--resume")
    err = one_line_error(capsys, argv)
    assert "without --resume" in err and str(snapshot.parent) in err, err


def test_a_command_json_that_is_a_list_is_refused_on_resume(capsys, interrupted_run):
    (interrupted_run / ".checkpoints" / "command.json").write_text("[1, 2]")
    capsys.readouterr()
    argv = run_argv(interrupted_run, "--checkpoint-every", "1", "--batch-size", "8", "--resume")
    err = one_line_error(capsys, argv)
    assert "command.json must hold a JSON object" in err and "without --resume" in err


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("[1]", "must hold a JSON object"),
        ('"a string"', "must hold a JSON object"),
        ('{"add_bos_token": "false"}', "add_bos_token='false' must be true or false"),
        ('{"bos_token": 5}', "bos_token=5 must be the token's string"),
    ],
)
def test_huginn_tokenizer_config_is_checked(tmp_path, content, expected):
    folder = shutil.copytree(data_path("fixtures", "huginn_tiny"), tmp_path / "huginn")
    (folder / "tokenizer_config.json").chmod(0o644)
    (folder / "tokenizer_config.json").write_text(content)
    with pytest.raises(ConfigError, match=expected):
        load(f"huginn:{folder}")


def test_huginn_add_bos_token_false_is_read_as_false(tmp_path):
    folder = shutil.copytree(data_path("fixtures", "huginn_tiny"), tmp_path / "huginn")
    (folder / "tokenizer_config.json").chmod(0o644)
    rewrite_json(folder / "tokenizer_config.json", add_bos_token=False)
    assert load(f"huginn:{folder}").tokenizer.prepends_bos is False


def test_huginn_vocab_size_past_its_weights_is_refused(tmp_path):
    folder = shutil.copytree(data_path("fixtures", "huginn_tiny"), tmp_path / "huginn")
    (folder / "config.json").chmod(0o644)
    rewrite_json(folder / "config.json", vocab_size=300)
    with pytest.raises(ConfigError, match="vocab_size=300 is larger than padded_vocab_size=256"):
        load(f"huginn:{folder}")


@pytest.fixture(scope="module")
def training_checkpoint(tmp_path_factory) -> Path:
    from dcp_lens.training import preset, train

    out = tmp_path_factory.mktemp("train") / "run"
    train(preset("tiny", steps=4), out, stop_at_step=2, progress=False)
    return out


@pytest.mark.parametrize(
    "field", ["parameter_names", "param_groups", "step", "history", "format", "rng"]
)
def test_a_training_state_missing_a_field_is_refused(tmp_path, training_checkpoint, field):
    from safetensors.torch import load_file, save_file

    from dcp_lens.training import preset, train

    out = shutil.copytree(training_checkpoint, tmp_path / "run")
    if field == "rng":
        tensors = load_file(out / "checkpoint" / "state.safetensors")
        del tensors["rng.sampler"]
        save_file(tensors, out / "checkpoint" / "state.safetensors")
    else:
        state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
        del state[field]
        (out / "checkpoint" / "trainer_state.json").write_text(json.dumps(state))
    expected = "rng.sampler" if field == "rng" else field
    with pytest.raises(DamagedFileError, match=rf"{expected}.*--no-resume"):
        train(preset("tiny", steps=4), out, progress=False)


def test_report_on_a_report_data_that_is_a_list_is_one_line(capsys, tmp_path, finished_run):
    run = shutil.copytree(finished_run, tmp_path / "run")
    (run / "report_data.json").write_text("[]")
    err = one_line_error(capsys, ["report", str(run)])
    assert "report_data.json must hold a JSON object" in err


def small_sets(model):
    from dcp_lens.protocol.dcp import task_data

    return task_data(model, None, 16, 16, 0)


@pytest.mark.parametrize("value", ["vocab", -5])
def test_targets_outside_the_vocabulary_are_refused(value):
    model = load("planted:readout_shift")
    evaluation, calibration = small_sets(model)
    targets = evaluation.targets.clone()
    targets[targets != -100] = model.cfg.d_vocab + 3 if value == "vocab" else value
    with pytest.raises(DCPLensError, match="outside the vocabulary"):
        bad = EvaluationSet(evaluation.tokens, targets, evaluation.attention_mask)
        DepthControlProtocol(model, n_bootstrap=5, probe="none", progress=False).run(
            bad, calibration
        )


@pytest.mark.parametrize(
    ("tokens", "expected"),
    [
        (torch.zeros(0, 5, dtype=torch.long), r"\[batch >= 1, pos >= 1\]"),
        (torch.zeros(2, 0, dtype=torch.long), r"\[batch >= 1, pos >= 1\]"),
        (torch.zeros(2, 5, dtype=torch.long, device="meta"), "meta device"),
    ],
)
def test_empty_or_meta_tokens_are_refused(tokens, expected):
    with pytest.raises(DCPLensError, match=expected):
        load("planted:readout_shift")(tokens)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_and_unknown_keywords_are_one_clear_error():
    model = load("planted:readout_shift")
    for attempt in (
        lambda: load("planted:readout_shift", device="cuda"),
        lambda: model.to("cuda"),
        lambda: model.cuda(),
    ):
        with pytest.raises(DeviceError, match="'cuda' is not available"):
            attempt()
    with pytest.raises(ConfigError, match="takes no bogus; its options are"):
        load("planted:readout_shift", bogus=1)


def test_a_forward_larger_than_free_memory_is_refused_before_allocating(monkeypatch):
    import dcp_lens.model.hooked_recurrent_transformer as module

    model = HookedRecurrentTransformer(tiny_config(n_ctx=40_000))
    monkeypatch.setattr(module, "available_memory_bytes", lambda: 1 << 30)
    with pytest.raises(ResourceLimitError, match=r"tokens \[1, 30000\] need about .* GiB"):
        model(torch.zeros(1, 30_000, dtype=torch.long))


def test_a_dense_control_of_another_task_is_refused(capsys, tmp_path):
    from dcp_lens.zoo.bundled import bundled_path

    dense = shutil.copytree(bundled_path("default-dense"), tmp_path / "dense")
    task = json.loads((dense / "task.json").read_text())
    task["seed"] = int(task.get("seed", 0)) + 1
    (dense / "task.json").write_text(json.dumps(task))
    out = tmp_path / "out"
    argv = ["run", "--model", "default", "--dense", str(dense), *SMALL, "--out", str(out)]
    assert "would be evaluated on --model's data, but its task" in one_line_error(capsys, argv)
    assert not out.exists()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["bench", "--d-model", "7"], "--d-model 7 does not split into"),
        (["bench", "--d-model", "100"], "--d-model 100 does not split into"),
        (["validate", "--models", ""], "--models is empty"),
        (["validate", "--models", ","], "--models ',' names nothing"),
        (["train", "--steps", "1000000000000"], "--steps 1000000000000 is past"),
        (["train", "--steps", "1e12"], "invalid int value"),
        (["run", "--n-eval", "30000000"], "--n-eval 30000000 is past"),
        (["run", "--n-eval", "3e7"], "invalid int value"),
        (["run", "--threads", "100000"], "--threads 100000 is more than this machine"),
        (["run", "--task", "text:/dev/zero"], "is a device, pipe or socket"),
        (["run", "--task", "char_lm:/dev/zero"], "is a device, pipe or socket"),
    ],
)
def test_last_argument_cases_are_one_line_before_work(capsys, tmp_path, argv, expected):
    needs_out = argv[0] in ("run", "train")
    out = tmp_path / "out"
    argv = [*argv, "--out", str(out)] if needs_out else argv
    try:
        err = one_line_error(capsys, argv)
    except SystemExit as stop:  # argparse's own refusal (a float for an int)
        assert stop.code == 2
        err = capsys.readouterr().err
    assert expected in err, err
    assert not out.exists()


def test_a_fifo_corpus_without_max_tokens_is_refused(capsys, tmp_path):
    import os

    fifo = tmp_path / "corpus.fifo"
    os.mkfifo(fifo)
    argv = ["run", "--task", f"text:{fifo}", "--out", str(tmp_path / "out")]
    assert "is a device, pipe or socket" in one_line_error(capsys, argv)


def test_an_endless_corpus_with_max_tokens_reads_only_what_it_uses(tmp_path, monkeypatch):
    import dcp_lens.tasks.text as text

    monkeypatch.setenv("DCP_LENS_CACHE", str(tmp_path / "cache"))

    def never(*_: object) -> str:
        raise AssertionError("the whole corpus was hashed")

    monkeypatch.setattr(text, "_content_hash", never)
    model = load(f"huginn:{data_path('fixtures', 'huginn_tiny')}")
    task = text.text_task(model, "/dev/zero", max_tokens=300, seq_len=8)
    assert task.n_tokens == 300


# ----------------------------------------- ProtocolConfig (protocol/config.py checks every setting)


@pytest.mark.parametrize(
    "settings",
    [
        {"seed": "0"},
        {"seed": None},
        {"batch_size": "8"},
        {"k_grid": ["1"]},
        {"k_grid": [1.5]},
        {"n_bootstrap": "10"},
        {"n_bootstrap": -1},
    ],
    ids=str,
)
def test_protocol_settings_of_the_wrong_type_are_refused(settings):
    with pytest.raises(DCPLensError):
        DepthControlProtocol(load("planted:readout_shift"), **settings)


def test_a_protocol_without_a_model_is_refused():
    with pytest.raises(DCPLensError):
        DepthControlProtocol(None)


# ------------------------------------------------- one folder contract, atomic writes, bounds


def test_atomic_writes_from_threads_leave_one_whole_file(tmp_path):
    """Four threads writing one path 200 times each: no error, the file is one writer's whole
    text, no temporary file is left beside it."""
    import threading

    from dcp_lens.utils.files import write_text_atomically

    path, errors = tmp_path / "shared.json", []

    def writer(index: int) -> None:
        for round_ in range(200):
            try:
                write_text_atomically(path, json.dumps({"writer": index, "round": round_}) * 50)
            except Exception as error:  # the property: none
                errors.append(error)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    text = path.read_text()
    assert text == text[: len(text) // 50] * 50 and json.loads(text[: len(text) // 50])
    assert [p.name for p in tmp_path.iterdir()] == ["shared.json"]
    assert oct(path.stat().st_mode & 0o777) != oct(0o600)  # not mkstemp's private mode


def test_a_full_disk_names_itself_and_leaves_the_old_file(tmp_path, monkeypatch):
    import errno
    import os

    from dcp_lens.utils import files

    path = files.write_text_atomically(tmp_path / "validation.json", "old\n")

    def full(descriptor: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(ResourceLimitError, match=r"no space left on .* while writing .*validation"):
        files.write_text_atomically(path, "new\n" * 1000)
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == [path.name]
    # a library's own words for it (safetensors' SafetensorError, torch's short write)
    with pytest.raises(ResourceLimitError, match="no space left"):
        with files.naming_full_disk(tmp_path / "model"):
            raise RuntimeError('IoError(Os { code: 28, kind: StorageFull, message: "No space left"')


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("contract") / "run"
    assert (
        main(["run", "--model", "planted:readout_shift", *SMALL, "--quiet", "--out", str(out)]) == 0
    )
    return out


def test_overwrite_keeps_the_users_files_and_follows_a_link(tmp_path, capsys, finished):
    run = shutil.copytree(finished, tmp_path / "run", symlinks=True)
    (run / "my_notes.txt").write_text("mine")
    (run / "analysis").mkdir()
    (run / "analysis" / "fig.png").write_bytes(b"\x89PNG")
    link = tmp_path / "link"
    link.symlink_to(run)
    err = one_line_error(
        capsys,
        [
            "run",
            "--model",
            "planted:readout_shift",
            *SMALL,
            "--quiet",
            "--seed",
            "3",
            "--out",
            str(link),
        ],
    )
    assert "finished" in err and "--overwrite" in err
    argv = [
        "run",
        "--model",
        "planted:readout_shift",
        *SMALL,
        "--quiet",
        "--seed",
        "3",
        "--overwrite",
        "--out",
        str(link),
    ]
    assert main(argv) == 0
    assert link.is_symlink() and (run / "my_notes.txt").read_text() == "mine"
    assert (run / "analysis" / "fig.png").read_bytes() == b"\x89PNG"
    seeds = {r["metadata"]["seed"] for r in json.loads((run / "results.json").read_text())["runs"]}
    assert seeds == {3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "run"]  # no .replacing left


@pytest.mark.parametrize("command", ["run", "train", "validate", "experiment", "report", "save"])
def test_every_writer_refuses_a_folder_of_the_users_files(tmp_path, capsys, finished, command):
    """A folder holding files no dcp-lens command wrote is refused, naming what is there."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "validation.md").write_text("my notes")
    (out / "plotly.min.js").write_text("my script")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    argv = {
        "run": ["run", "--model", "planted:readout_shift", *SMALL, "--quiet", "--out", str(out)],
        "train": ["train", "--preset", "tiny", "--steps", "1", "--out", str(out)],
        "validate": [
            "validate",
            "--models",
            "readout_shift",
            "--n-eval",
            "16",
            "--n-calibration",
            "16",
            "--bootstrap",
            "5",
            "--quiet",
            "--out",
            str(out),
        ],
        "experiment": [
            "experiment",
            "training-intervention",
            "--preset",
            "tiny",
            "--seeds",
            "0",
            "--out",
            str(out),
        ],
        "report": ["report", str(finished), "--out", str(out)],
    }
    if command == "save":
        results = ProtocolResults.load(finished / "planted_readout_shift")
        with pytest.raises(ConfigError, match="did not write"):
            results.save(out)
    else:
        err = one_line_error(capsys, argv[command])
        assert "did not write" in err and "validation.md" in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_report_to_a_file_touches_nothing_beside_it(tmp_path, capsys, finished):
    folder = tmp_path / "d"
    folder.mkdir()
    for name, text in (("plotly.min.js", "mine"), (".lock", "my lock"), ("notes.txt", "x")):
        (folder / name).write_text(text)
    assert main(["report", str(finished), "--out", str(folder / "r.html")]) == 0
    assert sorted(p.name for p in folder.iterdir()) == [
        ".lock",
        "notes.txt",
        "plotly.min.js",
        "r.html",
        "r_files",
    ]
    assert (folder / "plotly.min.js").read_text() == "mine"
    assert (folder / ".lock").read_text() == "my lock"
    page = (folder / "r.html").read_text()
    assert "src='r_files/plotly.min.js'" in page  # its own copy, in the folder it owns
    results = ProtocolResults.load(finished / "planted_readout_shift")
    for bad in (finished / "results.json", tmp_path / "x.txt"):
        before = bad.read_bytes() if bad.exists() else None
        with pytest.raises(ConfigError):
            results.report(bad)
        assert (bad.read_bytes() if bad.exists() else None) == before
    run_copy = shutil.copytree(finished, tmp_path / "run")
    with pytest.raises(ConfigError, match="run"):
        results.save(run_copy)  # a run folder is not a save folder: its results.json stays
    assert (run_copy / "results.json").read_bytes() == (finished / "results.json").read_bytes()


@pytest.mark.parametrize(
    "offset",
    [1.5, pytest.param(0.0, marks=pytest.mark.slow), pytest.param(6.0, marks=pytest.mark.slow)],
)
def test_two_runs_into_one_folder_exactly_one_finishes(tmp_path, offset):
    """Two runs into one --out, the second started ``offset`` seconds after the first (while it
    loads, writes or has finished): one exits 0, the other 2 (busy or finished), and the folder
    holds the winner's run, whole."""
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parents[2]
    code = "import sys; from dcp_lens.cli import main; raise SystemExit(main(sys.argv[1:]))"
    env = {**__import__("os").environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    for out in (tmp_path / "out",):
        processes = []
        for seed in (1, 2):
            argv = [
                "run",
                "--model",
                "planted:readout_shift",
                *SMALL,
                "--quiet",
                "--seed",
                str(seed),
                "--out",
                str(out),
            ]
            process = subprocess.Popen(
                [sys.executable, "-c", code, *argv],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            processes.append(process)
            time.sleep(offset)
        codes = [p.wait(timeout=300) for p in processes]
        errors = [p.stderr.read().decode() for p in processes if p.stderr is not None]
        assert sorted(codes) == [0, 2], (codes, errors)
        loser = errors[codes.index(2)]
        assert "another dcp-lens process" in loser or "finished" in loser, loser
        winner = codes.index(0) + 1
        runs = json.loads((out / "results.json").read_text())["runs"]
        assert {r["metadata"]["seed"] for r in runs} == {winner}
        assert not (out / "INCOMPLETE").exists()


def test_sizes_set_by_flags_and_files_are_refused_before_allocation(tmp_path, capsys):
    from dcp_lens.tasks import check_task_config

    out, experiment = ["--out", str(tmp_path / "o")], ["--out", str(tmp_path / "e")]
    for argv, words in (
        (["validate", "--coverage", str(10**9), "--quiet"], "--coverage"),
        (["run", "--calibration-groups", "1000000", *out], "calibration_groups"),
        (["run", "--seed", str(2**63), *out], "2**63"),
        (["experiment", "training-intervention", "--seeds", f"0,{2**64}", *experiment], "2**63"),
        (["run", "--text-field", "body", *out], "--text-field"),
    ):
        assert words in one_line_error(capsys, argv)
    assert not (tmp_path / "o").exists() and not (tmp_path / "e").exists()
    with pytest.raises(ResourceLimitError, match="n_ctx"):
        check_task_config({"name": "char_lm", "path": "x", "n_ctx": 10**9}, "task.json")
    with pytest.raises(ResourceLimitError, match="n_bootstrap"):
        DepthControlProtocol(load("planted:readout_shift"), n_bootstrap=10**12)
    from dcp_lens.tasks.base import check_batch_request

    with pytest.raises(ResourceLimitError, match="n_ctx"):
        check_batch_request("evaluation", 512, 0, 1 << 40)


def test_a_long_jsonl_record_is_tokenized_a_piece_at_a_time():
    from dcp_lens.tasks.text import _text_chunks

    text = ("word " * 100_000).strip()
    chunks = list(_text_chunks(text, 4096))
    assert "".join(chunks) == text and max(map(len, chunks)) <= 4096 and len(chunks) > 100
    assert list(_text_chunks("", 10)) == [""]


def test_a_tokenizer_panic_is_an_error_naming_the_corpus(tmp_path):
    from dcp_lens.tasks.text import _encode

    class PanicException(BaseException):  # what the tokenizers library raises (Rust panic)
        pass

    class Broken:
        def encode(self, text: str) -> list[int]:
            raise PanicException("regex backtrack limit")

    with pytest.raises(DCPLensError, match="tokenizer failed on .*corpus.txt.*PanicException"):
        _encode(Broken(), "text", tmp_path / "corpus.txt")


def test_a_fifo_given_as_a_json_file_is_refused_without_reading(tmp_path):
    import os

    from dcp_lens.utils.checks import read_json_object

    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        read_json_object(fifo)


def test_numbers_in_results_json_are_checked_on_load(tmp_path, finished):
    from dcp_lens.protocol.results import read_results_json

    folder = shutil.copytree(finished / "planted_readout_shift", tmp_path / "r")
    text = (folder / "results.json").read_text()
    for bad in ("1e999", "NaN", "-Infinity", "1" + "0" * 30):
        first_number = text.index('"n_iterations": ') + len('"n_iterations": ')
        end = text.index(",", first_number)
        (folder / "results.json").write_text(text[:first_number] + bad + text[end:])
        with pytest.raises(DamagedFileError, match="not a finite float"):
            read_results_json(folder / "results.json")


BAD_NUMBERS = [
    ("n_iterations", '"8"'),
    ("n_iterations", "8.5"),
    ("n_iterations", "true"),
    ("k", '"1"'),
]


@pytest.mark.parametrize("field, bad", BAD_NUMBERS)
def test_a_string_where_results_json_holds_a_number_is_refused(tmp_path, finished, field, bad):
    from dcp_lens.protocol.results import read_results_json

    folder = shutil.copytree(finished / "planted_readout_shift", tmp_path / "r")
    text = (folder / "results.json").read_text()
    start = text.index(f'"{field}": ') + len(f'"{field}": ')
    end = min(i for i in (text.find(",", start), text.find("\n", start)) if i > 0)
    (folder / "results.json").write_text(text[:start] + bad + text[end:])
    with pytest.raises(DamagedFileError, match=rf"results\.json: {field} holds .*expected an"):
        read_results_json(folder / "results.json")


@pytest.mark.parametrize(
    "case",
    [
        "list",
        "numpy",
        "float_targets",
        "fraction",
        "mask_float",
        "mask_shape",
        "meta",
        "metadata",
        "ragged",
        "devices",
    ],
)
def test_evaluation_sets_take_or_refuse_every_input(case):
    from dcp_lens.utils.errors import InputError

    tokens = torch.randint(0, 8, (3, 6))
    build = {
        "list": lambda: EvaluationSet.from_tokens(tokens.tolist()),
        "numpy": lambda: EvaluationSet.from_tokens(tokens.numpy()),
        "float_targets": lambda: EvaluationSet(tokens, tokens.float() + 0.25),
        "fraction": lambda: EvaluationSet.from_tokens(tokens, [[0.5], [1], [2]]),
        "mask_float": lambda: EvaluationSet(tokens, tokens, torch.full((3, 6), 0.5)),
        "mask_shape": lambda: EvaluationSet(tokens, tokens, torch.ones(3, 5, dtype=torch.bool)),
        "meta": lambda: EvaluationSet(tokens.to("meta"), tokens),
        "metadata": lambda: EvaluationSet(tokens, tokens, metadata={"hops": torch.zeros(2)}),
        "ragged": lambda: EvaluationSet.from_tokens([[1, 2, 3], [1, 2]]),
        "devices": lambda: EvaluationSet(tokens, tokens.to("meta")),
    }[case]
    if case in ("list", "numpy"):
        built = build()
        assert built.tokens.dtype == torch.long and torch.equal(built.tokens, tokens)
        assert torch.equal(built.targets[:, :-1], tokens[:, 1:])
    else:
        # The constructor's fields are typed: under the test suite's runtime type checks a
        # wrong dtype may be refused by jaxtyping (a TypeError naming the field) first.
        with pytest.raises((InputError, TypeError)) as refused:
            build()
        named = ("tokens", "targets", "attention_mask", "metadata", "scored_positions")
        assert any(name in str(refused.value) for name in named), refused.value


def test_two_protocols_on_one_model_at_once_work_or_say_why():
    import threading

    from dcp_lens.utils.errors import InputError

    model = load("planted:readout_shift")
    task = model.planted_task
    data = (task.evaluation(16), task.calibration(16))
    outcomes: list[object] = []

    def run() -> None:
        protocol = DepthControlProtocol(model, n_bootstrap=5, probe="none", progress=False)
        try:
            outcomes.append(protocol.run(*data))
        except InputError as error:
            outcomes.append(error)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(outcomes) == 2
    for result in outcomes:
        assert isinstance(result, ProtocolResults) or "copy.deepcopy" in str(result)
    assert any(isinstance(result, ProtocolResults) for result in outcomes)


def test_workers_die_with_their_parent(tmp_path):
    """A pool's worker, set up by die_with_parent, ends when its parent is SIGKILLed."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "parent.py"
    script.write_text(
        "import os, sys, time, multiprocessing\n"
        "from concurrent.futures import ProcessPoolExecutor\n"
        "from dcp_lens.utils.signals import die_with_parent\n"
        "def work():\n    time.sleep(120)\n"
        "if __name__ == '__main__':\n"
        "    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context('spawn'),\n"
        "                               initializer=die_with_parent, initargs=(os.getpid(),))\n"
        "    pool.submit(work)\n"
        "    time.sleep(2)\n"
        "    print(*[p.pid for p in pool._processes.values()], flush=True)\n"
        "    time.sleep(120)\n"
    )
    root = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert parent.stdout is not None
    workers = [int(pid) for pid in parent.stdout.readline().split()]
    assert workers
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 20
    alive = workers
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in workers if _alive(pid)]
        time.sleep(0.2)
    assert alive == [], f"workers {alive} outlived their parent"


def _alive(pid: int) -> bool:
    import os

    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def test_the_finished_check_is_made_again_under_the_lock(tmp_path):
    """B judges the folder new before A has finished it; once B holds the lock it judges it
    again and refuses the finished run (B never replaces what A wrote)."""
    from dcp_lens.utils.files import write_text_atomically
    from dcp_lens.utils.folders import OutputFolder
    from dcp_lens.utils.locks import FolderBusyError

    out = tmp_path / "out"
    first = OutputFolder(out, "run")
    second = OutputFolder(out, "run")
    assert second.plan() == "new"  # before anything is locked
    work = first.open()
    first.prepare()
    with pytest.raises(FolderBusyError):
        second.open()
    write_text_atomically(work / "results.json", "{}")  # recorded: the command's own
    first.finish()
    with pytest.raises(ConfigError, match="holds a finished run"):
        second.open()
    assert (out / "results.json").read_text() == "{}"
    manifest = json.loads((out / ".dcp-lens.json").read_text())
    assert manifest["finished"] and sorted(manifest["files"]) == [".lock", "results.json"]
    (out / "notes.txt").write_text("mine")  # a user's file after the run: kept by a restart
    third = OutputFolder(out, "run", overwrite=True)
    third.open()
    third.prepare()
    names = [".dcp-lens.journal", ".dcp-lens.json", ".lock", "notes.txt"]
    assert sorted(p.name for p in out.iterdir()) == names
    third.close()
