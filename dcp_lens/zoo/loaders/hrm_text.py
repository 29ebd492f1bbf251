"""``load("hrm-text:PATH")``: HRM-Text (transformers' ``hrm_text`` model type) from its local files.

PATH is a folder holding ``config.json`` (an ``HrmTextConfig``, ``model_type`` "hrm_text") and
``model.safetensors`` or a sharded ``model.safetensors.index.json``, in the layout the hub and
``HrmTextForCausalLM.save_pretrained`` write (``attn.gqkv_proj`` rows [gate | q | k | v],
``mlp.gate_up_proj`` rows [gate | up]). The model nests two loops: an L stack run ``L_cycles``
times inside each of ``H_cycles`` outer cycles, with an inner state z_L carried across them::

    z_H = embedding_scale * embed_tokens[ids]      s_0 = z_H (state_init="embed"), no prelude
    z_L = z_L_init                                 the inner state's start (a weight)
    for each outer cycle t = 1..k:                 one iteration of dcp-lens's loop
        repeat L_cycles times: z_L = L(z_L + z_H)  L: the L stack's layers, then an RMSNorm
        z_H = H(z_H + z_L)                         H: the H stack's layers, then an RMSNorm
    logits = z_H @ lm_head^T                       no coda, no final norm

**k counts outer cycles, each with its inner loop complete.** The state s_t is z_H after cycle t
(what the readout reads); z_L after cycle t is hooked at ``inner.{t}.hook_state``. The core of one
iteration is ``(L_cycles + 1) * n`` block applications for stacks of n layers: position
``j * n + l`` (j < L_cycles) is L layer l (one weight for every j), position ``L_cycles * n + l``
is H layer l. Between stack passes the stream is normalised and z_H added (`HrmRecurrentTransformer`
does that between blocks; every block keeps its TransformerLens hooks). Blocks are pre-norm with
weightless RMSNorms (our ``ln1``/``ln2`` hold ones) and a sigmoid gate on each head's attention
output (``attn.hook_gate``). A count of inner passes that is not a whole number of outer cycles is
not an iteration here, so L_cycles is fixed by the checkpoint and an override is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType, UnionType
from typing import Any

import torch
import torch.nn.functional as F
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from dcp_lens.model.components.attention import Attention, flat_heads
from dcp_lens.model.components.block import TransformerBlock
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
from dcp_lens.model.hooked_recurrent_transformer import (
    HookedRecurrentTransformer,
    ResumeError,
    _share_parameters,
)
from dcp_lens.model.tokenization import Tokenizer
from dcp_lens.utils.checks import check_source_fields, naming_file
from dcp_lens.utils.errors import ConfigError, UnsupportedToolError
from dcp_lens.zoo.loaders.hf_tokenizer import load_checkpoint_tokenizer

HRM_KIND = "hrm-text"
MODEL_TYPE = "hrm_text"
HRM_EMBEDDING, HRM_HEAD, INNER_INIT = (
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.z_L_init",
)
STACKS = ("L_module", "H_module")
SUPPORTED_SWITCHES: dict[str, tuple[str | bool | None, ...]] = {
    "model_type": (MODEL_TYPE,),
    "hidden_act": ("silu",),
    "attention_bias": (False,),
    "mlp_bias": (False,),
}
SOURCE_FIELDS: dict[str, type | UnionType] = {
    "hidden_size": int,
    "num_attention_heads": int,
    "head_dim": int | None,
    "intermediate_size": int,
    "vocab_size": int,
    "max_position_embeddings": int,
    "num_hidden_layers": int,
    "num_layers_per_stack": int | None,
    "H_cycles": int,
    "L_cycles": int,
    "rms_norm_eps": float,
    "rope_parameters": dict[str, Any] | None,
    "tie_word_embeddings": bool,
    "initializer_range": float,
    "embedding_scale": float | None,
    "prefix_lm": bool,
}
POSITIVE_FIELDS = (
    "hidden_size",
    "num_attention_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "num_hidden_layers",
    "num_layers_per_stack",
    "H_cycles",
    "L_cycles",
    "rms_norm_eps",
    "initializer_range",
    "embedding_scale",
)
# The fields the nested loop fixes: an override would describe another model.
FIXED_FIELDS = (
    "n_prelude",
    "n_core",
    "n_coda",
    "injection",
    "state_init",
    "norm_placement",
    "iteration_norm",
    "pre_coda_norm",
    "final_norm",
    "normalization_type",
    "act_fn",
)
STREAM_REFUSAL = (
    "HRM-Text's stream is not one sum of components: between stack passes it is normalised by a "
    "weightless RMSNorm and z_H is added again, and z_L is carried from cycle to cycle outside "
    "the stream, so dcp-lens does not decompose it (accumulated_resid, decompose_resid, "
    "stack_activation with its components). Read the hooks themselves: blocks.{i}.hook_*, "
    "loop.{t}.hook_state (z_H) and inner.{t}.hook_state (z_L)."
)


class GatedAttention(Attention):
    """`Attention` whose heads' outputs are scaled by sigmoid(x W_G) before ``W_O`` (HRM-Text's
    ``gate_proj``). ``W_G`` is [head, d_model, d_head]; ``hook_gate`` holds the sigmoid
    [batch, pos, head, d_head] and ``hook_z`` the gated output."""

    def __init__(self, cfg: RecurrentConfig):
        super().__init__(cfg)
        self.W_G = nn.Parameter(torch.empty(cfg.n_heads, cfg.d_model, cfg.d_head))
        self.hook_gate = HookPoint()  # [batch, pos, head, d_head]

    def gate_output(
        self, x: Float[Tensor, "batch pos d_model"], z: Float[Tensor, "batch pos head d_head"]
    ) -> Float[Tensor, "batch pos head d_head"]:
        gate = (x @ flat_heads(self.W_G)).view(*x.shape[:2], self.n_heads, self.d_head)
        return z * self.hook_gate(torch.sigmoid(gate))


class GatedBlock(TransformerBlock):
    """A `TransformerBlock` with `GatedAttention`."""

    def __init__(self, cfg: RecurrentConfig):
        super().__init__(cfg)
        self.attn = GatedAttention(cfg)


class InnerStateHooks(nn.Module):
    """``inner.{t}.hook_state``: z_L after outer cycle t (t = 0: z_L_init) [batch, pos, d_model]."""

    def __init__(self) -> None:
        super().__init__()
        self.hook_state = HookPoint()


class HrmRecurrentTransformer(HookedRecurrentTransformer):
    """HRM-Text's nested loop as a `HookedRecurrentTransformer`: one iteration is one outer cycle
    (``inner_cycles`` passes of the L stack, then the H stack), the state s_t is z_H.

    Args:
        cfg: the architecture (``n_core = (inner_cycles + 1) * stack_depth``, no prelude or coda).
        tokenizer: optional, as the base class.
        stack_depth: layers per stack (n).
        inner_cycles: passes of the L stack per outer cycle (L_cycles).
    """

    block_class = GatedBlock
    stream_refusal = STREAM_REFUSAL
    inner: nn.ModuleList  # inner.{t}: `InnerStateHooks` of the active view, t = 0..k
    # What one forward carries between blocks: "high" (z_H entering the cycle), "low" (z_L).
    _carry: dict[str, Tensor]
    _inner_hooks: list[InnerStateHooks]  # every one built, for any view

    def __init__(
        self,
        cfg: RecurrentConfig,
        tokenizer: Tokenizer | None = None,
        *,
        stack_depth: int,
        inner_cycles: int,
    ):
        if cfg.n_prelude or cfg.n_coda or cfg.n_core != (inner_cycles + 1) * stack_depth:
            raise ConfigError(
                f"an HRM-Text core is (inner_cycles + 1) * stack_depth = {inner_cycles + 1} * "
                f"{stack_depth} layers with no prelude or coda; got n_prelude={cfg.n_prelude}, "
                f"n_core={cfg.n_core}, n_coda={cfg.n_coda}."
            )
        self.__dict__["_inner_hooks"] = []
        self.__dict__["_carry"] = {}
        super().__init__(cfg, tokenizer)
        self.stack_depth, self.inner_cycles = stack_depth, inner_cycles
        self.inner_init = nn.Parameter(torch.zeros(cfg.d_model))
        self.tie_weights()
        self.setup()

    # -------------------------------------------------------------- weights shared in the core

    def _tied_positions(self) -> list[tuple[int, int]]:
        """(position, owner position) of every L-stack pass after the first in one cycle."""
        n = self.stack_depth
        return [(j * n + layer, layer) for j in range(1, self.inner_cycles) for layer in range(n)]

    def tie_weights(self) -> None:
        """Every inner pass holds the first pass's L-stack weights, then the base ties."""
        if "stack_depth" in self.__dict__:
            row = self._core[0]
            for position, owner in self._tied_positions():
                _share_parameters(row[position], row[owner])
        super().tie_weights()

    def canonical_state_dict(self) -> dict[str, Tensor]:
        """The base names with each L layer once (``core.{l}``; the H stack is
        ``core.{inner_cycles * n + l}``), plus ``inner_init`` (z_L_init)."""
        state = super().canonical_state_dict()
        copies = tuple(f"core.{position}." for position, _ in self._tied_positions())
        state = {name: p for name, p in state.items() if not name.startswith(copies)}
        if "inner_init" in self._parameters:
            state["inner_init"] = self.inner_init
        return state

    # ---------------------------------------------------------------------- the nested loop

    def _set_view(self, k: int) -> None:
        hooks = self._inner_hooks
        while len(hooks) <= k:
            hooks.append(InnerStateHooks())
        if k != self._active:  # new hooks follow the model's mode, as the base's containers
            self.inner = nn.ModuleList(hooks[: k + 1])
            self.inner.train(self.training)
        super()._set_view(k)

    def _every_hook_point(self) -> list[HookPoint]:
        """The base's hook points and z_L's of every view (`reset_hooks` reaches them all)."""
        points = super()._every_hook_point()
        known = {id(point) for point in points}
        inner = [hooks.hook_state for hooks in self._inner_hooks]
        return points + [point for point in inner if id(point) not in known]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """As `HookedRecurrentTransformer.forward`; ``start_at_layer`` is refused (resuming needs
        z_H and z_L, which a residual stream does not carry)."""
        if kwargs.get("start_at_layer") is not None:
            raise ResumeError(
                "HRM-Text carries z_L beside the stream and adds z_H between stack passes, so a "
                "forward cannot resume from a residual stream (start_at_layer); run from the "
                "tokens and edit the stream with hooks instead."
            )
        return super().forward(*args, **kwargs)

    def _apply_block(
        self,
        i: int,
        x: Float[Tensor, "batch pos d_model"],
        rotary: tuple[Tensor, Tensor] | None,
        cache: Any,
        key_mask: Tensor | None = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """Block i of the view; a stack pass after the first in a cycle starts by adding z_H,
        and each stack pass ends with its weightless RMSNorm (the last L pass's output is z_L)."""
        n = self.stack_depth
        cycle, position = divmod(i, self.cfg.n_core)
        if position > 0 and position % n == 0:
            x = x + self._carry["high"]
        x = self.blocks[i](x, rotary, cache, key_mask)
        if position % n == n - 1:
            x = F.rms_norm(x, (x.shape[-1],), eps=self.cfg.eps)
            if position == self.inner_cycles * n - 1:
                x = self._carry["low"] = self._inner_hooks[cycle + 1].hook_state(x)
        return x

    def _next_input(
        self, t: int, state: Tensor, embedding: Tensor | None
    ) -> Float[Tensor, "batch pos d_model"]:
        """u_{t+1} = z_H + z_L (z_L_init before the first cycle); the readout after the last."""
        carry = self._carry
        if t == self._active:
            carry.clear()
            return self._enter_readout(state)
        if t == 0:
            start = self.inner_init.to(state.dtype).expand_as(state)
            carry["low"] = self._inner_hooks[0].hook_state(start)
        carry["high"] = state
        return self._iteration_hooks[t + 1].hook_inject(state + carry["low"])

    # ------------------------------------------------------------------------ saving

    def save_pretrained(self, path: str | Path) -> Path:
        raise UnsupportedToolError(
            "dcp-lens's folder format has no nested loop, so HRM-Text is not saved in it; keep "
            "the transformers checkpoint and load it with load('hrm-text:PATH')."
        )

    @classmethod
    def from_pretrained(
        cls, path: str | Path, device: str | torch.device | None = None, **overrides: Any
    ) -> HookedRecurrentTransformer:
        raise UnsupportedToolError(
            "HRM-Text loads from its transformers checkpoint: load('hrm-text:PATH')."
        )


def hrm_structure(hrm: Mapping[str, Any], source: str = "config") -> tuple[int, int, int]:
    """(layers per stack, L_cycles, H_cycles) of an HrmTextConfig dict; a config written before
    ``num_layers_per_stack`` existed holds the per-stack count in ``num_hidden_layers``."""
    n = hrm.get("num_layers_per_stack")
    if n is None:
        n = required_int(hrm, "num_hidden_layers", source)
    inner = required_int(hrm, "L_cycles", source)
    outer = required_int(hrm, "H_cycles", source)
    for name, value in (("num_layers_per_stack", n), ("L_cycles", inner), ("H_cycles", outer)):
        if value < 1:
            raise ConfigError(f"{source}: {name}={value} must be >= 1.")
    return n, inner, outer


def hrm_config(hrm: Mapping[str, Any], source: str = "config", **overrides: Any) -> RecurrentConfig:
    """The `RecurrentConfig` of an HrmTextConfig dict; ``n_iterations`` defaults to
    ``H_cycles``. Overrides of the fields the nested loop fixes (`FIXED_FIELDS`) are refused."""
    check_source_fields(hrm, SOURCE_FIELDS, source, POSITIVE_FIELDS)
    require_values(hrm, SUPPORTED_SWITCHES, source)
    fixed = sorted(set(overrides) & set(FIXED_FIELDS))
    if fixed:
        raise ConfigError(
            f"{source}: {fixed} cannot be overridden on HRM-Text: its nested loop fixes them (k = "
            "n_iterations counts outer cycles with the inner loop complete; L_cycles is the "
            "checkpoint's)."
        )
    rope = hrm.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(
            f"{source}: rope_type={rope['rope_type']!r} is not supported; dcp-lens implements "
            "the default (unscaled) rotary embedding."
        )
    n, inner, outer = hrm_structure(hrm, source)
    d_model = required_int(hrm, "hidden_size", source)
    n_heads = required_int(hrm, "num_attention_heads", source)
    d_head = hrm.get("head_dim") or d_model // n_heads
    if n_heads * d_head != d_model:
        raise ConfigError(
            f"{source}: num_attention_heads * head_dim = {n_heads} * {d_head} differs from "
            f"hidden_size={d_model}; dcp-lens's blocks need them equal."
        )
    scale = hrm.get("embedding_scale")
    if scale is None:
        scale = 1.0 / float(hrm.get("initializer_range", 0.02))
    fields: dict[str, Any] = dict(
        d_model=d_model,
        n_heads=n_heads,
        d_head=d_head,
        n_key_value_heads=n_heads,
        d_mlp=required_int(hrm, "intermediate_size", source),
        d_vocab=required_int(hrm, "vocab_size", source),
        n_ctx=required_int(hrm, "max_position_embeddings", source),
        n_prelude=0,
        n_core=(inner + 1) * n,
        n_coda=0,
        n_iterations=outer,
        injection="none",
        state_init="embed",
        normalization_type="RMS",
        norm_placement="pre",
        pre_coda_norm="none",
        iteration_norm="none",
        final_norm=False,
        eps=float(hrm.get("rms_norm_eps", 1e-6)),
        positional_embedding_type="rotary_rotate_half",
        rotary_base=float(rope.get("rope_theta", 10000.0)),
        act_fn="silu_gated",
        tie_unembed=bool(hrm.get("tie_word_embeddings", False)),
        embed_scale=float(scale),
        init_std=float(hrm.get("initializer_range", 0.02)),
    )
    fields.update(overrides)
    with naming_file(source):
        return RecurrentConfig(**fields)


def hrm_tensor_shapes(
    cfg: RecurrentConfig, n: int
) -> tuple[dict[str, Shape], dict[str, Shape | None]]:
    """(required, optional) original key -> shape for an HRM-Text checkpoint of ``cfg``."""
    d, width, d_mlp = cfg.d_model, cfg.n_heads * cfg.d_head, cfg.d_mlp
    assert d_mlp is not None
    expected: dict[str, Shape] = {HRM_EMBEDDING: (cfg.d_vocab, d), INNER_INIT: (d,)}
    for stack in STACKS:
        for layer in range(n):
            prefix = f"model.{stack}.layers.{layer}"
            expected[f"{prefix}.attn.gqkv_proj.weight"] = (4 * width, d)
            expected[f"{prefix}.attn.o_proj.weight"] = (d, width)
            expected[f"{prefix}.mlp.gate_up_proj.weight"] = (2 * d_mlp, d)
            expected[f"{prefix}.mlp.down_proj.weight"] = (d, d_mlp)
    optional: dict[str, Shape | None] = {}
    if cfg.tie_unembed:
        optional[HRM_HEAD] = (cfg.d_vocab, d)
    else:
        expected[HRM_HEAD] = (cfg.d_vocab, d)
    return expected, optional


def hrm_state_dict(
    tensors: LazyTensors | dict[str, Tensor], cfg: RecurrentConfig, n: int, inner: int
) -> dict[str, Tensor]:
    """Original HRM-Text tensors -> `HrmRecurrentTransformer.canonical_state_dict` names: the
    L stack's layer l is ``core.{l}``, the H stack's ``core.{inner * n + l}``."""
    state = {"embed.W_E": tensors.pop(HRM_EMBEDDING), "inner_init": tensors.pop(INNER_INIT)}
    if not cfg.tie_unembed:
        state["unembed.W_U"] = tensors.pop(HRM_HEAD).T.contiguous()
    for stack, first in zip(STACKS, (0, inner * n), strict=True):
        for layer in range(n):
            source, target = f"model.{stack}.layers.{layer}", f"core.{first + layer}"
            state.update(_block_state(tensors, source, target, cfg))
    return state


def _block_state(
    tensors: LazyTensors | dict[str, Tensor], source: str, target: str, cfg: RecurrentConfig
) -> dict[str, Tensor]:
    heads, d_mlp = cfg.n_heads, cfg.d_mlp
    assert d_mlp is not None
    w_g, w_q, w_k, w_v = tensors.pop(f"{source}.attn.gqkv_proj.weight").chunk(4, dim=0)
    gate, up = tensors.pop(f"{source}.mlp.gate_up_proj.weight").chunk(2, dim=0)
    ones = torch.ones(cfg.d_model, dtype=w_q.dtype)  # the blocks' RMSNorms have no weight
    return {
        f"{target}.ln1.w": ones,
        f"{target}.ln2.w": ones.clone(),
        f"{target}.attn.W_Q": heads_in(w_q, heads),
        f"{target}.attn.W_K": heads_in(w_k, heads),
        f"{target}.attn.W_V": heads_in(w_v, heads),
        f"{target}.attn.W_G": heads_in(w_g, heads),
        f"{target}.attn.W_O": heads_out(tensors.pop(f"{source}.attn.o_proj.weight"), heads),
        f"{target}.mlp.W_gate": gate.T.contiguous(),
        f"{target}.mlp.W_in": up.T.contiguous(),
        f"{target}.mlp.W_out": tensors.pop(f"{source}.mlp.down_proj.weight").T.contiguous(),
    }


def hrm_caveats(hrm: Mapping[str, Any], n: int, inner: int) -> dict[str, str]:
    """What in this checkpoint breaks an assumption of the protocol (`protocol_caveats`)."""
    caveats = {
        "nested_loop": (
            f"k counts outer H cycles, each with its {inner} inner L-stack passes complete "
            f"({(inner + 1) * n} block applications per iteration); a count of inner passes "
            "that is not whole cycles is not an iteration and is refused."
        ),
        "second_state": (
            "the loop carries two states: s_t is z_H (what the readout reads) and z_L goes from "
            "cycle to cycle beside it (inner.{t}.hook_state); truncate, replay, calibrate and "
            "translate act on z_H only, and a replayed or calibrated z_H never changes z_L."
        ),
        "injection": (
            "each cycle's input is z_H + z_L (loop.{t}.hook_inject), not the prelude output e; "
            "z_H is added again before every later stack pass of the cycle."
        ),
    }
    if hrm.get("prefix_lm", True):
        caveats["prefix_lm"] = (
            "the checkpoint is a prefix LM (instruction tokens marked by token_type_ids attend "
            "both ways); dcp-lens runs every position causally, as transformers does without "
            "token_type_ids."
        )
    return caveats


def load_hrm_text(path: str | Path, **overrides: Any) -> HrmRecurrentTransformer:
    """Load HRM-Text from a local folder (``config.json`` + safetensors, the hub's layout).

    Args:
        path: the folder, or its ``.safetensors`` file (``config.json`` must sit beside it).
        overrides: `RecurrentConfig` fields (``n_iterations=8`` outer cycles, …) except
            `FIXED_FIELDS`, ``device`` and ``dtype`` (default: the checkpoint's dtype, on CPU).

    Returns:
        An `HrmRecurrentTransformer` in eval mode with ``H_cycles`` iterations, its
        ``protocol_caveats`` set, and ``model.tokenizer`` the folder's own if it ships one.

    Raises:
        ConfigError: the folder holds another architecture, or a setting this mapping does not
            implement (named with the field).
        WeightsError: a key is missing, unexpected or of the wrong shape (in the original names).
    """
    path = Path(path)
    folder = path.parent if path.is_file() else path
    config_overrides, device, dtype = split_overrides(overrides)
    config_path = folder / CONFIG_FILE
    hrm = read_json(config_path)
    if hrm.get("model_type") != MODEL_TYPE:
        raise ConfigError(
            f"{config_path}: model_type is {hrm.get('model_type')!r}, not {MODEL_TYPE!r}; "
            "hrm-text: loads HRM-Text checkpoints only."
        )
    tokenizer = load_checkpoint_tokenizer(folder)
    if tokenizer is not None:
        config_overrides.setdefault("default_prepend_bos", tokenizer.prepends_bos)
    cfg = hrm_config(hrm, source=str(config_path), **config_overrides)
    n, inner, _ = hrm_structure(hrm, str(config_path))
    checkpoint = SafetensorsCheckpoint(path)
    expected, optional = hrm_tensor_shapes(cfg, n)
    check_tensor_shapes(checkpoint.shapes, expected, checkpoint.source, optional)
    tensors = LazyTensors(checkpoint, dtype)
    if cfg.tie_unembed:
        drop_tied_head(tensors, HRM_HEAD, HRM_EMBEDDING, checkpoint.source)
    state = hrm_state_dict(tensors, cfg, n, inner)
    with torch.device("meta"):
        meta = HrmRecurrentTransformer(cfg, tokenizer, stack_depth=n, inner_cycles=inner)
    model = build_model(
        HrmRecurrentTransformer, cfg, state, checkpoint.source, tokenizer, device, model=meta
    )
    model.protocol_caveats = MappingProxyType(hrm_caveats(hrm, n, inner))
    return model
