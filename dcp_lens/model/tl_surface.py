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

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from transformer_lens.FactoredMatrix import FactoredMatrix

from dcp_lens.model.components.attention import Attention, KVCache
from dcp_lens.model.config import RecurrentConfig
from dcp_lens.utils.errors import UnsupportedToolError

# TransformerLens's name of the unembedding weight (SVDInterpreter reads it).
UNEMBED_WEIGHT = "unembed.W_U"


class TLSurface(nn.Module):
    """Mixin of `HookedRecurrentTransformer` (see the module docstring)."""

    if TYPE_CHECKING:
        blocks: nn.ModuleList

        @property
        def cfg(self) -> RecurrentConfig: ...

        @property
        def W_U(self) -> Tensor: ...

        @property
        def b_U(self) -> Tensor: ...

        def _by_head(self, weight: Tensor) -> Tensor: ...

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
        params = dict(self.named_parameters(remove_duplicate=False))
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
            seen.setdefault(id(block.attn.W_Q), block.attn)
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


def _refactor_qk(attn: Attention) -> None:
    """``W_Q`` / ``W_K`` (and ``b_Q`` / ``b_K`` as the last input row) set to the balanced
    factors of their product, per head."""
    W_Q, W_K = attn.W_Q, attn.W_K  # [head, d_model, d_head]
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
