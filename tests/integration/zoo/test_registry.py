"""Adding a kind is one file: a toy looped checkpoint format registered through the public API
(docs/models.md, "Your looped model"), loaded by its spec, checked against the model it was
written from, run through the protocol and the TransformerLens surface (run_with_cache, a hook
name per iteration)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import lm_sets
from safetensors.torch import save_file

from dcp_lens import DepthControlProtocol, HookedRecurrentTransformer, RecurrentConfig, load
from dcp_lens.model.folder import (
    SafetensorsCheckpoint,
    build_model,
    heads_in,
    heads_out,
    read_json,
    split_overrides,
)
from dcp_lens.utils.errors import WeightsError
from dcp_lens.zoo.registry import LOADERS, register_loader

KIND = "toy-loop"
SHAPE = {"width": 32, "heads": 4, "vocab": 40, "first": 1, "looped": 2, "last": 1, "loops": 3}


def toy_config(spec: dict[str, Any], **overrides: Any) -> RecurrentConfig:
    """The toy format's ``toy.json`` as a `RecurrentConfig`: pre-norm RMS blocks, rotate-half
    rotary, a gated MLP, the state and the prelude output merged by a [d, 2d] adapter."""
    fields: dict[str, Any] = dict(
        d_model=spec["width"],
        n_heads=spec["heads"],
        d_head=spec["width"] // spec["heads"],
        d_mlp=2 * spec["width"],
        d_vocab=spec["vocab"],
        n_ctx=64,
        n_prelude=spec["first"],
        n_core=spec["looped"],
        n_coda=spec["last"],
        n_iterations=spec["loops"],
        injection="concat_adapter",
        normalization_type="RMS",
        positional_embedding_type="rotary_rotate_half",
        act_fn="silu_gated",
    )
    return RecurrentConfig(**{**fields, **overrides})


def toy_parts(cfg: RecurrentConfig) -> list[str]:
    """The toy format numbers its layers 0..n-1 in order: prelude, core, coda."""
    return [
        *(f"prelude.{i}" for i in range(cfg.n_prelude)),
        *(f"core.{i}" for i in range(cfg.n_core)),
        *(f"coda.{i}" for i in range(cfg.n_coda)),
    ]


def load_toy(path: str | Path, **overrides: Any) -> HookedRecurrentTransformer:
    """The recipe's loader: config -> `RecurrentConfig`, the checkpoint's tensors -> the
    mapping contract's names (`canonical_state_dict`), then `build_model`."""
    folder = Path(path)
    config_overrides, device, dtype = split_overrides(overrides)  # device, dtype: checked
    cfg = toy_config(read_json(folder / "toy.json"), **config_overrides)
    checkpoint = SafetensorsCheckpoint(folder / "toy.safetensors")
    tensors = checkpoint.read(dtype=dtype)
    state = {
        "embed.W_E": tensors["embedding"],  # token embedding [d_vocab, d_model]
        "inject.W_adapter": tensors["merge"],  # injection: u_t = W [s_{t-1}; e]
        "ln_final.w": tensors["final_norm"],  # readout: ln_final, then unembed
        "unembed.W_U": tensors["head"].T,  # [d_model, d_vocab]
    }
    for n, target in enumerate(toy_parts(cfg)):
        w_q, w_k, w_v = tensors[f"layer{n}.qkv"].chunk(3)
        gate, up = tensors[f"layer{n}.gate_up"].chunk(2)
        state |= {
            f"{target}.ln1.w": tensors[f"layer{n}.norm_a"],
            f"{target}.attn.W_Q": heads_in(w_q, cfg.n_heads),
            f"{target}.attn.W_K": heads_in(w_k, cfg.n_heads),
            f"{target}.attn.W_V": heads_in(w_v, cfg.n_heads),
            f"{target}.attn.W_O": heads_out(tensors[f"layer{n}.out"], cfg.n_heads),
            f"{target}.ln2.w": tensors[f"layer{n}.norm_b"],
            f"{target}.mlp.W_gate": gate.T,
            f"{target}.mlp.W_in": up.T,
            f"{target}.mlp.W_out": tensors[f"layer{n}.down"].T,
        }
    return build_model(HookedRecurrentTransformer, cfg, state, checkpoint.source, device=device)


def write_toy(model: HookedRecurrentTransformer, folder: Path) -> None:
    """``model``'s weights in the toy format (the inverse of `load_toy`)."""
    weights = model.canonical_state_dict()
    tensors = {
        "embedding": weights["embed.W_E"],
        "merge": weights["inject.W_adapter"],
        "final_norm": weights["ln_final.w"],
        "head": weights["unembed.W_U"].T,
    }
    for n, source in enumerate(toy_parts(model.cfg)):
        flat = [weights[f"{source}.attn.W_{x}"].transpose(1, 2).flatten(0, 1) for x in "QKV"]
        tensors |= {
            f"layer{n}.qkv": torch.cat(flat),
            f"layer{n}.out": weights[f"{source}.attn.W_O"].flatten(0, 1).T,
            f"layer{n}.norm_a": weights[f"{source}.ln1.w"],
            f"layer{n}.norm_b": weights[f"{source}.ln2.w"],
            f"layer{n}.gate_up": torch.cat(
                [weights[f"{source}.mlp.W_gate"].T, weights[f"{source}.mlp.W_in"].T]
            ),
            f"layer{n}.down": weights[f"{source}.mlp.W_out"].T,
        }
    folder.mkdir()
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, folder / "toy.safetensors")
    (folder / "toy.json").write_text(json.dumps(SHAPE))


@pytest.fixture
def toy_kind() -> Iterator[str]:
    register_loader(KIND)(load_toy)
    yield KIND
    LOADERS.pop(KIND)  # the registry is global: leave it as found


@pytest.fixture
def original() -> HookedRecurrentTransformer:
    torch.manual_seed(0)
    model = HookedRecurrentTransformer(toy_config(SHAPE))
    with torch.no_grad():  # norms away from 1, so a norm mapped to the wrong place shows
        for name, parameter in model.named_parameters():
            if name.endswith(".w"):
                parameter.add_(0.2 * torch.randn_like(parameter))
    return model.eval()


def test_a_kind_added_through_the_registry_loads_by_its_spec(
    toy_kind: str, original: HookedRecurrentTransformer, tmp_path: Path
) -> None:
    write_toy(original, tmp_path / "toy")
    model = load(f"{toy_kind}:{tmp_path / 'toy'}")
    assert model.spec == f"{toy_kind}:{tmp_path / 'toy'}"
    tokens = torch.randint(0, SHAPE["vocab"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for k in (1, 3, 5):
            expected = original(tokens, n_iterations=k)
            assert (model(tokens, n_iterations=k) - expected).abs().max() <= 1e-5, k
    with pytest.raises(ValueError, match="already registered"):
        register_loader(toy_kind)(lambda path: None)


def test_the_added_kind_has_the_tl_surface_and_runs_the_protocol(
    toy_kind: str, original: HookedRecurrentTransformer, tmp_path: Path
) -> None:
    write_toy(original, tmp_path / "toy")
    model = load(f"{toy_kind}:{tmp_path / 'toy'}", dtype="float64")
    tokens = torch.randint(0, SHAPE["vocab"], (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), model.iterations(4):
        logits, cache = model.run_with_cache(tokens)
        assert (logits - model(tokens)).abs().max() <= 1e-10  # cached: attention materialised
        n_blocks = SHAPE["first"] + 4 * SHAPE["looped"] + SHAPE["last"]
        assert model.cfg.n_layers == n_blocks
        assert {f"blocks.{i}.hook_resid_post" for i in range(n_blocks)} <= set(cache.keys())
        for t in range(5):  # a state per iteration, an injection per iteration after the first
            assert model.state_hook_name(t) in cache
        for t in range(1, 5):
            state = cache[model.state_hook_name(t)]
            last_core = model.block_index(t, SHAPE["looped"] - 1)
            assert torch.equal(state, cache[f"blocks.{last_core}.hook_resid_post"])
            assert model.inject_hook_name(t) in cache
    evaluation, calibration = lm_sets(model, n=32, pos=8)
    protocol = DepthControlProtocol(model, n_bootstrap=10, probe="none", progress=False)
    results = protocol.run(evaluation, calibration)
    assert results.architecture == "recurrent" and results.n_iterations == SHAPE["loops"]
    assert results.null_control["max_abs_logit_diff"] <= 1e-9
    table = results.table()
    assert set(table["k"]) == {1, 2, 3}
    assert (table["S"] + table["B"] + table["D"] - table["gap"]).abs().max() <= 1e-9


def test_a_wrong_tensor_is_named_in_our_names(
    toy_kind: str, original: HookedRecurrentTransformer, tmp_path: Path
) -> None:
    write_toy(original, tmp_path / "toy")
    (tmp_path / "toy" / "toy.json").write_text(json.dumps({**SHAPE, "width": 48, "heads": 4}))
    with pytest.raises(WeightsError, match="embed.W_E"):
        load(f"{toy_kind}:{tmp_path / 'toy'}")
