"""``load("ouro:PATH")``: Ouro (ByteDance LoopLM 1.4B / 2.6B) from its local files.

PATH is a folder holding ``config.json`` (an ``OuroConfig``) and ``model.safetensors`` or a sharded
``model.safetensors.index.json``, in the original key names, or a folder written by
`OuroRecurrentTransformer.save_pretrained`. The architecture maps onto `RecurrentConfig` as::

    s_0 = embed_tokens[ids]                        n_prelude=0, state_init="embed", no scale
    s_t = model.norm(Layers(s_{t-1}))              n_core=num_hidden_layers, injection="none",
                                                   iteration_norm="own" (fed back into loop t+1)
    logits_t = s_t @ lm_head^T                     n_coda=0, final_norm=False, untied head

Each layer is ``x + Norm(Sub(Norm(x)))`` (``norm_placement="sandwich"``): input_layernorm ->
``ln1``, input_layernorm_2 -> ``ln1_post``, post_attention_layernorm -> ``ln2``,
post_attention_layernorm_2 -> ``ln2_post``; rotary embeddings are rotate-half.

The early-exit gate lives on `OuroRecurrentTransformer`: g_t = w . s_t + b and lambda_t =
sigmoid(g_t) for every step t, and the exit distribution p_t = lambda_t prod_{j<t}(1 - lambda_j),
the last step taking the remaining mass.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import UnionType
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens.hook_points import HookPoint

from dcp_lens.model.components.exit_gate import ExitGate, exit_distribution
from dcp_lens.model.config import RecurrentConfig
from dcp_lens.model.folder import (
    CONFIG_FILE,
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
from dcp_lens.model.tokenization import Tokenizer
from dcp_lens.protocol.states import capture_states
from dcp_lens.utils.checks import check_source_fields, naming_file
from dcp_lens.utils.errors import ConfigError
from dcp_lens.zoo.loaders.hf_tokenizer import load_checkpoint_tokenizer

OURO_SUPPORTED_SWITCHES: dict[str, tuple[str | bool | None, ...]] = {
    "hidden_act": ("silu",),
    "use_sliding_window": (False, None),
    "rope_scaling": (None,),
    "attention_bias": (False,),
    "mlp_bias": (False,),
}
LAYER_NORMS = {
    "input_layernorm": "ln1",
    "input_layernorm_2": "ln1_post",
    "post_attention_layernorm": "ln2",
    "post_attention_layernorm_2": "ln2_post",
}
GATE_PREFIX = "model.early_exit_gate"
HEAD = "lm_head.weight"
# Types of the OuroConfig fields read here (checked before any is used).
OURO_SOURCE_FIELDS: dict[str, type | UnionType] = {
    "hidden_size": int,
    "num_attention_heads": int,
    "num_key_value_heads": int | None,
    "head_dim": int | None,
    "intermediate_size": int,
    "vocab_size": int,
    "max_position_embeddings": int,
    "num_hidden_layers": int,
    "total_ut_steps": int,
    "rms_norm_eps": float,
    "rope_theta": float,
    "rope_parameters": dict[str, Any] | None,
    "tie_word_embeddings": bool,
    "initializer_range": float,
}
OURO_POSITIVE_FIELDS = (
    "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
    "vocab_size", "max_position_embeddings", "total_ut_steps", "rms_norm_eps", "rope_theta",
    "initializer_range",
)  # fmt: skip


@dataclass
class ExitOutputs:
    """Every step's readout and the exit distribution over steps (k = iterations run).

    Attributes:
        step_logits: logits read out after each step, [batch, pos, k, d_vocab].
        gate_logits: the exit gate before the sigmoid at each step, [batch, pos, k].
        exit_pdf: probability of exiting at each step, [batch, pos, k] (sums to 1 over k).
    """

    step_logits: Float[Tensor, "batch pos k d_vocab"]
    gate_logits: Float[Tensor, "batch pos k"]
    exit_pdf: Float[Tensor, "batch pos k"]

    def weighted_logits(self) -> Float[Tensor, "batch pos d_vocab"]:
        """sum_t p_t logits_t, Ouro's ``use_weighted_exit`` readout."""
        return torch.einsum("bpk,bpkv->bpv", self.exit_pdf, self.step_logits)

    def threshold_exit(
        self, threshold: float
    ) -> tuple[Float[Tensor, "batch pos d_vocab"], Int[Tensor, "batch pos"]]:
        """Per token, the first step whose cumulative exit probability reaches ``threshold`` (the
        last step if none does), as Ouro's ``early_exit_threshold``.

        Returns:
            (that step's logits [batch, pos, d_vocab], the 0-based step [batch, pos]).
        """
        reached = self.exit_pdf.cumsum(dim=-1) >= threshold
        last = self.exit_pdf.shape[-1] - 1
        step = torch.where(reached.any(dim=-1), reached.int().argmax(dim=-1), last)
        index = step[..., None, None].expand(*step.shape, 1, self.step_logits.shape[-1])
        return self.step_logits.gather(2, index)[:, :, 0], step


class OuroRecurrentTransformer(HookedRecurrentTransformer):
    """A `HookedRecurrentTransformer` with Ouro's early-exit gate.

    Hook points (fired by `exit_outputs` and `exit_probabilities`, not by ``forward``):

    - ``hook_exit_logits`` [batch, pos, k]: the gate logits g_t of every step t = 1..k.
    - ``hook_exit_pdf`` [batch, pos, k]: the exit distribution computed from them.

    Editing ``hook_exit_logits`` changes the distribution downstream. To cache them, run the
    method inside ``model.hooks(...)``; `run_with_cache` only wraps ``forward``.

    The gate is saved with the model (``exit_gate.weight``, ``exit_gate.bias`` in
    `canonical_state_dict`); reload with ``OuroRecurrentTransformer.from_pretrained(path)`` or
    ``load("ouro:path")``.
    """

    def __init__(self, cfg: RecurrentConfig, tokenizer: Tokenizer | None = None):
        super().__init__(cfg, tokenizer)
        self.exit_gate = ExitGate(cfg)
        if self.exit_gate.weight.device.type != "meta":
            # Offset from the base init's seed so the gate is not a copy of W_E's first row.
            seed = (cfg.seed if cfg.seed is not None else 0) + 1
            generator = torch.Generator().manual_seed(seed)
            with torch.no_grad():
                noise = torch.randn(self.exit_gate.weight.shape, generator=generator)
                self.exit_gate.weight.copy_(noise * cfg.init_std)
        self.hook_exit_logits = HookPoint()  # [batch, pos, k]
        self.hook_exit_pdf = HookPoint()  # [batch, pos, k]
        self.setup()

    def canonical_state_dict(self) -> dict[str, Tensor]:
        """The base model's parameters plus ``exit_gate.weight`` and ``exit_gate.bias``."""
        state = super().canonical_state_dict()
        state.update({f"exit_gate.{n}": p for n, p in self.exit_gate.named_parameters()})
        return state

    def step_states(
        self, tokens: Int[Tensor, "batch pos"], n_iterations: int | None = None
    ) -> Float[Tensor, "batch pos k d_model"]:
        """The state after every step t = 1..k (``loop.{t}.hook_state``), hooks applied."""
        if n_iterations is not None and n_iterations != self.n_iterations:
            with self.iterations(n_iterations):
                return self.step_states(tokens)
        k = self.n_iterations
        states, _ = capture_states(self, tokens, range(1, k + 1), return_type=None)
        return states.movedim(0, 2)

    def _exit_pdf(
        self, states: Float[Tensor, "batch pos k d_model"]
    ) -> tuple[Float[Tensor, "batch pos k"], Float[Tensor, "batch pos k"]]:
        gate_logits = self.hook_exit_logits(self.exit_gate(states))
        return gate_logits, self.hook_exit_pdf(exit_distribution(gate_logits))

    def exit_probabilities(
        self, tokens: Int[Tensor, "batch pos"], n_iterations: int | None = None
    ) -> Float[Tensor, "batch pos k"]:
        """The exit distribution p_1..p_k over the k steps (default: the active view)."""
        return self._exit_pdf(self.step_states(tokens, n_iterations))[1]

    def exit_outputs(
        self, tokens: Int[Tensor, "batch pos"], n_iterations: int | None = None
    ) -> ExitOutputs:
        """Every step's logits (``readout`` of each state), the gate logits and the exit
        distribution; see `ExitOutputs` for the weighted and threshold readouts."""
        states = self.step_states(tokens, n_iterations)
        gate_logits, exit_pdf = self._exit_pdf(states)
        step_logits = torch.stack(
            [self.readout(states[:, :, t]) for t in range(states.shape[2])], dim=2
        )
        return ExitOutputs(step_logits=step_logits, gate_logits=gate_logits, exit_pdf=exit_pdf)


def ouro_config(
    ouro: Mapping[str, Any], source: str = "config", **overrides: Any
) -> RecurrentConfig:
    """The `RecurrentConfig` of an OuroConfig dict (Ouro's ``config.json``); ``n_iterations``
    defaults to ``total_ut_steps``, and ``overrides`` replace any field."""
    check_source_fields(ouro, OURO_SOURCE_FIELDS, source, OURO_POSITIVE_FIELDS)
    require_values(ouro, OURO_SUPPORTED_SWITCHES, source)
    _check_layer_types(ouro, source)
    rope = ouro.get("rope_parameters") or {}
    if "rope_theta" not in ouro:
        check_source_fields(rope, {"rope_theta": float}, f"{source} (rope_parameters)", ())
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(
            f"{source}: rope_type={rope['rope_type']!r} is not supported; dcp-lens implements "
            "the default (unscaled) rotary embedding."
        )
    d_model = required_int(ouro, "hidden_size", source)
    n_heads = required_int(ouro, "num_attention_heads", source)
    fields: dict[str, Any] = dict(
        d_model=d_model,
        n_heads=n_heads,
        d_head=ouro.get("head_dim") or d_model // n_heads,
        n_key_value_heads=ouro.get("num_key_value_heads") or n_heads,
        d_mlp=required_int(ouro, "intermediate_size", source),
        d_vocab=required_int(ouro, "vocab_size", source),
        n_ctx=required_int(ouro, "max_position_embeddings", source),
        n_prelude=0,
        n_core=required_int(ouro, "num_hidden_layers", source),
        n_coda=0,
        n_iterations=required_int(ouro, "total_ut_steps", source),
        injection="none",
        state_init="embed",
        normalization_type="RMS",
        norm_placement="sandwich",
        pre_coda_norm="none",
        iteration_norm="own",
        final_norm=False,
        eps=float(ouro.get("rms_norm_eps", 1e-6)),
        positional_embedding_type="rotary_rotate_half",
        rotary_base=float(ouro.get("rope_theta", rope.get("rope_theta", 10000.0))),
        act_fn="silu_gated",
        tie_unembed=bool(ouro.get("tie_word_embeddings", False)),
        embed_scale=1.0,
        init_std=float(ouro.get("initializer_range", 0.02)),
    )
    fields.update(overrides)
    with naming_file(source):
        return RecurrentConfig(**fields)


def _check_layer_types(ouro: Mapping[str, Any], source: str) -> None:
    """Every layer attends to the whole context: ``layer_types`` (when given) lists only
    "full_attention", one per layer; a sliding-window layer would be computed wrongly here."""
    layer_types = ouro.get("layer_types")
    if layer_types is None:
        return
    n_layers = ouro.get("num_hidden_layers")
    if not isinstance(layer_types, list) or len(layer_types) != n_layers:
        raise ConfigError(
            f"{source}: layer_types must list one type per layer (num_hidden_layers="
            f"{n_layers}), got {layer_types!r}."
        )
    other = sorted({str(kind) for kind in layer_types} - {"full_attention"})
    if other:
        raise ConfigError(
            f"{source}: layer_types holds {other}; dcp-lens implements full attention only (a "
            "sliding window changes what each layer sees), so this checkpoint is not supported."
        )


def ouro_tensor_shapes(cfg: RecurrentConfig) -> tuple[dict[str, Shape], dict[str, Shape | None]]:
    """(required, optional) original key -> shape for an Ouro checkpoint of ``cfg``."""
    d, hd, d_mlp = cfg.d_model, cfg.d_head, cfg.d_mlp
    n_kv = cfg.n_key_value_heads
    assert d_mlp is not None and n_kv is not None
    expected: dict[str, Shape] = {"model.embed_tokens.weight": (cfg.d_vocab, d)}
    for i in range(cfg.n_core):
        prefix = f"model.layers.{i}"
        expected[f"{prefix}.self_attn.q_proj.weight"] = (cfg.n_heads * hd, d)
        expected[f"{prefix}.self_attn.k_proj.weight"] = (n_kv * hd, d)
        expected[f"{prefix}.self_attn.v_proj.weight"] = (n_kv * hd, d)
        expected[f"{prefix}.self_attn.o_proj.weight"] = (d, cfg.n_heads * hd)
        expected[f"{prefix}.mlp.gate_proj.weight"] = (d_mlp, d)
        expected[f"{prefix}.mlp.up_proj.weight"] = (d_mlp, d)
        expected[f"{prefix}.mlp.down_proj.weight"] = (d, d_mlp)
        for norm in LAYER_NORMS:
            expected[f"{prefix}.{norm}.weight"] = (d,)
    expected["model.norm.weight"] = (d,)
    expected[f"{GATE_PREFIX}.weight"] = (1, d)
    expected[f"{GATE_PREFIX}.bias"] = (1,)
    optional: dict[str, Shape | None] = {}
    if cfg.tie_unembed:
        optional[HEAD] = (cfg.d_vocab, d)
    else:
        expected[HEAD] = (cfg.d_vocab, d)
    return expected, optional


def ouro_state_dict(tensors: Mapping[str, Tensor], cfg: RecurrentConfig) -> dict[str, Tensor]:
    """Original Ouro tensors -> `OuroRecurrentTransformer.canonical_state_dict` names/layouts."""
    n_kv = cfg.n_key_value_heads
    assert n_kv is not None
    state = {
        "embed.W_E": tensors["model.embed_tokens.weight"],
        "ln_iter.w": tensors["model.norm.weight"],
        "exit_gate.weight": tensors[f"{GATE_PREFIX}.weight"],
        "exit_gate.bias": tensors[f"{GATE_PREFIX}.bias"],
    }
    if not cfg.tie_unembed:
        state["unembed.W_U"] = tensors[HEAD].T.contiguous()
    for i in range(cfg.n_core):
        source, target = f"model.layers.{i}", f"core.{i}"
        attn, mlp = f"{source}.self_attn", f"{source}.mlp"
        state.update(
            {
                f"{target}.attn.W_Q": heads_in(tensors[f"{attn}.q_proj.weight"], cfg.n_heads),
                f"{target}.attn.W_K": heads_in(tensors[f"{attn}.k_proj.weight"], n_kv),
                f"{target}.attn.W_V": heads_in(tensors[f"{attn}.v_proj.weight"], n_kv),
                f"{target}.attn.W_O": heads_out(tensors[f"{attn}.o_proj.weight"], cfg.n_heads),
                f"{target}.mlp.W_gate": tensors[f"{mlp}.gate_proj.weight"].T.contiguous(),
                f"{target}.mlp.W_in": tensors[f"{mlp}.up_proj.weight"].T.contiguous(),
                f"{target}.mlp.W_out": tensors[f"{mlp}.down_proj.weight"].T.contiguous(),
            }
        )
        for norm, ours in LAYER_NORMS.items():
            state[f"{target}.{ours}.w"] = tensors[f"{source}.{norm}.weight"]
    return state


def _is_save_pretrained_folder(folder: Path) -> bool:
    config_path = folder / CONFIG_FILE
    return config_path.is_file() and "n_core" in read_json(config_path)


def load_ouro(path: str | Path, **overrides: Any) -> OuroRecurrentTransformer:
    """Load Ouro from a local folder (``config.json`` + safetensors weights), or a folder written
    by `OuroRecurrentTransformer.save_pretrained`.

    Args:
        path: the folder, or its ``.safetensors`` file (``config.json`` must sit beside it).
        overrides: `RecurrentConfig` fields (``n_iterations=8``, …), ``device`` and ``dtype``
            (default: the checkpoint's dtype, on CPU).

    Returns:
        An `OuroRecurrentTransformer` in eval mode with ``total_ut_steps`` iterations, and
        ``model.tokenizer`` the folder's own (`HFTokenizer`, from ``tokenizer.json``) if it ships
        one; ``default_prepend_bos`` then follows its ``tokenizer_config.json``.

    Raises:
        ValueError: the config describes another architecture, or the weights miss a key, hold an
            unexpected one, have a wrong shape or are truncated (named in Ouro's key names).
    """
    path = Path(path)
    folder = path.parent if path.is_file() else path
    config_overrides, device, dtype = split_overrides(overrides)
    tokenizer = load_checkpoint_tokenizer(folder)
    if tokenizer is not None:
        config_overrides.setdefault("default_prepend_bos", tokenizer.prepends_bos)
    if path.is_dir() and _is_save_pretrained_folder(folder):
        model = OuroRecurrentTransformer.from_pretrained(folder, device=device, **config_overrides)
        assert isinstance(model, OuroRecurrentTransformer)
        model.tokenizer = tokenizer
        return model if dtype is None else model.to(dtype)
    config_path = folder / CONFIG_FILE
    cfg = ouro_config(read_json(config_path), source=str(config_path), **config_overrides)
    checkpoint = SafetensorsCheckpoint(path)
    expected, optional = ouro_tensor_shapes(cfg)
    check_tensor_shapes(checkpoint.shapes, expected, checkpoint.source, optional)
    tensors = checkpoint.read(dtype=dtype)
    if cfg.tie_unembed:
        drop_tied_head(tensors, HEAD, "model.embed_tokens.weight", checkpoint.source)
    state = ouro_state_dict(tensors, cfg)
    return build_model(
        OuroRecurrentTransformer, cfg, state, checkpoint.source, tokenizer, device=device
    )
