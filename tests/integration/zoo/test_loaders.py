"""Loaders of real checkpoints: Huginn and Ouro fixtures against their reference outputs,
stories260K against its published greedy continuation, loader errors, and real-scale parameter
counts on meta.

The fixtures (``demos/data/fixtures/{huginn,ouro}_tiny``) hold tiny random models in the original
key names with outputs of the reference implementations.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path
from types import ModuleType

import pytest
import torch
from helpers import data_path
from reference import CONTINUATION, PROMPT, STORY, reference_llama2c_logits
from safetensors.torch import load_file, save_file
from torch import Tensor

from dcp_lens import HookedRecurrentTransformer, load
from dcp_lens.utils.errors import ConfigError
from dcp_lens.zoo.loaders.llama2c_format import read_llama2c_checkpoint
from dcp_lens.zoo.loaders.ouro import ExitOutputs, OuroRecurrentTransformer, exit_distribution
from dcp_lens.zoo.registry import foreign_checkpoint

HUGINN = data_path("fixtures", "huginn_tiny")
OURO = data_path("fixtures", "ouro_tiny")
STORIES = data_path("stories260K")
DEMO = Path(__file__).resolve().parents[3] / "demos" / "real_scale_configs.py"
# The acceptance tolerance; the fixtures' own re-implementations stay near 1e-6.
ATOL = 1e-4


def _max_diff(actual: Tensor, expected: Tensor) -> float:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return (actual.double() - expected.double()).abs().max().item()


# ------------------------------------------------------------------------------------ Huginn


@pytest.fixture(scope="module")
def huginn_reference() -> dict[str, Tensor]:
    return load_file(str(HUGINN / "reference.safetensors"))


@pytest.fixture(scope="module")
def huginn_zero_state() -> HookedRecurrentTransformer:
    return load(f"huginn:{HUGINN}", state_init="zeros")


@pytest.mark.parametrize("n_steps", [1, 2, 4, 8])
def test_huginn_logits_match_reference_at_every_step_count(
    huginn_zero_state: HookedRecurrentTransformer, huginn_reference: dict[str, Tensor], n_steps: int
) -> None:
    tokens = huginn_reference["input_ids"]
    logits = huginn_zero_state(tokens, n_iterations=n_steps)
    assert _max_diff(logits, huginn_reference[f"logits_steps_{n_steps}"]) < ATOL


def test_huginn_states_prelude_and_latent_match_reference(
    huginn_zero_state: HookedRecurrentTransformer, huginn_reference: dict[str, Tensor]
) -> None:
    model = huginn_zero_state
    _, cache = model.run_with_cache(huginn_reference["input_ids"], n_iterations=4)
    assert torch.equal(cache["hook_embed"], huginn_reference["embeds_scaled"])
    prelude_out = cache[f"blocks.{model.cfg.n_prelude - 1}.hook_resid_post"]
    assert _max_diff(prelude_out, huginn_reference["prelude_out"]) < ATOL
    assert torch.equal(cache[model.state_hook_name(0)], torch.zeros_like(prelude_out))
    for t in range(1, 5):
        state = cache[model.state_hook_name(t)]
        assert _max_diff(state, huginn_reference[f"states_after_iter_{t}"]) < ATOL, t
    assert torch.equal(cache[model.readout_hook_name], cache[model.state_hook_name(4)])
    assert _max_diff(cache["ln_pre_coda.hook_normalized"], huginn_reference["latent"]) < ATOL


def test_huginn_config_mapping_and_overrides(huginn_reference: dict[str, Tensor]) -> None:
    model = load(f"huginn:{HUGINN}", state_init="zeros", n_iterations=8)
    cfg = model.cfg
    assert (cfg.n_prelude, cfg.n_core, cfg.n_coda, cfg.n_iterations) == (2, 2, 2, 8)
    assert cfg.norm_placement == "sandwich_residual" and cfg.pre_coda_norm == "final"
    assert cfg.tie_unembed and cfg.embed_scale == 8.0 and cfg.eps == 1e-6
    assert model.ln_pre_coda is not None and model.ln_pre_coda.w is model.ln_final.w
    logits = model(huginn_reference["input_ids"])
    assert _max_diff(logits, huginn_reference["logits_steps_8"]) < ATOL


def test_huginn_default_initial_state_is_its_truncated_normal_draw(
    huginn_zero_state: HookedRecurrentTransformer, huginn_reference: dict[str, Tensor]
) -> None:
    model = load(f"huginn:{HUGINN}")
    assert model.cfg.state_init == "huginn" and model.n_iterations == 4  # mean_recurrence
    assert model.cfg.state_init_std == pytest.approx((2 / (5 * 64)) ** 0.5)
    tokens = huginn_reference["input_ids"]
    logits, cache = model.run_with_cache(tokens)
    state = cache[model.state_hook_name(0)]
    # sqrt(2/5) before truncation at 3 sigma, whatever d_model is (the fixture README).
    assert abs(state.std().item() - 0.6325 * 0.9866) < 0.03
    assert state.abs().max().item() <= 3 * (2 / 5) ** 0.5 + 1e-5
    # Seeded, so runs are paired (up to the fused norms used when nothing is cached).
    assert _max_diff(model(tokens), logits) < 1e-5, "the draw is seeded, so runs are paired"
    assert torch.equal(model(tokens), model(tokens))
    assert _max_diff(logits, huginn_reference["logits_steps_4"]) > 1e-2


# -------------------------------------------------------------------------------------- Ouro


@pytest.fixture(scope="module")
def ouro_reference() -> dict[str, Tensor]:
    return load_file(str(OURO / "reference.safetensors"))


@pytest.fixture(scope="module")
def ouro() -> OuroRecurrentTransformer:
    model = load(f"ouro:{OURO}")
    assert isinstance(model, OuroRecurrentTransformer)
    return model


def test_ouro_hidden_states_and_step_logits_match_reference(
    ouro: OuroRecurrentTransformer, ouro_reference: dict[str, Tensor]
) -> None:
    assert ouro.n_iterations == 4 and ouro.cfg.n_core == 2
    logits, cache = ouro.run_with_cache(ouro_reference["input_ids"])
    assert _max_diff(logits, ouro_reference["logits_default"]) < ATOL
    outputs = ouro.exit_outputs(ouro_reference["input_ids"])
    for t in range(1, 5):
        hidden = cache[ouro.state_hook_name(t)]
        assert _max_diff(hidden, ouro_reference[f"hidden_after_step_{t}"]) < ATOL, t
        prenorm = cache[ouro.hook_name(t, ouro.cfg.n_core - 1, "hook_resid_post")]
        assert _max_diff(prenorm, ouro_reference[f"prenorm_after_step_{t}"]) < ATOL, t
        step_logits = outputs.step_logits[:, :, t - 1]
        assert _max_diff(step_logits, ouro_reference[f"logits_step_{t}"]) < ATOL, t


def test_ouro_exit_gate_distribution_and_readouts_match_reference(
    ouro: OuroRecurrentTransformer, ouro_reference: dict[str, Tensor]
) -> None:
    tokens = ouro_reference["input_ids"]
    outputs = ouro.exit_outputs(tokens)
    expected_gate = torch.cat([ouro_reference[f"gate_logit_step_{t}"] for t in range(1, 5)], -1)
    assert _max_diff(outputs.gate_logits, expected_gate) < ATOL
    assert _max_diff(outputs.exit_pdf, ouro_reference["exit_pdf"]) < ATOL
    assert _max_diff(ouro.exit_probabilities(tokens), ouro_reference["exit_pdf"]) < ATOL
    assert _max_diff(outputs.weighted_logits(), ouro_reference["logits_weighted"]) < ATOL
    logits, step = outputs.threshold_exit(0.5)
    assert torch.equal(step, ouro_reference["exit_step_threshold_0p5"])
    assert _max_diff(logits, ouro_reference["logits_threshold_0p5"]) < ATOL


def test_ouro_exit_hooks_can_be_cached_and_edited(
    ouro: OuroRecurrentTransformer, ouro_reference: dict[str, Tensor]
) -> None:
    tokens = ouro_reference["input_ids"]
    seen: dict[str, Tensor] = {}

    def keep(tensor: Tensor, hook) -> None:
        seen[hook.name] = tensor

    def exit_at_first_step(tensor: Tensor, hook) -> Tensor:
        forced = tensor.clone()
        forced[..., 0] = float("inf")
        return forced

    with ouro.hooks(fwd_hooks=[("hook_exit_logits", keep), ("hook_exit_pdf", keep)]):
        pdf = ouro.exit_probabilities(tokens)
    assert seen["hook_exit_logits"].shape == (2, 24, 4) and torch.equal(seen["hook_exit_pdf"], pdf)
    with ouro.hooks(fwd_hooks=[("hook_exit_logits", exit_at_first_step)]):
        forced = ouro.exit_outputs(tokens)
    assert torch.equal(forced.exit_pdf, torch.tensor([1.0, 0, 0, 0]).expand_as(pdf))
    assert torch.equal(forced.weighted_logits(), forced.step_logits[:, :, 0])
    # A state hook moves the gate: the gate reads the hooked state.
    with ouro.hooks(fwd_hooks=[(ouro.state_hook_name(2), lambda x, hook: torch.zeros_like(x))]):
        zeroed = ouro.exit_outputs(tokens)
    bias = ouro.exit_gate.bias.detach()
    assert torch.allclose(zeroed.gate_logits[:, :, 1], bias.expand(2, 24))
    assert ouro.exit_probabilities(tokens, n_iterations=6).shape == (2, 24, 6)
    assert ouro.n_iterations == 4


def test_ouro_save_pretrained_round_trips_gate_and_weights(
    ouro: OuroRecurrentTransformer, ouro_reference: dict[str, Tensor], tmp_path: Path
) -> None:
    tokens = ouro_reference["input_ids"]
    ouro.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(saved["exit_gate.bias"], ouro.exit_gate.bias.detach())
    for reloaded in (OuroRecurrentTransformer.from_pretrained(tmp_path), load(f"ouro:{tmp_path}")):
        assert isinstance(reloaded, OuroRecurrentTransformer)
        assert torch.equal(reloaded(tokens), ouro(tokens))
        assert torch.equal(reloaded.exit_probabilities(tokens), ouro.exit_probabilities(tokens))
    assert load(f"ouro:{tmp_path}", n_iterations=6).n_iterations == 6


def test_exit_distribution_sums_to_one_and_gives_the_last_step_the_rest() -> None:
    gate_logits = torch.tensor([[0.0, 0.0, 0.0], [2.0, -1.0, 5.0]])
    pdf = exit_distribution(gate_logits)
    lam = torch.sigmoid(gate_logits)
    expected_first = torch.stack(
        [lam[:, 0], (1 - lam[:, 0]) * lam[:, 1], (1 - lam[:, 0]) * (1 - lam[:, 1])], dim=-1
    )
    assert torch.allclose(pdf, expected_first)
    assert torch.allclose(pdf[0], torch.tensor([0.5, 0.25, 0.25]))
    assert torch.equal(exit_distribution(torch.tensor([[3.0]])), torch.tensor([[1.0]]))
    outputs = ExitOutputs(
        step_logits=torch.arange(6.0).view(1, 2, 3, 1).expand(1, 2, 3, 2),
        gate_logits=gate_logits[None],
        exit_pdf=pdf[None],
    )
    logits, step = outputs.threshold_exit(0.7)
    assert step.tolist() == [[1, 0]] and logits[0, :, 0].tolist() == [1.0, 3.0]


# ------------------------------------------------------------------------------ stories260K


@pytest.fixture(scope="module")
def stories() -> HookedRecurrentTransformer:
    return load(f"llama2c:{STORIES}")


@pytest.mark.parametrize("use_past_kv_cache", [True, False])
def test_stories260k_greedy_decoding_reproduces_published_continuation(
    stories: HookedRecurrentTransformer, use_past_kv_cache: bool
) -> None:
    prompt, story = stories.to_tokens(PROMPT), stories.to_tokens(STORY)
    assert prompt[0, 0].item() == 1, "default_prepend_bos puts BOS first"
    new = story.shape[1] - prompt.shape[1]
    generated = stories.generate(prompt, max_new_tokens=new, use_past_kv_cache=use_past_kv_cache)
    assert torch.equal(generated, story)
    assert stories.to_string(generated[0, prompt.shape[1] :]) == CONTINUATION


def test_stories260k_matches_independent_reference_and_tokenizer_round_trips(
    stories: HookedRecurrentTransformer,
) -> None:
    assert stories.is_dense and stories.cfg.n_layers == 5 and stories.cfg.n_key_value_heads == 4
    tokens = stories.to_tokens(STORY)
    assert stories.to_string(tokens[0]) == STORY
    _, weights = read_llama2c_checkpoint(STORIES / "stories260K.bin")
    reference = reference_llama2c_logits(weights, 8, 4, tokens[0].tolist())
    assert _max_diff(stories(tokens)[0], reference) < ATOL
    from_file = load(f"llama2c:{STORIES / 'stories260K.bin'}")
    assert from_file.tokenizer is not None
    assert torch.equal(from_file(tokens), stories(tokens))
    assert stories.generate(PROMPT, max_new_tokens=8) == stories.to_string(
        stories.generate(stories.to_tokens(PROMPT), max_new_tokens=8)[0]
    )


# -------------------------------------------------------------------------------- errors


def _huginn_copy(tmp_path: Path, tensors: dict[str, Tensor]) -> Path:
    folder = tmp_path / "huginn"
    folder.mkdir()
    shutil.copy(HUGINN / "config.json", folder / "config.json")
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.fixture
def huginn_weights() -> dict[str, Tensor]:
    return load_file(str(HUGINN / "model.safetensors"))


def test_missing_key_names_the_original_key(
    huginn_weights: dict[str, Tensor], tmp_path: Path
) -> None:
    del huginn_weights["transformer.core_block.1.attn.qk_bias"]
    folder = _huginn_copy(tmp_path, huginn_weights)
    with pytest.raises(
        ValueError, match=r"missing key 'transformer\.core_block\.1\.attn\.qk_bias'"
    ):
        load(f"huginn:{folder}")


def test_unexpected_key_names_the_original_key(
    huginn_weights: dict[str, Tensor], tmp_path: Path
) -> None:
    huginn_weights["transformer.core_block.2.norm_1.weight"] = torch.ones(64)
    folder = _huginn_copy(tmp_path, huginn_weights)
    with pytest.raises(ValueError, match=r"unexpected key 'transformer\.core_block\.2\.norm_1"):
        load(f"huginn:{folder}")


def test_wrong_shape_names_the_key_and_both_shapes(
    huginn_weights: dict[str, Tensor], tmp_path: Path
) -> None:
    huginn_weights["transformer.adapter.weight"] = torch.zeros(64, 127)
    folder = _huginn_copy(tmp_path, huginn_weights)
    with pytest.raises(ValueError, match=r"'transformer\.adapter\.weight' has shape \(64, 127\), "):
        load(f"huginn:{folder}")


def test_truncated_safetensors_names_the_file(tmp_path: Path) -> None:
    folder = tmp_path / "huginn"
    shutil.copytree(HUGINN, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ValueError, match="truncated") as error:
        load(f"huginn:{folder}")
    assert str(weights) in str(error.value)


def test_truncated_llama2c_checkpoint_names_the_file(tmp_path: Path) -> None:
    data = (STORIES / "stories260K.bin").read_bytes()
    truncated = tmp_path / "stories260K.bin"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated") as error:
        load(f"llama2c:{truncated}")
    assert str(truncated) in str(error.value)


def test_ouro_missing_gate_and_untied_head_are_named(tmp_path: Path) -> None:
    weights = load_file(str(OURO / "model.safetensors"))
    for key in ("model.early_exit_gate.bias", "lm_head.weight"):
        folder = tmp_path / key
        folder.mkdir()
        shutil.copy(OURO / "config.json", folder / "config.json")
        save_file({k: v for k, v in weights.items() if k != key}, str(folder / "model.safetensors"))
        with pytest.raises(ValueError, match=f"missing key '{key}'"):
            load(f"ouro:{folder}")


def test_other_architectures_pickles_and_bad_overrides_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "prenorm"
    shutil.copytree(HUGINN, folder)
    config = json.loads((folder / "config.json").read_text())
    config["block_class_name"] = "TransformerPreNormBlock"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="block_class_name='TransformerPreNormBlock'"):
        load(f"huginn:{folder}")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(HUGINN / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"not opened")
    with pytest.raises(ValueError, match="pickle"):
        load(f"huginn:{pickled}")
    with pytest.raises(ValueError, match="n_iteration"):
        load(f"huginn:{HUGINN}", n_iteration=8)


def test_sharded_checkpoint_with_index_loads_and_is_checked(
    huginn_weights: dict[str, Tensor], huginn_reference: dict[str, Tensor], tmp_path: Path
) -> None:
    folder = tmp_path / "sharded"
    folder.mkdir()
    shutil.copy(HUGINN / "config.json", folder / "config.json")
    keys = sorted(huginn_weights)
    shards = {
        "model-00001-of-00002.safetensors": keys[::2],
        "model-00002-of-00002.safetensors": keys[1::2],
    }
    for name, shard_keys in shards.items():
        save_file({k: huginn_weights[k] for k in shard_keys}, str(folder / name))
    weight_map = {key: name for name, shard_keys in shards.items() for key in shard_keys}
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    model = load(f"huginn:{folder}", state_init="zeros")
    logits = model(huginn_reference["input_ids"])
    assert _max_diff(logits, huginn_reference["logits_steps_4"]) < ATOL
    misplaced = keys[0]
    index["weight_map"][misplaced] = "model-00002-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"'{misplaced}'"):
        load(f"huginn:{folder}")


# ---------------------------------------------------------------------- real-scale on meta


@pytest.fixture(scope="module")
def real_scale() -> ModuleType:
    spec = importlib.util.spec_from_file_location("real_scale_configs", DEMO)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_huginn_0125_parameter_count_on_meta(real_scale: ModuleType) -> None:
    model = real_scale.build_on_meta(real_scale.huginn_0125_config())
    assert all(p.is_meta for p in model.parameters())
    assert model.n_iterations == 32 and len(model.blocks) == 2 + 4 * 32 + 2
    count = real_scale.count_parameters(model)
    assert count == 3_564_976_800
    groups = real_scale.huginn_breakdown(model.cfg)
    assert count == sum(groups.values())
    # The registry's published count leaves out exactly the adapter and the per-block norms.
    published = real_scale.HUGINN_0125_PUBLISHED
    assert count - published == groups["adapter"] + groups["block norms"]


def test_ouro_parameter_counts_on_meta(real_scale: ModuleType) -> None:
    small = real_scale.build_on_meta(real_scale.ouro_1p4b_config(), OuroRecurrentTransformer)
    assert all(p.is_meta for p in small.parameters())
    assert real_scale.count_parameters(small) == 1_434_652_673  # "1.4B"
    assert real_scale.count_parameters(small) == sum(real_scale.ouro_breakdown(small.cfg).values())
    large = real_scale.build_on_meta(real_scale.ouro_2p6b_config(), OuroRecurrentTransformer)
    assert real_scale.count_parameters(large) == 2_667_974_657  # "2.6B"


# ------------------------------------------------------------- checkpoints without a prefix


@pytest.mark.parametrize(
    ("folder", "kind", "what"),
    [
        ("huginn_tiny", "huginn", "Huginn checkpoint"),
        ("ouro_tiny", "ouro", "Ouro checkpoint"),
        ("stories260K", "llama2c", "llama2.c checkpoint"),
    ],
)
def test_a_checkpoint_loaded_without_its_prefix_names_the_spec_to_use(folder, kind, what):
    path = data_path("fixtures", folder) if folder.endswith("_tiny") else data_path(folder)
    with pytest.raises(ConfigError, match=rf"{what}.*load\('{kind}:{re.escape(str(path))}'\)"):
        load(str(path))
    if kind == "llama2c":
        with pytest.raises(ConfigError, match="llama2c:"):
            load(str(path / "stories260K.bin"))
    assert foreign_checkpoint(str(path))[0] == kind
    load(f"{kind}:{path}")  # the spec the error names loads


def test_a_dcp_lens_folder_is_not_taken_for_a_foreign_checkpoint(tmp_path):
    from helpers import make_model

    make_model().save_pretrained(tmp_path / "model")
    assert foreign_checkpoint(str(tmp_path / "model")) is None
    assert load(str(tmp_path / "model")).cfg.n_core == 2
