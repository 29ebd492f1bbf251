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

from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor
from transformer_lens.FactoredMatrix import FactoredMatrix
from transformer_lens.model_bridge.composition_scores import CompositionScores
from transformer_lens.utilities.matrix import composition_scores

from dcp_lens.utils.errors import DCPLensError


class WeightViewError(DCPLensError):
    """A weight this architecture does not have, or a composition mode that does not exist."""


class WeightViews:
    """Mixin of `HookedRecurrentTransformer`: TransformerLens's stacked weight properties."""

    blocks: Any
    cfg: Any

    def _stack(self, path: str) -> Tensor:
        weights = []
        for index, block in enumerate(self.blocks):
            owner: Any = block
            for part in path.split("."):
                owner = getattr(owner, part, None)
            if owner is None:
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
