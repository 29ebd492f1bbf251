"""Weight views as TransformerLens names them, stacked over the blocks of the active view.

``model.W_Q[i]`` is ``model.blocks[i].attn.W_Q``: block i of the unrolled view, so an index is
the same one the hook names use, and the core's layers repeat, once per iteration, as the *same*
weights. Keys and values of grouped-query attention are repeated to ``n_heads`` (as
TransformerLens's bridge does). ``QK`` and ``OV`` are `FactoredMatrix` objects and
`all_composition_scores` scores every pair of heads in the unrolled view (a core head at
iteration t composes with the same core's heads at later iterations). Norm weights are not
folded in: a sandwich norm's gain sits after ``W_O`` and is not part of ``OV``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from jaxtyping import Float
from torch import Tensor, nn
from transformer_lens.FactoredMatrix import FactoredMatrix
from transformer_lens.model_bridge.composition_scores import CompositionScores
from transformer_lens.utilities.matrix import composition_scores

from dcp_lens.model.components.embeddings import Embed, PosEmbed
from dcp_lens.model.config import RecurrentConfig
from dcp_lens.utils.errors import DCPLensError


class WeightViewError(DCPLensError):
    """A weight this architecture does not have, or a composition mode that does not exist."""


class WeightViews:
    """Mixin of `HookedRecurrentTransformer`: TransformerLens's stacked weight properties."""

    if TYPE_CHECKING:
        blocks: nn.ModuleList
        embed: Embed
        pos_embed: PosEmbed | None
        ln_final: nn.Module
        W_U_untied: nn.Parameter | None

        @property
        def cfg(self) -> RecurrentConfig: ...

    def _stack(self, path: str) -> Tensor:
        weights = []
        for index, block in enumerate(self.blocks):
            owner: object = block
            for part in path.split("."):
                owner = getattr(owner, part, None)
            if not isinstance(owner, Tensor):
                raise WeightViewError(
                    f"blocks[{index}].{path} does not exist in this architecture "
                    f"(act_fn={self.cfg.act_fn!r}, qk_bias={self.cfg.qk_bias}); it has no such "
                    "weight to view."
                )
            weights.append(owner)
        return torch.stack(weights)

    def _by_head(self, weight: Tensor) -> Tensor:
        """[layer, kv_head, …] -> [layer, n_heads, …] (grouped-query heads repeated)."""
        group = self.cfg.n_heads // weight.shape[1]
        return weight if group == 1 else weight.repeat_interleave(group, dim=1)

    @property
    def W_Q(self) -> Float[Tensor, "n_layers n_heads d_model d_head"]:
        return self._stack("attn.W_Q")

    @property
    def W_K(self) -> Float[Tensor, "n_layers n_heads d_model d_head"]:
        return self._by_head(self._stack("attn.W_K"))

    @property
    def W_V(self) -> Float[Tensor, "n_layers n_heads d_model d_head"]:
        return self._by_head(self._stack("attn.W_V"))

    @property
    def W_O(self) -> Float[Tensor, "n_layers n_heads d_head d_model"]:
        return self._stack("attn.W_O")

    @property
    def b_Q(self) -> Float[Tensor, "n_layers n_heads d_head"]:
        return self._stack("attn.b_Q")

    @property
    def b_K(self) -> Float[Tensor, "n_layers n_heads d_head"]:
        return self._by_head(self._stack("attn.b_K"))

    @property
    def W_in(self) -> Float[Tensor, "n_layers d_model d_mlp"]:
        return self._stack("mlp.W_in")

    @property
    def W_gate(self) -> Float[Tensor, "n_layers d_model d_mlp"]:
        return self._stack("mlp.W_gate")

    @property
    def W_out(self) -> Float[Tensor, "n_layers d_mlp d_model"]:
        return self._stack("mlp.W_out")

    @property
    def b_in(self) -> Float[Tensor, "n_layers d_mlp"]:
        return self._stack("mlp.b_in")

    @property
    def b_out(self) -> Float[Tensor, "n_layers d_model"]:
        return self._stack("mlp.b_out")

    @property
    def QK(self) -> FactoredMatrix:
        """W_Q W_K^T per block and head: [n_layers, n_heads, d_model, d_model], factored."""
        return FactoredMatrix(self.W_Q, self.W_K.transpose(-2, -1))

    @property
    def OV(self) -> FactoredMatrix:
        """W_V W_O per block and head: [n_layers, n_heads, d_model, d_model], factored."""
        return FactoredMatrix(self.W_V, self.W_O)

    def all_composition_scores(self, mode: str) -> CompositionScores:
        """Composition scores of every earlier head's OV with every later head's Q, K or V
        (``mode``), [n_layers, n_heads, n_layers, n_heads], zero where the first head is not in
        an earlier block (as TransformerLens)."""
        left = self.OV
        if mode == "Q":
            right = self.QK
        elif mode == "K":
            right = self.QK.T
        elif mode == "V":
            right = left
        else:
            raise WeightViewError(f"mode={mode!r} must be one of 'Q', 'K', 'V'.")
        scores = composition_scores(left, right, broadcast_dims=True)
        index = torch.arange(self.cfg.n_layers, device=scores.device)
        earlier = index[:, None, None, None] < index[None, None, :, None]
        scores = torch.where(earlier, scores, torch.zeros_like(scores))
        labels = [f"L{i}H{h}" for i in range(self.cfg.n_layers) for h in range(self.cfg.n_heads)]
        return CompositionScores(
            scores=scores, layer_indices=list(range(self.cfg.n_layers)), head_labels=labels
        )

    @property
    def W_E(self) -> Tensor:
        return self.embed.W_E

    @property
    def W_U(self) -> Tensor:
        return self.embed.W_E.T if self.W_U_untied is None else self.W_U_untied

    @property
    def b_U(self) -> Tensor:
        """``ln_final.b @ W_U`` (zeros without a LayerNorm bias): the part of every logit that
        no component of a decomposition carries. The model has no unembedding bias of its own;
        this is what TransformerLens's "attributions + b_U = logit" needs (see
        `tokens_to_residual_directions`), as its ``fold_ln`` puts the bias into ``b_U``. Every
        stack the cache normalises at the final norm leaves the bias to ``b_U``:
        ``cache.accumulated_resid(apply_ln=True)[-1] @ W_U + b_U`` is the logits. [d_vocab]"""
        bias = getattr(self.ln_final, "b", None)
        if bias is None:
            return torch.zeros(self.cfg.d_vocab, device=self.W_E.device, dtype=self.W_E.dtype)
        return bias @ self.W_U

    @property
    def W_pos(self) -> Tensor:
        if self.pos_embed is None:
            raise WeightViewError(
                "W_pos: this model encodes positions by rotating queries and keys (rotary), so "
                "it has no position embedding to view; use model.W_E."
            )
        return self.pos_embed.W_pos

    def accumulated_bias(
        self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True
    ) -> Float[Tensor, " d_model"]:
        """Sum of the biases the blocks before ``layer`` add to the stream, as TransformerLens:
        each MLP's ``b_out`` (attention has no output bias here). Exact for pre-norm blocks; a
        sandwich norm rescales what a block adds."""
        if not 0 <= layer <= self.cfg.n_layers:
            raise ValueError(f"layer={layer} is outside 0..{self.cfg.n_layers} (cfg.n_layers).")
        total = torch.zeros(self.cfg.d_model, device=self.W_E.device, dtype=self.W_E.dtype)
        if not include_mlp_biases:
            return total
        for block in self.blocks[:layer]:
            b_out = getattr(block.mlp, "b_out", None)  # gated MLPs have none
            if b_out is not None:
                total = total + b_out
        return total
