"""RecurrentConfig validation and its lossless JSON round trip; bad model input."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_model, tokens_for

from dcp_lens import HookedRecurrentTransformer, RecurrentConfig


def test_json_round_trip_is_lossless(tmp_path):
    cfg = RecurrentConfig(
        d_model=48,
        n_heads=6,
        d_head=8,
        n_key_value_heads=3,
        injection="concat_adapter",
        state_init="huginn",
        state_init_std=0.3,
        normalization_type="RMS",
        norm_placement="sandwich_residual",
        pre_coda_norm="final",
        iteration_norm="own",
        positional_embedding_type="rotary_rotate_half",
        rotary_base=5e4,
        qk_bias=True,
        act_fn="silu_gated",
        tie_unembed=True,
        embed_scale=6.9282,
        seed=11,
    )
    cfg.to_json(tmp_path / "c.json")
    again = RecurrentConfig.from_json(tmp_path / "c.json")
    assert again.to_dict() == cfg.to_dict()
    assert again.n_layers == cfg.n_layers == 1 + 4 * 2 + 1


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(n_prelude=-1), "n_prelude=-1"),
        (dict(n_coda=-2), "n_coda=-2"),
        (dict(n_iterations=0), "n_iterations=0"),
        (dict(d_model=30, n_heads=4, d_head=8), "d_model=30"),
        (dict(n_key_value_heads=3), "n_key_value_heads=3"),
        (dict(injection="concat"), "injection='concat'"),
        (dict(state_init="random"), "state_init='random'"),
        (dict(norm_placement="postnorm"), "norm_placement='postnorm'"),
        (
            dict(
                rotary_scaling=(32.0, 4.0, 1.0, 8192.0),
                positional_embedding_type="rotary_rotate_half",
            ),
            "high_freq_factor > low_freq_factor",
        ),
        (dict(rotary_scaling=(32.0, 1.0, 4.0, 8192.0)), "this model has none"),
        (dict(normalization_type="BN"), "normalization_type='BN'"),
        (dict(positional_embedding_type="alibi"), "positional_embedding_type='alibi'"),
        (dict(act_fn="relu"), "act_fn='relu'"),
        (dict(pre_coda_norm="final", final_norm=False), "final_norm=False"),
    ],
)
def test_bad_config_raises_naming_the_value(fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        RecurrentConfig(**fields)


def test_wrong_types_raise_type_error():
    with pytest.raises(TypeError, match="n_core"):
        RecurrentConfig(n_core=2.5)


def test_config_file_with_unknown_or_missing_keys(tmp_path):
    data = RecurrentConfig().to_dict()
    (tmp_path / "extra.json").write_text(json.dumps({**data, "n_loops": 3}))
    with pytest.raises(ValueError, match="n_loops"):
        RecurrentConfig.from_json(tmp_path / "extra.json")
    del data["injection"]
    (tmp_path / "missing.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="injection"):
        RecurrentConfig.from_json(tmp_path / "missing.json")


def test_config_file_written_before_later_fields_loads_with_their_defaults(tmp_path):
    data = RecurrentConfig().to_dict()
    del data["qk_norm"], data["rotary_scaling"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    cfg = RecurrentConfig.from_json(tmp_path / "old.json")
    assert cfg.qk_norm is False and cfg.rotary_scaling is None
    scaled = RecurrentConfig(
        positional_embedding_type="rotary_rotate_half", rotary_scaling=(8.0, 1.0, 4.0, 8192.0)
    )
    scaled.to_json(tmp_path / "scaled.json")
    assert RecurrentConfig.from_json(tmp_path / "scaled.json") == scaled


def test_bad_model_input_raises_naming_the_value():
    model = make_model()
    with pytest.raises(ValueError, match="token id 40"):
        model(torch.tensor([[1, 40]]))
    with pytest.raises(ValueError, match="token id -1"):
        model(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="n_ctx=24"):
        model(torch.zeros(1, 25, dtype=torch.long))
    with pytest.raises(ValueError, match="at least 1 iteration"):
        model(tokens_for(model), n_iterations=0)
    with pytest.raises(TypeError, match="integer tokens"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="iteration=5"):
        model.block_index(iteration=5, layer=0)
    with pytest.raises(ValueError, match="no tokenizer"):
        model.to_tokens("hello")


def test_load_rejects_bad_checkpoints(tmp_path):
    from safetensors.torch import load_file, save_file

    model = make_model()
    model.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    broken = dict(state)
    del broken["core.1.attn.W_Q"]
    save_file(broken, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="core.1.attn.W_Q"):
        HookedRecurrentTransformer.from_pretrained(tmp_path)
    save_file(
        {**state, "core.9.attn.W_Q": state["core.1.attn.W_Q"].clone()},
        tmp_path / "model.safetensors",
    )
    with pytest.raises(ValueError, match="core.9.attn.W_Q"):
        HookedRecurrentTransformer.from_pretrained(tmp_path)
    save_file(
        {**state, "embed.W_E": torch.zeros(3, 3, dtype=torch.float64)},
        tmp_path / "model.safetensors",
    )
    with pytest.raises(ValueError, match=r"embed.W_E'? has shape \(3, 3\)"):
        HookedRecurrentTransformer.from_pretrained(tmp_path)
    save_file(state, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        HookedRecurrentTransformer.from_pretrained(tmp_path)


def test_load_spec_reads_a_saved_folder_with_overrides(tmp_path):
    from dcp_lens import load

    model = make_model()
    model.save_pretrained(tmp_path / "m")
    loaded = load(str(tmp_path / "m"), n_iterations=6)
    assert loaded.n_iterations == 6
    tokens = tokens_for(model)
    assert torch.equal(loaded(tokens), model(tokens, n_iterations=6))
    with pytest.raises(ValueError, match="unknown model spec 'nowhere'"):
        load("nowhere")
    with pytest.raises(ValueError, match="n_loops"):
        load(str(tmp_path / "m"), n_loops=2)
