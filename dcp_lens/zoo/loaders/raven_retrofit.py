"""``load("raven-retrofit:PATH")``: retrofitted-recurrence checkpoints (McLeish et al. 2025), a
dense Llama or OLMo-2 turned into a Huginn-style looped model, from their local files.

PATH is a folder holding ``config.json`` (a ``RavenConfig``, ``model_type`` "huginn_raven", the
same string as Huginn-0125) and ``model.safetensors`` or a sharded
``model.safetensors.index.json``, in the original key names. The variant is read from the keys,
never from a class name (`raven_family`): ``norm_3``/``norm_4`` are Huginn-0125's sandwich blocks,
``attn.q_norm`` the OLMo variant, two norms and no QK-norm the Llama variant. The architecture
maps onto `RecurrentConfig` as::

    e   = Prelude(wte[ids])                       no embedding scale (embed_scale = 1)
    s_0 = trunc-normal(init_values.std)           state_init="huginn" (or "zeros", "embed")
    s_t = Core(adapter([s_{t-1}; e]))             concat_adapter, state first
    logits = ln_f(Coda(s_r)) @ lm_head^T          no norm before the coda, untied head

Llama blocks are pre-norm (``norm_placement="pre"``: norm_1 -> ``ln1``, norm_2 -> ``ln2``). OLMo
blocks are post-norm (``"post"``: norm_1 -> ``ln1_post``, norm_2 -> ``ln2_post``) with QK-norm
over the whole q and k projections (``qk_norm``). Both use rotate-half rotary embeddings with
``rope_theta`` (``rope_base`` is stale in these configs and never read) and Llama 3 frequency
scaling when ``rope_scaling`` says so; ``Wqkv`` rows are [q | k | v] with grouped kv heads, and
``mlp.fc`` rows are [gate | up].

The dense parent a checkpoint was converted from is its negative control (`parent_layers`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, MutableMapping
from pathlib import Path
from types import UnionType
from typing import Any

import torch
from torch import Tensor

from dcp_lens.model.config import ROTARY_SCALING_FIELDS, RecurrentConfig
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
from dcp_lens.zoo.loaders.huginn import OUR_PART, PARTS, TIED_HEAD

KIND = "raven-retrofit"
VARIANTS = ("llama", "olmo")
EMBEDDING = "transformer.wte.weight"
# Per variant: the original norm keys of a block -> our norm modules.
BLOCK_NORMS = {
    "llama": {"norm_1": "ln1", "norm_2": "ln2"},
    "olmo": {"norm_1": "ln1_post", "norm_2": "ln2_post"},
}
PLACEMENT = {"llama": "pre", "olmo": "post"}
# How `RavenConfig.initial_state_mode` maps onto ``state_init`` ("skip-adapter" has no equivalent).
STATE_INIT = {"random": "huginn", "embed-init": "embed"}
RAVEN_SUPPORTED_SWITCHES: dict[str, tuple[str | int | float | bool | None, ...]] = {
    "model_type": ("huginn_raven",),
    "injection_type": ("linear",),
    "mlp_class_name": ("GatedMLP",),
    "nonlin_name": ("SiLU",),
    "bias": (False,),
    "qk_bias": (False,),
    "test_time_noise": (0, 0.0),
}
RAVEN_SOURCE_FIELDS: dict[str, type | UnionType] = {
    "n_embd": int,
    "n_heads": int,
    "num_key_value_heads": int | None,
    "head_dim": int | None,
    "intermediate_size": int,
    "padded_vocab_size": int | None,
    "vocab_size": int,
    "max_position_embeddings": int,
    "n_layers_in_prelude": int,
    "n_layers_in_recurrent_block": int,
    "n_layers_in_coda": int,
    "mean_recurrence": int,
    "init_values": dict[str, float] | None,
    "norm_eps": float,
    "rope_theta": float,
    "rope_scaling": dict[str, Any] | None,
    "tie_embeddings": bool,
    "initial_state_mode": str | None,
}
RAVEN_POSITIVE_FIELDS = (
    "n_embd", "n_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "padded_vocab_size", "vocab_size", "max_position_embeddings", "mean_recurrence", "norm_eps",
    "rope_theta",
)  # fmt: skip


def raven_family(config: Mapping[str, Any], keys: Collection[str]) -> str | None:
    """Which model a ``huginn_raven`` checkpoint is: "huginn" (Huginn-0125's sandwich blocks,
    ``norm_3``/``norm_4``), "olmo" (``attn.q_norm``), "llama" (two norms per block), or None for
    anything else. Read from the weights' key names; ``config``'s ``auto_map`` and embedding scale
    decide only when ``keys`` is empty (no weights found)."""
    if str(config.get("model_type", "")).lower() != "huginn_raven" and "n_embd" not in config:
        return None
    block_keys = [key for key in keys if key.startswith("transformer.prelude.")] or list(keys)
    if any(".norm_4." in key or ".norm_3." in key for key in block_keys):
        return "huginn"
    if any(".attn.q_norm." in key for key in block_keys):
        return "olmo"
    if any(".norm_1." in key for key in block_keys):
        return "llama"
    model_file = str((config.get("auto_map") or {}).get("AutoModelForCausalLM", ""))
    for variant in VARIANTS:
        if f"_{variant}." in model_file:
            return variant
    embed_scale = (config.get("init_values") or {}).get("embed_scale")
    if embed_scale is not None and float(embed_scale) == 1.0:
        return "llama"
    return "huginn" if "n_embd" in config else None


def folder_family(path: str | Path) -> str | None:
    """`raven_family` of a checkpoint folder (or its weights file): reads ``config.json`` and the
    safetensors headers, no tensor."""
    location = Path(path)
    folder = location.parent if location.is_file() else location
    config = read_json(folder / CONFIG_FILE)
    try:
        keys: Collection[str] = SafetensorsCheckpoint(location).shapes
    except (OSError, ValueError):  # no weights: the config alone decides
        keys = ()
    return raven_family(config, keys)


def retrofit_config(
    raven: Mapping[str, Any], variant: str, source: str = "config", **overrides: Any
) -> RecurrentConfig:
    """The `RecurrentConfig` of a retrofit checkpoint's ``config.json`` (``variant`` "llama" or
    "olmo", `raven_family`). ``n_iterations`` defaults to ``mean_recurrence``, the initial state
    to the checkpoint's (``initial_state_mode``); ``overrides`` replace any field."""
    if variant not in VARIANTS:
        raise ConfigError(f"{source}: variant {variant!r} is not one of {VARIANTS}.")
    check_source_fields(raven, RAVEN_SOURCE_FIELDS, source, RAVEN_POSITIVE_FIELDS)
    require_values(raven, RAVEN_SUPPORTED_SWITCHES, source)
    d_model, n_heads = required_int(raven, "n_embd", source), required_int(raven, "n_heads", source)
    init_values = raven.get("init_values") or {}
    fields: dict[str, Any] = dict(
        d_model=d_model,
        n_heads=n_heads,
        d_head=raven.get("head_dim") or d_model // n_heads,
        n_key_value_heads=raven.get("num_key_value_heads") or n_heads,
        d_mlp=required_int(raven, "intermediate_size", source),
        d_vocab=raven.get("padded_vocab_size") or required_int(raven, "vocab_size", source),
        n_ctx=required_int(raven, "max_position_embeddings", source),
        n_prelude=required_int(raven, "n_layers_in_prelude", source),
        n_core=required_int(raven, "n_layers_in_recurrent_block", source),
        n_coda=required_int(raven, "n_layers_in_coda", source),
        n_iterations=required_int(raven, "mean_recurrence", source),
        injection="concat_adapter",
        state_init=_state_init(raven, variant, source),
        state_init_std=float(init_values.get("std", math.sqrt(2 / (5 * d_model)))),
        normalization_type="RMS",
        norm_placement=PLACEMENT[variant],
        pre_coda_norm="none",
        iteration_norm="none",
        final_norm=True,
        eps=float(raven.get("norm_eps", 1e-5)),
        positional_embedding_type="rotary_rotate_half",
        rotary_base=float(_required(raven, "rope_theta", source)),
        rotary_scaling=_rotary_scaling(raven.get("rope_scaling"), source),
        qk_norm=variant == "olmo",
        act_fn="silu_gated",
        tie_unembed=bool(raven.get("tie_embeddings", False)),
        embed_scale=float(init_values.get("embed_scale", 1.0)),
    )
    fields.update(overrides)
    with naming_file(source):
        return RecurrentConfig(**fields)


def _required(raven: Mapping[str, Any], key: str, source: str) -> Any:
    if raven.get(key) is None:
        raise ConfigError(
            f"{source}: needs {key!r}; a retrofit checkpoint's config.json carries it (this "
            "family reads rope_theta, never rope_base)."
        )
    return raven[key]


def _state_init(raven: Mapping[str, Any], variant: str, source: str) -> str:
    """The Llama variant always draws its state at random; the OLMo variant follows
    ``initial_state_mode``."""
    mode = str(raven.get("initial_state_mode") or "random") if variant == "olmo" else "random"
    if mode not in STATE_INIT:
        raise ConfigError(
            f"{source}: initial_state_mode={mode!r} is not supported (dcp-lens implements "
            f"{sorted(STATE_INIT)}): 'skip-adapter' skips the adapter in iteration 1 only, which "
            "the protocol's fixed per-iteration step does not express."
        )
    return STATE_INIT[mode]


def _rotary_scaling(
    scaling: Mapping[str, Any] | None, source: str
) -> tuple[float, float, float, float] | None:
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ConfigError(
            f"{source}: rope_scaling type {rope_type!r} is not supported; dcp-lens implements "
            "unscaled rotary frequencies and 'llama3' scaling."
        )
    missing = [name for name in ROTARY_SCALING_FIELDS if name not in scaling]
    if missing:
        raise ConfigError(f"{source}: rope_scaling (llama3) lacks {missing}.")
    factor, low, high, context = (float(scaling[name]) for name in ROTARY_SCALING_FIELDS)
    return factor, low, high, context


def retrofit_tensor_shapes(
    cfg: RecurrentConfig, variant: str
) -> tuple[dict[str, Shape], dict[str, Shape | None]]:
    """(required, optional) original key -> shape for a retrofit checkpoint of ``cfg``."""
    d, hd, heads, d_mlp, kv = cfg.d_model, cfg.d_head, cfg.n_heads, cfg.d_mlp, cfg.n_key_value_heads
    assert d_mlp is not None and kv is not None
    expected: dict[str, Shape] = {EMBEDDING: (cfg.d_vocab, d)}
    for part, count_field in PARTS:
        for i in range(getattr(cfg, count_field)):
            prefix = f"transformer.{part}.{i}"
            for norm in BLOCK_NORMS[variant]:
                expected[f"{prefix}.{norm}.weight"] = (d,)
            expected[f"{prefix}.attn.Wqkv.weight"] = ((heads + 2 * kv) * hd, d)
            expected[f"{prefix}.attn.proj.weight"] = (d, heads * hd)
            if variant == "olmo":
                expected[f"{prefix}.attn.q_norm.weight"] = (heads * hd,)
                expected[f"{prefix}.attn.k_norm.weight"] = (kv * hd,)
            expected[f"{prefix}.mlp.fc.weight"] = (2 * d_mlp, d)
            expected[f"{prefix}.mlp.proj.weight"] = (d, d_mlp)
    expected["transformer.adapter.weight"] = (d, 2 * d)
    expected["transformer.ln_f.weight"] = (d,)
    optional: dict[str, Shape | None] = {}
    if cfg.tie_unembed:
        optional[TIED_HEAD] = (cfg.d_vocab, d)
    else:
        expected[TIED_HEAD] = (cfg.d_vocab, d)
    return expected, optional


def retrofit_state_dict(
    tensors: MutableMapping[str, Tensor], cfg: RecurrentConfig, variant: str
) -> dict[str, Tensor]:
    """Original retrofit tensors -> our `canonical_state_dict` names and layouts. Each tensor is
    taken out of ``tensors`` as it is converted, so an original and its re-laid-out copy are
    held together for one block at most (peak memory stays near the weights' size)."""
    state = {
        "embed.W_E": tensors.pop(EMBEDDING),
        "inject.W_adapter": tensors.pop("transformer.adapter.weight"),
        "ln_final.w": tensors.pop("transformer.ln_f.weight"),
    }
    if not cfg.tie_unembed:
        state["unembed.W_U"] = tensors.pop(TIED_HEAD).T.contiguous()
    for part, count_field in PARTS:
        for i in range(getattr(cfg, count_field)):
            source, target = f"transformer.{part}.{i}", f"{OUR_PART[part]}.{i}"
            state.update(_block_state(tensors, source, target, cfg, variant))
    return state


def _block_state(
    tensors: MutableMapping[str, Tensor],
    source: str,
    target: str,
    cfg: RecurrentConfig,
    variant: str,
) -> dict[str, Tensor]:
    heads, kv, d_head, d_mlp = cfg.n_heads, cfg.n_key_value_heads, cfg.d_head, cfg.d_mlp
    assert kv is not None and d_mlp is not None
    w_q, w_k, w_v = tensors.pop(f"{source}.attn.Wqkv.weight").split(
        [heads * d_head, kv * d_head, kv * d_head], dim=0
    )
    gate, up = tensors.pop(f"{source}.mlp.fc.weight").split(d_mlp, dim=0)
    state = {
        f"{target}.attn.W_Q": heads_in(w_q, heads),
        f"{target}.attn.W_K": heads_in(w_k, kv),
        f"{target}.attn.W_V": heads_in(w_v, kv),
        f"{target}.attn.W_O": heads_out(tensors.pop(f"{source}.attn.proj.weight"), heads),
        f"{target}.mlp.W_gate": gate.T.contiguous(),
        f"{target}.mlp.W_in": up.T.contiguous(),
        f"{target}.mlp.W_out": tensors.pop(f"{source}.mlp.proj.weight").T.contiguous(),
    }
    for norm, ours in BLOCK_NORMS[variant].items():
        state[f"{target}.{ours}.w"] = tensors.pop(f"{source}.{norm}.weight")
    if variant == "olmo":
        state[f"{target}.attn.q_norm.w"] = tensors.pop(f"{source}.attn.q_norm.weight")
        state[f"{target}.attn.k_norm.w"] = tensors.pop(f"{source}.attn.k_norm.weight")
    return state


def load_raven_retrofit(path: str | Path, **overrides: Any) -> HookedRecurrentTransformer:
    """Load a retrofitted-recurrence checkpoint (Llama or OLMo variant) from a local folder.

    Args:
        path: the folder, or its ``.safetensors`` file (``config.json`` must sit beside it).
        overrides: `RecurrentConfig` fields (``state_init="zeros"``, ``n_iterations=8``, …),
            ``device`` and ``dtype`` (default: the checkpoint's dtype, on CPU).

    Returns:
        A `HookedRecurrentTransformer` in eval mode with ``mean_recurrence`` iterations, and
        ``model.tokenizer`` the folder's own if it ships one.

    Raises:
        ConfigError: the folder holds Huginn-0125 or another architecture (the message names the
            kind that loads it), or a setting this mapping does not implement.
        WeightsError: a key is missing, unexpected or of the wrong shape (in the original names).
    """
    path = Path(path)
    folder = path.parent if path.is_file() else path
    config_overrides, device, dtype = split_overrides(overrides)
    config_path = folder / CONFIG_FILE
    raven = read_json(config_path)
    checkpoint = SafetensorsCheckpoint(path)
    variant = raven_family(raven, checkpoint.shapes)
    if variant not in VARIANTS:
        hint = "huginn:" if variant == "huginn" else "the kind of its architecture"
        raise ConfigError(
            f"{folder} is not a retrofitted-recurrence checkpoint (its keys and config.json "
            f"describe {variant or 'no huginn_raven model'}); load it with {hint}."
        )
    tokenizer = load_checkpoint_tokenizer(folder)
    if tokenizer is not None:
        config_overrides.setdefault("default_prepend_bos", tokenizer.prepends_bos)
    cfg = retrofit_config(raven, variant, source=str(config_path), **config_overrides)
    if tokenizer is not None and tokenizer.vocab_size > cfg.d_vocab:
        raise ConfigError(
            f"{folder}: its tokenizer has {tokenizer.vocab_size} tokens but the embedding has "
            f"{cfg.d_vocab} rows; the tokenizer and weights do not belong together."
        )
    expected, optional = retrofit_tensor_shapes(cfg, variant)
    check_tensor_shapes(checkpoint.shapes, expected, checkpoint.source, optional)
    tensors = LazyTensors(checkpoint, dtype)  # read one at a time as they are converted
    if cfg.tie_unembed:
        drop_tied_head(tensors, TIED_HEAD, EMBEDDING, checkpoint.source)
    state = retrofit_state_dict(tensors, cfg, variant)
    return build_model(
        HookedRecurrentTransformer, cfg, state, checkpoint.source, tokenizer, device=device
    )


# ------------------------------------------------------------------ the dense parent's layers

# Cosine similarity of a block's q/k/v weights with its parent layer's above which the layer is
# taken as found: a conversion copies them (1.0), training moves them only part of the way.
MATCH_SIMILARITY = 0.5
PARENT_QKV = ("q_proj", "k_proj", "v_proj")
RAVEN_COUNTS = {
    "prelude": "n_layers_in_prelude", "core": "n_layers_in_recurrent_block",
    "coda": "n_layers_in_coda",
}  # fmt: skip


def parent_layers(retrofit: str | Path, parent: str | Path) -> dict[str, Any]:
    """Which layer of the dense ``parent`` (a Hugging Face Llama or OLMo-2 folder) each prelude,
    core and coda block of ``retrofit`` was converted from, so the negative control's layers line
    up with the recurrent model's parts (the dense model's iteration t is its layer t - 1).

    Each block's ``Wqkv`` is compared with every parent layer's [q; k; v] by cosine similarity
    (only the safetensors headers and those weights are read). When every block's best layer
    clears `MATCH_SIMILARITY` the match is recorded (``found_by`` "weights"); otherwise the
    converter's convention is (prelude the first layers, coda the last, the core just before the
    coda, the layers between prelude and core dropped; ``found_by`` "convention").

    Returns:
        ``{"prelude": [...], "core": [...], "coda": [...], "dropped": [...], "n_parent_layers",
        "found_by", "min_similarity"}``, parent layer indices from 0.

    Raises:
        ConfigError: a folder is not a retrofit checkpoint, or the parent has fewer layers than
            the retrofit has blocks.
    """
    retrofit_config_path = Path(retrofit) / CONFIG_FILE
    raven = read_json(retrofit_config_path)
    blocks = SafetensorsCheckpoint(Path(retrofit))
    if raven_family(raven, blocks.shapes) not in VARIANTS:
        raise ConfigError(f"{retrofit} is not a retrofitted-recurrence checkpoint folder.")
    counts = {our: required_int(raven, field, str(retrofit_config_path))
              for our, field in RAVEN_COUNTS.items()}  # fmt: skip
    layers = SafetensorsCheckpoint(Path(parent))
    n_layers = len({key.split(".")[2] for key in layers.shapes if key.startswith("model.layers.")})
    if n_layers < sum(counts.values()):
        raise ConfigError(
            f"{parent} has {n_layers} layers (model.layers.*) but {retrofit} has "
            f"{sum(counts.values())} blocks; it is not this retrofit's dense parent."
        )
    wanted = [f"model.layers.{i}.self_attn.{name}.weight" for i in range(n_layers)
              for name in PARENT_QKV]  # fmt: skip
    parent_tensors = layers.read(wanted)
    parent_qkv = [
        torch.cat([parent_tensors[f"model.layers.{i}.self_attn.{n}.weight"] for n in PARENT_QKV])
        .flatten().float()
        for i in range(n_layers)
    ]  # fmt: skip
    mapping: dict[str, Any] = {}
    similarities: list[float] = []
    for (part, _), ours in zip(PARTS, ("prelude", "core", "coda"), strict=True):
        keys = [f"transformer.{part}.{j}.attn.Wqkv.weight" for j in range(counts[ours])]
        found = blocks.read(keys)
        mapping[ours] = []
        for key in keys:
            weight = found[key].flatten().float()
            scores = [_cosine(weight, candidate) for candidate in parent_qkv]
            best = max(range(n_layers), key=scores.__getitem__)
            mapping[ours].append(best)
            similarities.append(scores[best])
    if min(similarities, default=1.0) < MATCH_SIMILARITY:
        mapping = _conventional_layers(counts, n_layers)
        found_by = "convention"
    else:
        found_by = "weights"
    used = {layer for part in ("prelude", "core", "coda") for layer in mapping[part]}
    return {
        **{part: mapping[part] for part in ("prelude", "core", "coda")},
        "dropped": [i for i in range(n_layers) if i not in used],
        "n_parent_layers": n_layers,
        "found_by": found_by,
        "min_similarity": round(min(min(similarities, default=1.0), 1.0), 6),
    }


def _cosine(a: Tensor, b: Tensor) -> float:
    if a.shape != b.shape:
        return -1.0
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-30))


def _conventional_layers(counts: Mapping[str, int], n_layers: int) -> dict[str, list[int]]:
    """The converters' layout: prelude the first layers, coda the last, core right before it."""
    n_prelude, n_core, n_coda = counts["prelude"], counts["core"], counts["coda"]
    core_start = n_layers - n_coda - n_core
    return {
        "prelude": list(range(n_prelude)),
        "core": list(range(core_start, core_start + n_core)),
        "coda": list(range(n_layers - n_coda, n_layers)),
    }


def parent_layers_of_specs(model: str, dense: str) -> dict[str, Any] | None:
    """`parent_layers` for a run's model and dense-control specs, when the model is a
    ``raven-retrofit:PATH`` and the control a ``bridge:PATH`` (or a plain folder) with Hugging
    Face ``model.layers.*`` weights; None for any other pair."""
    kind, _, path = model.partition(":")
    if kind != KIND or not path:
        return None
    parent = dense.partition(":")[2] if dense.startswith("bridge:") else dense
    if not Path(parent).is_dir():
        return None
    return parent_layers(Path(path).parent if Path(path).is_file() else path, parent)
