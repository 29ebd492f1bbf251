"""The rest of TransformerLens's model surface on a recurrent model: the unembedding as a call,
parameters under TransformerLens's unrolled names, the weight processing that applies to it, and
refusals (with the way out) for what does not.

- ``model.unembed(x)`` is ``x @ W_U + b_U``: what TransformerLens's docs pair with
  ``cache.accumulated_resid(apply_ln=True)``.
- ``model.tl_parameters()`` names every block of the active view, ``blocks.{i}.attn.W_V`` for
  every unrolled ``i`` (a shared core tensor under each index it is applied at), so tools that read
  weights by name (``SVDInterpreter``) find them; grouped keys and values are repeated per head.
- ``refactor_factored_attn_matrices`` balances each shared attention's Q/K and V/O factors (the
  products, hence the logits, are unchanged); ``fold_value_biases`` has nothing to fold (no value or
  output biases).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch import Tensor, nn
from transformer_lens.FactoredMatrix import FactoredMatrix
from transformer_lens.hook_points import HookPoint

from dcp_lens.model.components.attention import Attention, KVCache
from dcp_lens.model.config import RecurrentConfig
from dcp_lens.model.loss import next_token_loss
from dcp_lens.model.padding import check_attention_mask, padded_outputs
from dcp_lens.utils.errors import UnsupportedToolError

# TransformerLens's name of the unembedding weight (SVDInterpreter reads it).
UNEMBED_WEIGHT = "unembed.W_U"


class TLSurface(nn.Module):
    """Mixin of `HookedRecurrentTransformer` (see the module docstring)."""

    if TYPE_CHECKING:
        blocks: nn.ModuleList
        hook_dict: dict[str, HookPoint]

        @property
        def cfg(self) -> RecurrentConfig: ...

        @property
        def W_U(self) -> Tensor: ...

        @property
        def b_U(self) -> Tensor: ...

        @property
        def W_E(self) -> Tensor: ...

        @property
        def QK(self) -> FactoredMatrix: ...

        @property
        def OV(self) -> FactoredMatrix: ...

        def _by_head(self, weight: Tensor) -> Tensor: ...

        def _stack(self, path: str) -> Tensor: ...

        def _init_weights(self) -> None: ...

        def canonical_state_dict(self) -> dict[str, Tensor]: ...

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # noqa: D105
        """The model's type, as always; read by a TransformerLens check that takes only its
        TransformerBridge (`BRIDGE_ONLY_CHECKS`), the refusal with the dcp-lens way out."""
        caller: FrameType | None = sys._getframe(1)
        # The caller, or a few frames up where a type checker's wrapper runs this getter.
        for _ in range(_CALLER_DEPTH):
            if caller is None:
                break
            key = (caller.f_globals.get("__name__", ""), caller.f_code.co_name)
            if key in BRIDGE_ONLY_CHECKS:
                raise UnsupportedToolError(BRIDGE_ONLY_CHECKS[key])
            caller = caller.f_back
        return type(self)

    @__class__.setter
    def __class__(self, value: type) -> None:
        object.__dict__["__class__"].__set__(self, value)

    def unembed(self, residual: Tensor) -> Tensor:
        """``residual @ W_U + b_U``: [..., d_model] -> [..., d_vocab]. ``residual`` normalised at
        the final norm by the cache (``accumulated_resid(apply_ln=True)``) gives the logits."""
        if residual.shape[-1] != self.cfg.d_model:
            raise UnsupportedToolError(
                f"unembed takes a stream [..., d_model={self.cfg.d_model}], got shape "
                f"{tuple(residual.shape)}; normalise it first (cache.apply_ln_to_stack)."
            )
        return residual @ self.W_U + self.b_U

    def tl_parameters(self) -> dict[str, Tensor]:
        """Every parameter of the active view under TransformerLens's names: ``blocks.{i}.…`` for
        each unrolled block (shared tensors under every index), ``W_K`` / ``W_V`` / ``b_K``
        [n_heads, …] (grouped heads repeated), ``unembed.W_U`` [d_model, d_vocab] and
        ``unembed.b_U`` [d_vocab]."""
        params: dict[str, Tensor] = dict(self.named_parameters(remove_duplicate=False))
        params.pop("W_U_untied", None)
        for index in range(len(self.blocks)):
            for name in ("W_K", "W_V", "b_K"):
                key = f"blocks.{index}.attn.{name}"
                if key in params:
                    params[key] = self._by_head(params[key][None])[0]
        params[UNEMBED_WEIGHT] = self.W_U
        params["unembed.b_U"] = self.b_U
        return params

    def tl_named_parameters(self) -> Iterator[tuple[str, Tensor]]:
        """`tl_parameters` as (name, tensor) pairs."""
        return iter(self.tl_parameters().items())

    def _attention_owners(self) -> list[Attention]:
        """Each attention module once (a shared core layer is one module's weights)."""
        seen: dict[int, Attention] = {}
        for block in self.blocks:
            attn = block.attn
            assert isinstance(attn, Attention)
            seen.setdefault(id(attn.W_Q), attn)
        return list(seen.values())

    @torch.no_grad()
    def refactor_factored_attn_matrices(self, state_dict: object = None) -> None:
        """Rebalance every attention's factors in place, as TransformerLens: ``W_Q`` / ``W_K``
        (with ``b_Q`` / ``b_K`` as an extra input row) become ``U √S`` and ``(√S Vh)ᵀ`` of their
        product's SVD, ``W_V`` / ``W_O`` likewise; ``QK``, ``OV`` and the logits are unchanged.
        Refused on rotary positions (the rotation sits between Q and K) and grouped keys and
        values (one ``W_V`` serves several heads)."""
        if state_dict is not None:
            raise UnsupportedToolError(
                "refactor_factored_attn_matrices(state_dict): this model refactors its own "
                "weights in place; call model.refactor_factored_attn_matrices() with no argument."
            )
        cfg = self.cfg
        if cfg.positional_embedding_type != "learned":
            raise UnsupportedToolError(
                "refactor_factored_attn_matrices: the rotary embedding sits between W_Q and W_K, "
                "so their product is not the QK circuit (TransformerLens refuses rotary models "
                "too); read balanced factors from model.QK.make_even() / model.OV.make_even()."
            )
        if cfg.n_key_value_heads != cfg.n_heads:
            raise UnsupportedToolError(
                f"refactor_factored_attn_matrices: {cfg.n_heads} query heads share "
                f"{cfg.n_key_value_heads} key/value heads, so one W_V cannot be refactored per "
                "head; read balanced factors from model.QK.make_even() / model.OV.make_even()."
            )
        for attn in self._attention_owners():
            _refactor_qk(attn)
            left, right = FactoredMatrix(attn.W_V, attn.W_O).make_even().pair
            attn.W_V.copy_(left)
            attn.W_O.copy_(right)

    def fold_value_biases(self, state_dict: object = None) -> object:
        """TransformerLens folds ``b_V`` through ``W_O`` into ``b_O``; this model's attention has
        neither bias, so there is nothing to fold: the weights (and a ``state_dict`` passed in)
        are returned unchanged."""
        return state_dict

    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """Refused when turned on; ``False`` (the default) is accepted."""
        if use_attn_result:
            raise UnsupportedToolError(
                "set_use_attn_result(True): this model's forward does not split attention "
                "output by head. cache.compute_head_results() fills "
                "blocks.{i}.attn.hook_result [batch, pos, head, d_model] from the cache "
                "(cache.stack_head_results() stacks them); to patch one head's output, patch "
                "blocks.{i}.attn.hook_z [batch, pos, head, d_head]."
            )

    def set_use_hook_mlp_in(self, use_hook_mlp_in: bool) -> None:
        """Refused when turned on; ``False`` (the default) is accepted."""
        if use_hook_mlp_in:
            raise UnsupportedToolError(
                "set_use_hook_mlp_in(True): this model has no separate hook_mlp_in; the MLP "
                "reads blocks.{i}.hook_resid_mid through blocks.{i}.ln2 (hook "
                "blocks.{i}.ln2.hook_normalized for its normalised input)."
            )

    # ------------------------------------------------- TransformerBridge's model surface

    @property
    def W_E_pos(self) -> Tensor:
        """``W_E`` and ``W_pos`` stacked: [d_vocab + n_ctx, d_model] (learned positions only)."""
        pos_embed = getattr(self, "pos_embed", None)
        if pos_embed is None:
            raise UnsupportedToolError(
                "W_E_pos: this model encodes positions by rotating queries and keys (rotary), "
                "so there is no W_pos to stack; use model.W_E."
            )
        return torch.cat([self.W_E, pos_embed.W_pos], dim=0)

    @property
    def b_V(self) -> Tensor:
        """Refused (`WeightViewError`): the value projection has no bias."""
        return self._stack("attn.b_V")

    @property
    def b_O(self) -> Tensor:
        """Refused (`WeightViewError`): the output projection has no bias."""
        return self._stack("attn.b_O")

    @property
    def all_head_labels(self) -> list[str]:
        """``L{block}H{head}`` for every head of every block of the active view."""
        return [f"L{i}H{h}" for i in range(len(self.blocks)) for h in range(self.cfg.n_heads)]

    @property
    def attn_head_labels(self) -> list[str]:
        """As `all_head_labels`: every block has attention."""
        return self.all_head_labels

    @property
    def n_params_total(self) -> int:
        """Number of parameters, each shared tensor once (the core counts once, not k times)."""
        return sum(p.numel() for p in self.canonical_state_dict().values())

    @property
    def hook_aliases(self) -> dict[str, str]:
        """``{}``: every hook point has one name (TransformerLens's), none is an alias."""
        return {}

    @property
    def original_model(self) -> None:
        """None: this model wraps no Hugging Face model (TransformerLens's tools read it so)."""
        return None

    def QK_for_attn_layers(self) -> tuple[list[int], FactoredMatrix]:
        """(every block index, `QK`): every block has attention."""
        return list(range(len(self.blocks))), self.QK

    def OV_for_attn_layers(self) -> tuple[list[int], FactoredMatrix]:
        """(every block index, `OV`): every block has attention."""
        return list(range(len(self.blocks))), self.OV

    def composition_layer_indices(self) -> list[int]:
        """Every block index of the active view (all are attention blocks)."""
        return list(range(len(self.blocks)))

    def block_hooks(self, layer_idx: int) -> list[str]:
        """The hook names inside ``blocks[layer_idx]``."""
        prefix = f"blocks.{self._block_index(layer_idx)}."
        return [name for name in self.hook_dict if name.startswith(prefix)]

    def block_submodules(self, layer_idx: int) -> list[str]:
        """Names of the submodules of ``blocks[layer_idx]`` (``ln1``, ``attn``, ``ln2``, …)."""
        block = self.blocks[self._block_index(layer_idx)]
        return [n for n, m in block.named_children() if not isinstance(m, HookPoint)]

    def blocks_with(self, submodule: str) -> list[tuple[int, nn.Module]]:
        """(index, block) of every block that has ``submodule`` as a child module, as
        TransformerLens's bridge (its tools read ``block.attn`` from these pairs)."""
        return [
            (i, block)
            for i, block in enumerate(self.blocks)
            if isinstance(getattr(block, submodule, None), nn.Module)
        ]

    def get_hook_point(self, hook_name: str) -> Any:
        """The `HookPoint` named ``hook_name`` in the active view, or None."""
        return self.hook_dict.get(hook_name)

    def loss_fn(
        self,
        logits: Tensor,
        tokens: Tensor,
        attention_mask: Tensor | None = None,
        per_token: bool = False,
    ) -> Tensor:
        """Mean next-token cross-entropy of ``logits`` [batch, pos, d_vocab] on ``tokens``
        [batch, pos] ([batch, pos - 1] with ``per_token``), as ``return_type="loss"``; with an
        ``attention_mask`` [batch, pos] only a real token predicted from a real one counts (zero
        elsewhere per token), as TransformerLens's ``lm_cross_entropy_loss``."""
        if attention_mask is not None:
            mask = check_attention_mask(attention_mask, tuple(tokens.shape), tokens.device)
            loss = padded_outputs(logits, tokens, mask, "loss", per_token)
            assert isinstance(loss, Tensor)
            return loss
        return next_token_loss(logits, tokens, per_token=per_token)

    def init_weights(self) -> None:
        """Re-initialise every weight from ``cfg.seed`` (norms 1, biases 0)."""
        self._init_weights()

    @property
    def reset_parameters(self) -> NoReturn:
        """Refused when read: TransformerLens's ``tools.analysis.reinitialized`` resets a copy
        through each module's ``reset_parameters``, which this model's weights (shared across
        iterations, initialised from ``cfg.seed``) do not have."""
        raise UnsupportedToolError(
            "reinitialized(model, seed) / reset_parameters: this model is initialised as a whole "
            "from cfg.seed, not module by module. For the random-initialisation control build a "
            "fresh model of the same architecture: HookedRecurrentTransformer("
            "dataclasses.replace(model.cfg, seed=seed)) (or model.init_weights() to "
            "re-initialise this one in place from cfg.seed)."
        )

    def _block_index(self, layer_idx: int) -> int:
        if not 0 <= layer_idx < len(self.blocks):
            raise UnsupportedToolError(
                f"layer_idx={layer_idx} is outside 0..{len(self.blocks) - 1} (the blocks of the "
                "active view)."
            )
        return layer_idx

    def check_past_kv_cache(self, past_kv_cache: object) -> KVCache | None:
        """``past_kv_cache`` itself; a key-value cache of another library (TransformerLens's
        ``TransformerLensKeyValueCache``) is refused with the way to build this model's."""
        if past_kv_cache is None or isinstance(past_kv_cache, KVCache):
            return past_kv_cache
        raise UnsupportedToolError(
            f"past_kv_cache is a {type(past_kv_cache).__name__}; this model extends its own "
            "KVCache (one entry per unrolled block, with the initial-state noise's prefix "
            "state). Build it with dcp_lens.model.components.attention.KVCache("
            "model.cfg.n_layers), or let model.generate(..., use_past_kv_cache=True) do it."
        )


# TransformerLens checks that take only its TransformerBridge: (module, function) -> the refusal.
# ``isinstance(model, TransformerBridge)`` reads ``model.__class__`` when the type itself does not
# match, and `TLSurface.__class__` raises the refusal when one of these functions asks.
_CALLER_DEPTH = 3
BRIDGE_ONLY_CHECKS: dict[tuple[str, str], str] = {
    ("transformer_lens.tools.analysis.jacobian_lens", "_require_raw_bridge"): (
        "transformer_lens.tools.analysis.JacobianLens (and the lenses built on its fit) reads a "
        "TransformerBridge's blocks as one pass to ln_final -> unembed; a recurrent model reads "
        "out through its per-iteration norm, pre-coda norm and coda, and applies each core "
        "block k times. Use dcp_lens.lenses.tuned.JacobianLens.fit(model, tokens) (the "
        "Jacobian of each iteration's state to the stream entering ln_final) and its "
        ".logits(model, tokens), or dcp_lens.lenses.logit_lens(model, tokens)"
    ),
}

_LOAD = "load a model with dcp_lens.load(spec) (`dcp-lens models` lists the specs)"
_CAUSAL = "this is a causal language model: run model(tokens) or model.generate(...)"
# TransformerBridge methods that have no meaning here, each with the way out. A refusal is a
# method (a static one where TransformerLens has one), so reading the name works and calling it
# raises `UnsupportedToolError`.
REFUSED: dict[str, str] = {
    "boot_transformers": _LOAD,
    "boot_native": _LOAD,
    "boot_tl_legacy": _LOAD,
    "list_supported_models": _LOAD,
    "check_model_support": _LOAD,
    "enable_compatibility_mode": (
        "this model's weights are not processed, and need not be: the cache applies the final "
        "norm as fold_ln would (apply_ln_to_stack, accumulated_resid(apply_ln=True), b_U); "
        "model.refactor_factored_attn_matrices() is the processing step it runs"
    ),
    "process_weights": (
        "the cache applies the final norm as fold_ln would (apply_ln_to_stack, b_U); run "
        "model.refactor_factored_attn_matrices() for refactored attention factors"
    ),
    "get_params": "model.tl_parameters() gives every weight under TransformerLens's names",
    "stack_params_for": "the stacked views model.W_Q, model.W_in, … (or tl_parameters())",
    "layer_types": "every block is attention then MLP; model.block_submodules(i) lists its parts",
    "input_to_embed": (
        "model(tokens, stop_at_layer=0) is the stream entering blocks[0] (embedding and "
        "positions; the loop's initial state is loop.0.hook_state)"
    ),
    "generate_stream": "model.generate(...) returns the tokens at the end",
    "hf_generate": "model.generate(...) (this model has no Hugging Face generate)",
    "diffusion_generate": _CAUSAL,
    "encoder_output": _CAUSAL,
    "predict_next_sentence": _CAUSAL,
    "to_sentence_pair_tokens": _CAUSAL,
    "prepare_multimodal_inputs": _CAUSAL,
    "clear_hook_registry": "model.reset_hooks() removes every hook",
    "close": "nothing to release; `del model` frees it",
    "mps": "model.to('mps')",
}
STATIC_REFUSALS = {"boot_transformers", "boot_native", "boot_tl_legacy"}
STATIC_REFUSALS |= {"list_supported_models", "check_model_support"}


def _refusal(name: str, way_out: str) -> Callable[..., NoReturn]:
    def refused(*args: object, **kwargs: object) -> NoReturn:
        raise UnsupportedToolError(
            f"{name}: TransformerLens's TransformerBridge has it for the Hugging Face models it "
            f"wraps; this model does not. Instead: {way_out}."
        )

    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = f"Refused: {way_out}."
    return refused


for _name, _way_out in REFUSED.items():
    _method = _refusal(_name, _way_out)
    setattr(TLSurface, _name, staticmethod(_method) if _name in STATIC_REFUSALS else _method)


def _refactor_qk(attn: Attention) -> None:
    """``W_Q`` / ``W_K`` (and ``b_Q`` / ``b_K`` as the last input row) set to the balanced
    factors of their product, per head."""
    W_Q: Tensor = attn.W_Q  # [head, d_model, d_head]
    W_K: Tensor = attn.W_K
    if attn.b_Q is not None and attn.b_K is not None:
        W_Q = torch.cat([W_Q, attn.b_Q[:, None, :]], dim=1)  # [head, d_model + 1, d_head]
        W_K = torch.cat([W_K, attn.b_K[:, None, :]], dim=1)
    left, right = FactoredMatrix(W_Q, W_K.transpose(-2, -1)).make_even().pair
    right = right.transpose(-2, -1)
    d_model = attn.W_Q.shape[1]
    attn.W_Q.copy_(left[:, :d_model])
    attn.W_K.copy_(right[:, :d_model])
    if attn.b_Q is not None and attn.b_K is not None:
        attn.b_Q.copy_(left[:, d_model])
        attn.b_K.copy_(right[:, d_model])
