"""Retrofitted-recurrence checkpoints (Llama and OLMo variants) against the outputs of the
reference implementation, at every step count the fixtures give, and their recognition.

The fixtures (``dcp_lens/data/fixtures/retrofit_{llama,olmo}_tiny``) hold tiny random models in
the original key names; their READMEs state the conventions and the tolerance (atol 1e-4).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import data_path, measure_load, seeded_weight, write_hub_checkpoint
from safetensors.torch import load_file, save_file
from torch import Tensor

from dcp_lens import HookedRecurrentTransformer, load
from dcp_lens.utils.errors import ConfigError
from dcp_lens.zoo.loaders.raven_retrofit import folder_family
from dcp_lens.zoo.registry import foreign_checkpoint

VARIANTS = ("llama", "olmo")
ATOL = RTOL = 1e-4  # the fixtures' READMEs; their own re-implementations stay near 1e-5


def fixture(variant: str) -> Path:
    return data_path("fixtures", f"retrofit_{variant}_tiny")


def _close(actual: Tensor, expected: Tensor) -> bool:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return torch.allclose(actual.double(), expected.double(), atol=ATOL, rtol=RTOL)


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def reference(variant: str) -> dict[str, Tensor]:
    return load_file(str(fixture(variant) / "reference.safetensors"))


@pytest.fixture(scope="module")
def model(variant: str) -> HookedRecurrentTransformer:
    return load(f"raven-retrofit:{fixture(variant)}", state_init="zeros")


@pytest.mark.parametrize("n_steps", [1, 2, 4, 8])
def test_logits_match_reference_at_every_step_count(
    model: HookedRecurrentTransformer, reference: dict[str, Tensor], n_steps: int
) -> None:
    with torch.no_grad():
        logits = model(reference["input_ids"], n_iterations=n_steps)
    assert _close(logits, reference[f"logits_steps_{n_steps}"])


def test_every_iteration_is_hooked_under_our_names(
    model: HookedRecurrentTransformer, reference: dict[str, Tensor]
) -> None:
    with torch.no_grad(), model.iterations(4):
        _, cache = model.run_with_cache(reference["input_ids"])
        assert torch.equal(cache["hook_embed"], reference["embeds"])
        prelude_out = cache[f"blocks.{model.cfg.n_prelude - 1}.hook_resid_post"]
        assert _close(prelude_out, reference["prelude_out"])
        assert torch.equal(cache[model.state_hook_name(0)], torch.zeros_like(prelude_out))
        for t in range(1, 5):
            assert _close(cache[model.inject_hook_name(t)], reference[f"adapter_out_iter_{t}"])
            assert _close(cache[model.state_hook_name(t)], reference[f"states_after_iter_{t}"])
        assert torch.equal(cache[model.readout_hook_name], cache[model.state_hook_name(4)])
        assert _close(cache[model.readout_hook_name], reference["latent"])
        assert _close(cache["ln_final.hook_normalized"], reference["final_hidden_steps_4"])


def test_heads_and_neurons_add_up_to_each_sublayer_through_its_norm(variant: str) -> None:
    """Per-head and per-neuron results go through a post-norm block's output norm (OLMo) at its
    cached scale, and add up to what the sublayer adds to the stream, as in a pre-norm block."""
    model = load(f"raven-retrofit:{fixture(variant)}", n_iterations=2, dtype="float64")
    tokens = torch.randint(1, 256, (2, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens)
        cache.stack_head_results(layer=-1)
        for i in range(model.cfg.n_layers):
            heads = cache[f"blocks.{i}.attn.hook_result"].sum(-2)
            assert (heads - cache[f"blocks.{i}.hook_attn_out"]).abs().max() <= 1e-10, i
        neurons = cache.get_neuron_results(3).sum(-2)  # a core layer in iteration 1
        assert (neurons - cache["blocks.3.hook_mlp_out"]).abs().max() <= 1e-10


def test_config_mapping_reads_rope_theta_and_the_variant(variant: str) -> None:
    model = load(f"raven-retrofit:{fixture(variant)}")
    cfg = model.cfg
    assert (cfg.n_prelude, cfg.n_core, cfg.n_coda, cfg.n_iterations) == (2, 2, 2, 32)
    assert (cfg.n_heads, cfg.n_key_value_heads, cfg.d_head) == (4, 2, 16)
    assert cfg.rotary_base == 500000.0 and cfg.embed_scale == 1.0 and not cfg.tie_unembed
    assert cfg.state_init == "huginn" and cfg.pre_coda_norm == "none"
    assert cfg.norm_placement == {"llama": "pre", "olmo": "post"}[variant]
    assert cfg.qk_norm == (variant == "olmo")
    assert (cfg.rotary_scaling is not None) == (variant == "llama")


def test_default_initial_state_is_the_small_truncated_normal_draw(
    model: HookedRecurrentTransformer, reference: dict[str, Tensor], variant: str
) -> None:
    """The reference draws s_0 ~ trunc-normal(sigma = init_values.std = 0.0087), no sqrt(d)
    factor; the README measures the 4-step logits of such a draw within 0.080 (Llama) and 0.0021
    (OLMo) of the zero-state logits. A sqrt(d)-scaled draw (Huginn's rule) moves them further."""
    drawn = load(f"raven-retrofit:{fixture(variant)}")
    with torch.no_grad():
        logits = drawn(reference["input_ids"], n_iterations=4)
    state = drawn.run_with_cache(reference["input_ids"], n_iterations=1)[1]["loop.0.hook_state"]
    assert 0.004 < state.std().item() < 0.0095 and state.abs().max().item() <= 3 * 0.0088
    bound = {"llama": 0.3, "olmo": 0.02}[variant]
    assert 0 < (logits - reference["logits_steps_4"]).abs().max().item() < bound


def test_sharded_bf16_folder_loads_to_the_same_model(tmp_path: Path, variant: str) -> None:
    source = fixture(variant)
    tensors = load_file(str(source / "model.safetensors"))
    keys = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": keys[::2],
        "model-00002-of-00002.safetensors": keys[1::2],
    }
    for name, part in halves.items():
        save_file({k: tensors[k].to(torch.bfloat16).contiguous() for k in part}, tmp_path / name)
    index = {"metadata": {}, "weight_map": {k: n for n, part in halves.items() for k in part}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(source / "config.json", tmp_path / "config.json")
    sharded = load(f"raven-retrofit:{tmp_path}", state_init="zeros")
    whole = load(f"raven-retrofit:{source}", state_init="zeros", dtype="bfloat16")
    assert sharded.cfg.dtype == torch.bfloat16
    for name, value in whole.canonical_state_dict().items():
        assert torch.equal(sharded.canonical_state_dict()[name], value), name


def test_recognised_by_keys_not_by_model_type(tmp_path: Path, variant: str) -> None:
    """model_type "huginn_raven" is Huginn-0125's too: the keys decide, and each loader refuses
    the other's checkpoint by name."""
    assert folder_family(fixture(variant)) == variant
    assert folder_family(data_path("fixtures", "huginn_tiny")) == "huginn"
    found = foreign_checkpoint(str(fixture(variant)))
    assert found is not None and found[0] == "raven-retrofit"
    with pytest.raises(ConfigError, match="raven-retrofit:"):
        load(str(fixture(variant)))
    with pytest.raises(ConfigError, match="huginn:"):
        load(f"raven-retrofit:{data_path('fixtures', 'huginn_tiny')}")
    # A class name in auto_map that says Huginn's file does not change what the keys say.
    copy = tmp_path / "renamed"
    shutil.copytree(fixture(variant), copy)
    config = json.loads((copy / "config.json").read_text())
    config["auto_map"]["AutoModelForCausalLM"] = "raven_modeling_minimal.RavenForCausalLM"
    (copy / "config.json").write_text(json.dumps(config))
    assert folder_family(copy) == variant


def test_unsupported_settings_are_refused_with_the_field(tmp_path: Path) -> None:
    copy = tmp_path / "skip"
    shutil.copytree(fixture("olmo"), copy)
    config = json.loads((copy / "config.json").read_text())
    config["initial_state_mode"] = "skip-adapter"
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="initial_state_mode='skip-adapter'"):
        load(f"raven-retrofit:{copy}")
    config["initial_state_mode"] = "embed-init"
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="'yarn' is not supported"):
        load(f"raven-retrofit:{copy}")
    del config["rope_scaling"]
    (copy / "config.json").write_text(json.dumps(config))
    assert load(f"raven-retrofit:{copy}").cfg.state_init == "embed"


def test_save_pretrained_round_trip(
    tmp_path: Path, reference: dict[str, Tensor], variant: str
) -> None:
    model = load(f"raven-retrofit:{fixture(variant)}", state_init="zeros")
    again = load(str(model.save_pretrained(tmp_path / "saved")))
    with torch.no_grad():
        logits = again(reference["input_ids"], n_iterations=2)
    assert _close(logits, reference["logits_steps_2"])


# ------------------------------------------------------------------------- full-size load

# Llama-3.2-1B converted with the 2 / 4 / 2 layout the repository's training scripts name.
LLAMA_1B_RETROFIT = {
    "n_embd": 2048, "n_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "intermediate_size": 8192, "vocab_size": 128256, "padded_vocab_size": 128256,
    "n_layers_in_prelude": 2, "n_layers_in_recurrent_block": 4, "n_layers_in_coda": 2,
}  # fmt: skip
SHARD_BYTES = 1 << 30


@pytest.mark.slow
def test_a_1b_retrofit_in_the_hub_layout_loads_within_1_2x_its_weights(tmp_path: Path) -> None:
    """Load time and peak host memory of a full-size load on the CPU (in a fresh process; the
    peak counted from after the imports). docs/models.md reports the figures."""
    from dcp_lens.zoo.loaders.raven_retrofit import retrofit_config, retrofit_tensor_shapes

    config = json.loads((fixture("llama") / "config.json").read_text()) | LLAMA_1B_RETROFIT
    expected, _ = retrofit_tensor_shapes(retrofit_config(config, "llama"), "llama")
    folder = tmp_path / "retrofit-1b"
    try:
        weights = write_hub_checkpoint(folder, config, expected, seeded_weight, SHARD_BYTES)
        figures = measure_load(f"raven-retrofit:{folder}", "dcp_lens.zoo.loaders.raven_retrofit")
    finally:  # gigabytes: not left among the temporary folders pytest keeps
        shutil.rmtree(folder, ignore_errors=True)
    print(f"\nweights {weights / 1e9:.2f} GB, {figures}")
    assert figures["parameter_bytes"] == weights and figures["dtypes"] == ["torch.bfloat16"]
    assert figures["peak"] - figures["before"] <= 1.2 * weights
