"""Rotary position embeddings in the two conventions real checkpoints use."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from jaxtyping import Float
from torch import Tensor


def rotary_tables(
    n_ctx: int, d_head: int, base: float, scaling: Sequence[float] | None = None
) -> tuple[Float[Tensor, "n_ctx half"], Float[Tensor, "n_ctx half"]]:
    """cos and sin of angle p * theta_i for positions p and pair index i, in float32, where
    theta_i = base^(-2i/d_head), scaled as Llama 3 does when ``scaling`` is given
    (`llama3_frequencies`)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, d_head, 2, dtype=torch.float32) / d_head))
    if scaling is not None:
        inv_freq = llama3_frequencies(inv_freq, *scaling)
    angles = torch.outer(torch.arange(n_ctx, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(
    x: Float[Tensor, "batch pos head d_head"],
    cos: Float[Tensor, "*batch pos half"],
    sin: Float[Tensor, "*batch pos half"],
    interleaved: bool,
) -> Float[Tensor, "batch pos head d_head"]:
    """Rotate feature pairs of every head: (2i, 2i+1) if ``interleaved`` (llama2.c, Huginn),
    else (i, i + d_head/2) (rotate-half: Llama, Ouro). ``cos`` and ``sin``: [pos, d_head/2], or
    [batch, pos, d_head/2] when each row has its own positions (a padded batch)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if interleaved:
        pairs = x.unflatten(-1, (-1, 2))
        first, second = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((first * cos - second * sin, second * cos + first * sin), dim=-1)
        return rotated.flatten(-2)
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


def llama3_frequencies(
    inv_freq: Float[Tensor, " half"],
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_context: float,
) -> Float[Tensor, " half"]:
    """Llama 3's frequency scaling: a frequency whose wavelength 2 pi / theta is longer than
    ``original_context / low_freq_factor`` is divided by ``factor``; one shorter than
    ``original_context / high_freq_factor`` is kept; in between the two are blended linearly
    in ``original_context / wavelength``."""
    wavelength = 2 * math.pi / inv_freq
    low_limit, high_limit = original_context / low_freq_factor, original_context / high_freq_factor
    blend = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    scaled = torch.where(wavelength > low_limit, inv_freq / factor, blended)
    return torch.where(wavelength < high_limit, inv_freq, scaled)
