"""Token embedding, learned positions, the injection of e into the loop, and the unembedding."""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from dcp_lens.model.config import RecurrentConfig


class Embed(nn.Module):
    """embed_scale * W_E[tokens]."""

    def __init__(self, cfg: RecurrentConfig):
        super().__init__()
        self.scale = cfg.embed_scale
        self.W_E = nn.Parameter(torch.empty(cfg.d_vocab, cfg.d_model))

    def forward(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos d_model"]:
        embedded = self.W_E[tokens]
        return embedded * self.scale if self.scale != 1.0 else embedded


class PosEmbed(nn.Module):
    """Learned absolute positions W_pos[offset : offset + pos]."""

    def __init__(self, cfg: RecurrentConfig):
        super().__init__()
        self.W_pos = nn.Parameter(torch.empty(cfg.n_ctx, cfg.d_model))

    def forward(
        self, n_positions: int, offset: int = 0, positions: Tensor | None = None
    ) -> Float[Tensor, "*batch pos d_model"]:
        """[pos, d_model] for positions ``offset..offset + n_positions - 1``, or [batch, pos,
        d_model] for ``positions`` [batch, pos] (each row its own, in a padded batch)."""
        if positions is not None:
            return self.W_pos[positions]
        return self.W_pos[offset : offset + n_positions]


class Inject(nn.Module):
    """u_t = Inject(s_{t-1}, e): ``none`` s; ``add`` s + e; ``concat_adapter`` W_adapter [s; e]
    (state first, as Huginn's adapter; W_adapter is [d_model, 2 d_model], no bias)."""

    def __init__(self, cfg: RecurrentConfig):
        super().__init__()
        self.kind = cfg.injection
        if self.kind == "concat_adapter":
            self.W_adapter = nn.Parameter(torch.empty(cfg.d_model, 2 * cfg.d_model))

    def forward(
        self,
        state: Float[Tensor, "batch pos d_model"],
        embedding: Float[Tensor, "batch pos d_model"],
    ) -> Float[Tensor, "batch pos d_model"]:
        if self.kind == "add":
            return state + embedding
        if self.kind == "concat_adapter":
            return torch.cat((state, embedding), dim=-1) @ self.W_adapter.T
        return state
