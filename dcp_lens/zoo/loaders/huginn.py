"""``load("huginn:PATH")``: Huginn-0125 ("raven", tomg-group-umd) from its local files.

PATH is a folder holding ``config.json`` (a ``RavenConfig``) and ``model.safetensors`` or a sharded
``model.safetensors.index.json``, in the original key names. The architecture maps onto
`RecurrentConfig` as follows::

    x0   = sqrt(n_embd) * wte[ids]                          embed_scale
    e    = Prelude(x0)                                      n_layers_in_prelude SandwichBlocks
    s_0  = trunc-normal(std) * sqrt(n_embd)                 state_init="huginn" (or "zeros")
    s_t  = Core(adapter([s_{t-1}; e]))                      concat_adapter, state first
    logits = ln_f(Coda(ln_f(s_r))) @ wte^T                  pre_coda_norm="final", tied head

SandwichBlock is ``Norm(x + Sub(Norm(x)))`` (``norm_placement="sandwich_residual"``): norm_1 ->
``ln1``, norm_2 -> ``ln1_post``, norm_3 -> ``ln2``, norm_4 -> ``ln2_post``. ``Wqkv`` rows are
[q | k | v], head-major within each; ``qk_bias`` [2, 1, heads, d_head] is added to q and k before
the (interleaved) rotary embedding; ``mlp.fc`` rows are [gate | up].
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from types import UnionType
from typing import Any

from torch import Tensor

from dcp_lens.model.config import RecurrentConfig
from dcp_lens.model.folder import (
    CONFIG_FILE,
    LazyTensors,
    SafetensorsCheckpoint,
    Shape,
    build_model,
    check_tensor_shapes,
    drop_tied_head,
    heads_in,
    heads_out,
    read_json,
    require_values,
    required_int,
    split_overrides,
)
from dcp_lens.model.hooked_recurrent_transformer import HookedRecurrentTransformer
from dcp_lens.utils.checks import check_source_fields, naming_file
from dcp_lens.utils.errors import ConfigError
from dcp_lens.zoo.loaders.hf_tokenizer import load_checkpoint_tokenizer

# Architecture switches of RavenConfig and the values this mapping implements (Huginn-0125's).
HUGINN_SUPPORTED_SWITCHES: dict[str, tuple[str | int | float | bool, ...]] = {
    "architecture_class_name": ("RecurrentGPT",),
    "block_class_name": ("SandwichBlock",),
    "norm_class_name": ("RMSNorm_llama",),
    "mlp_class_name": ("GatedMLP",),
    "nonlin_name": ("SiLU",),
    "injection_type": ("linear",),
    "bias": (False,),
    "tie_embeddings": (True,),
    "test_time_noise": (0, 0.0),
}
# The Huginn layout's parts (their count fields), which the Raven retrofit shares, and ours.
PARTS = (("prelude", "n_prelude"), ("core_block", "n_core"), ("coda", "n_coda"))
OUR_PART = {"prelude": "prelude", "core_block": "core", "coda": "coda"}
# Persistent RoPE table of the reference; recomputed from rope_base instead of read.
ROPE_BUFFER = "freqs_cis"
TIED_HEAD = "lm_head.weight"
# Types of the RavenConfig fields read here (checked before any is used).
HUGINN_SOURCE_FIELDS: dict[str, type | UnionType] = {
    "n_embd": int,
    "n_heads": int,
    "num_attention_heads": int,
    "num_key_value_heads": int | None,
    "head_dim": int | None,
    "intermediate_size": int,
    "padded_vocab_size": int | None,
    "vocab_size": int,
    "block_size": int,
    "n_layers_in_prelude": int,
    "n_layers_in_recurrent_block": int,
    "n_layers_in_coda": int,
    "mean_recurrence": int,
    "init_values": dict[str, float] | None,
    "norm_eps": float,
    "rope_base": float,
    "qk_bias": bool,
}
HUGINN_POSITIVE_FIELDS = (
    "n_embd", "n_heads", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "padded_vocab_size", "vocab_size", "block_size", "mean_recurrence",
    "norm_eps", "rope_base",
)  # fmt: skip


# tomg-group-umd/huginn-0125 config.json (RavenConfig): the architecture fields, for building
# Huginn-shaped models without a download (`dcp-lens bench --preset huginn`, the real-scale demo).
HUGINN_0125: dict[str, Any] = {
    "architecture_class_name": "RecurrentGPT",
    "block_class_name": "SandwichBlock",
    "norm_class_name": "RMSNorm_llama",
    "mlp_class_name": "GatedMLP",
    "nonlin_name": "SiLU",
    "injection_type": "linear",
    "bias": False,
    "qk_bias": True,
    "tie_embeddings": True,
    "n_embd": 5280,
    "n_heads": 55,
    "num_key_value_heads": 55,
    "head_dim": 96,
    "intermediate_size": 17920,
    "vocab_size": 65536,
    "padded_vocab_size": 65536,
    "block_size": 4096,
    "n_layers_in_prelude": 2,
    "n_layers_in_recurrent_block": 4,
    "n_layers_in_coda": 2,
    "mean_recurrence": 32,
    "norm_eps": 1e-6,
    "rope_base": 50000.0,
    "test_time_noise": 0,
    "init_values": {"std": math.sqrt(2 / (5 * 5280)), "embed_scale": math.sqrt(5280)},
}


def huginn_config(
    raven: Mapping[str, Any], source: str = "config", **overrides: Any
) -> RecurrentConfig:
    """The `RecurrentConfig` of a RavenConfig dict (Huginn's ``config.json``).

    ``n_iterations`` defaults to ``mean_recurrence`` and the initial state to Huginn's own
    truncated-normal draw; ``overrides`` replace any field (e.g. ``state_init="zeros"``).
    """
    check_source_fields(raven, HUGINN_SOURCE_FIELDS, source, HUGINN_POSITIVE_FIELDS)
    require_values(raven, HUGINN_SUPPORTED_SWITCHES, source)
    d_model = required_int(raven, "n_embd", source)
    vocab, padded = required_int(raven, "vocab_size", source), raven.get("padded_vocab_size")
    if padded is not None and vocab > padded:
        raise ConfigError(
            f"{source}: vocab_size={vocab} is larger than padded_vocab_size={padded}, the rows "
            "of the embedding; token ids past it would have no weights. Fix the config."
        )
    n_heads = raven.get("num_attention_heads", raven.get("n_heads"))
    if not isinstance(n_heads, int):
        raise ConfigError(f"{source}: needs an int 'n_heads' (or 'num_attention_heads').")
    n_kv_heads = raven.get("num_key_value_heads") or n_heads
    if n_kv_heads != n_heads:
        raise ConfigError(
            f"{source}: num_key_value_heads={n_kv_heads} differs from n_heads={n_heads}; Huginn's "
            "qk_bias layout assumes one key head per query head, so this is not supported."
        )
    init_values = raven.get("init_values") or {}
    fields: dict[str, Any] = dict(
        d_model=d_model,
        n_heads=n_heads,
        d_head=raven.get("head_dim") or d_model // n_heads,
        d_mlp=required_int(raven, "intermediate_size", source),
        d_vocab=raven.get("padded_vocab_size") or required_int(raven, "vocab_size", source),
        n_ctx=required_int(raven, "block_size", source),
        n_prelude=required_int(raven, "n_layers_in_prelude", source),
        n_core=required_int(raven, "n_layers_in_recurrent_block", source),
        n_coda=required_int(raven, "n_layers_in_coda", source),
        n_iterations=required_int(raven, "mean_recurrence", source),
        injection="concat_adapter",
        state_init="huginn",
        state_init_std=float(init_values.get("std", math.sqrt(2 / (5 * d_model)))),
        normalization_type="RMS",
        norm_placement="sandwich_residual",
        pre_coda_norm="final",
        iteration_norm="none",
        final_norm=True,
        eps=float(raven.get("norm_eps", 1e-6)),
        positional_embedding_type="rotary_interleaved",
        rotary_base=float(raven.get("rope_base", 50000.0)),
        qk_bias=bool(raven.get("qk_bias", True)),
        act_fn="silu_gated",
        tie_unembed=True,
        embed_scale=float(init_values.get("embed_scale", math.sqrt(d_model))),
    )
    fields.update(overrides)
    with naming_file(source):
        return RecurrentConfig(**fields)


def huginn_tensor_shapes(cfg: RecurrentConfig) -> tuple[dict[str, Shape], dict[str, Shape | None]]:
    """(required, optional) original key -> shape for a Huginn checkpoint of ``cfg``."""
    d, hd, heads, d_mlp = cfg.d_model, cfg.d_head, cfg.n_heads, cfg.d_mlp
    assert d_mlp is not None
    expected: dict[str, Shape] = {"transformer.wte.weight": (cfg.d_vocab, d)}
    for part, count_field in PARTS:
        for i in range(getattr(cfg, count_field)):
            prefix = f"transformer.{part}.{i}"
            for norm in ("norm_1", "norm_2", "norm_3", "norm_4"):
                expected[f"{prefix}.{norm}.weight"] = (d,)
            expected[f"{prefix}.attn.Wqkv.weight"] = (3 * heads * hd, d)
            if cfg.qk_bias:
                expected[f"{prefix}.attn.qk_bias"] = (2, 1, heads, hd)
            expected[f"{prefix}.attn.proj.weight"] = (d, heads * hd)
            expected[f"{prefix}.mlp.fc.weight"] = (2 * d_mlp, d)
            expected[f"{prefix}.mlp.proj.weight"] = (d, d_mlp)
    expected["transformer.adapter.weight"] = (d, 2 * d)
    expected["transformer.ln_f.weight"] = (d,)
    optional: dict[str, Shape | None] = {TIED_HEAD: (cfg.d_vocab, d), ROPE_BUFFER: None}
    return expected, optional


def huginn_state_dict(
    tensors: MutableMapping[str, Tensor], cfg: RecurrentConfig
) -> dict[str, Tensor]:
    """Original Huginn tensors -> our `canonical_state_dict` names and layouts. Each tensor is
    taken out of ``tensors`` as it is converted, so an original and its re-laid-out copy are
    held together for one block at most."""
    state = {
        "embed.W_E": tensors.pop("transformer.wte.weight"),
        "inject.W_adapter": tensors.pop("transformer.adapter.weight"),
        "ln_final.w": tensors.pop("transformer.ln_f.weight"),
    }
    for part, count_field in PARTS:
        for i in range(getattr(cfg, count_field)):
            source, target = f"transformer.{part}.{i}", f"{OUR_PART[part]}.{i}"
            state.update(_block_state(tensors, source, target, cfg))
    return state


def _block_state(
    tensors: MutableMapping[str, Tensor], source: str, target: str, cfg: RecurrentConfig
) -> dict[str, Tensor]:
    heads, d_head, d_mlp = cfg.n_heads, cfg.d_head, cfg.d_mlp
    assert d_mlp is not None
    w_q, w_k, w_v = tensors.pop(f"{source}.attn.Wqkv.weight").split(heads * d_head, dim=0)
    gate, up = tensors.pop(f"{source}.mlp.fc.weight").split(d_mlp, dim=0)
    state = {
        f"{target}.ln1.w": tensors.pop(f"{source}.norm_1.weight"),
        f"{target}.ln1_post.w": tensors.pop(f"{source}.norm_2.weight"),
        f"{target}.ln2.w": tensors.pop(f"{source}.norm_3.weight"),
        f"{target}.ln2_post.w": tensors.pop(f"{source}.norm_4.weight"),
        f"{target}.attn.W_Q": heads_in(w_q, heads),
        f"{target}.attn.W_K": heads_in(w_k, heads),
        f"{target}.attn.W_V": heads_in(w_v, heads),
        f"{target}.attn.W_O": heads_out(tensors.pop(f"{source}.attn.proj.weight"), heads),
        f"{target}.mlp.W_gate": gate.T.contiguous(),
        f"{target}.mlp.W_in": up.T.contiguous(),
        f"{target}.mlp.W_out": tensors.pop(f"{source}.mlp.proj.weight").T.contiguous(),
    }
    if cfg.qk_bias:
        qk_bias = tensors.pop(f"{source}.attn.qk_bias")
        state[f"{target}.attn.b_Q"] = qk_bias[0, 0].contiguous()
        state[f"{target}.attn.b_K"] = qk_bias[1, 0].contiguous()
    return state


def load_huginn(path: str | Path, **overrides: Any) -> HookedRecurrentTransformer:
    """Load Huginn from a local folder (``config.json`` + safetensors weights).

    Args:
        path: the folder, or its ``.safetensors`` file (``config.json`` must sit beside it).
        overrides: `RecurrentConfig` fields (``state_init="zeros"``, ``n_iterations=8``, …),
            ``device`` and ``dtype`` (default: the checkpoint's dtype, on CPU).

    Returns:
        A `HookedRecurrentTransformer` in eval mode with ``mean_recurrence`` iterations, and
        ``model.tokenizer`` the folder's own (`HFTokenizer`, from ``tokenizer.json``) if it ships
        one; ``default_prepend_bos`` then follows its ``tokenizer_config.json``.

    Raises:
        ValueError: the config describes another architecture, or the weights miss a key, hold an
            unexpected one, have a wrong shape or are truncated (named in Huginn's key names).
    """
    path = Path(path)
    folder = path.parent if path.is_file() else path
    config_overrides, device, dtype = split_overrides(overrides)
    tokenizer = load_checkpoint_tokenizer(folder)
    if tokenizer is not None:
        config_overrides.setdefault("default_prepend_bos", tokenizer.prepends_bos)
    config_path = folder / CONFIG_FILE
    cfg = huginn_config(read_json(config_path), source=str(config_path), **config_overrides)
    if tokenizer is not None and tokenizer.vocab_size > cfg.d_vocab:
        raise ConfigError(
            f"{folder}: its tokenizer has {tokenizer.vocab_size} tokens but the model's "
            f"embedding has {cfg.d_vocab} rows (config.json vocab_size / padded_vocab_size); "
            "the tokenizer and weights do not belong together."
        )
    checkpoint = SafetensorsCheckpoint(path)
    expected, optional = huginn_tensor_shapes(cfg)
    check_tensor_shapes(checkpoint.shapes, expected, checkpoint.source, optional)
    tensors = LazyTensors(checkpoint, dtype)  # read one at a time; the RoPE table never
    drop_tied_head(tensors, TIED_HEAD, "transformer.wte.weight", checkpoint.source)
    state = huginn_state_dict(tensors, cfg)
    return build_model(
        HookedRecurrentTransformer, cfg, state, checkpoint.source, tokenizer, device=device
    )
