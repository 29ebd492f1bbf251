"""Rotary position embeddings in the two conventions real checkpoints use."""

from __future__ import annotations

import torch
from jaxtyping import Float
from torch import Tensor


def rotary_tables(
    n_ctx: int, d_head: int, base: float
) -> tuple[Float[Tensor, "n_ctx half"], Float[Tensor, "n_ctx half"]]:
    """cos and sin of angle p * base^(-2i/d_head) for positions p and pair index i, in float32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, d_head, 2, dtype=torch.float32) / d_head))
    angles = torch.outer(torch.arange(n_ctx, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(
    x: Float[Tensor, "batch pos head d_head"],
    cos: Float[Tensor, "pos half"],
    sin: Float[Tensor, "pos half"],
    interleaved: bool,
) -> Float[Tensor, "batch pos head d_head"]:
    """Rotate feature pairs of every head: (2i, 2i+1) if ``interleaved`` (llama2.c, Huginn),
    else (i, i + d_head/2) (rotate-half: Llama, Ouro)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    if interleaved:
        pairs = x.unflatten(-1, (-1, 2))
        first, second = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((first * cos - second * sin, second * cos + first * sin), dim=-1)
        return rotated.flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
