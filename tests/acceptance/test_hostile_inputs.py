"""Hostile inputs, each refused cleanly before any work: configs and weights of the wrong type,
kind or size, unavailable devices, pickled or linked weights, empty or out-of-range values, bad
corpora, tokens and evaluation sets.

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
from helpers import (
    SMALL,
    data_path,
    one_line_error,
    save_tiny_model,
    tiny_config,
    write_llama2c,
)
from safetensors.torch import load_file, save_file

from dcp_lens import HookedRecurrentTransformer, load
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
    ResourceLimitError,
    WeightsError,
)

# A device this machine surely lacks (on a CUDA machine, a CUDA index past its last GPU).
ABSENT_DEVICE = "cuda:99" if torch.cuda.is_available() else "cuda"


def rewrite_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


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


def test_every_library_error_is_a_value_error():
    for error in (ConfigError, ConfigTypeError, DamagedFileError, DeviceError, WeightsError):
        assert issubclass(error, DCPLensError) and issubclass(error, ValueError)
    assert issubclass(ConfigTypeError, TypeError)


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
    import dcp_lens.model.text as module

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
