"""The noisy initial state s_0, drawn causally: position p's noise depends only on the seed, p and
the tokens up to and including p.

So a forward over a prefix draws the same noise as the longer forward at those positions,
generation with a KV cache draws what generation without one draws, and an example's noise does
not depend on its batch, its slot, its padding (on the right; on the left, or anywhere, when the
forward gets the attention mask) or the number of iterations.

How a draw is made (integer arithmetic on tensors up to the last step, so the uniform numbers
are the same on every device and for every batch):

1. A prefix key per position: two polynomial hashes of ``tokens[:p+1]`` modulo the prime
   2^31 - 1 (bases `BASES`), ``H_p = sum_{i <= p} (t_i + 1) * B^(p - i)``, computed at once with a
   cumulative sum of ``(t_i + 1) * B^(-i)``. A KV cache keeps the running sums
   (`PrefixState`), so the next chunk continues them. In a padded batch a pad (attention mask
   False) adds 0 and the powers of B count the row's own positions (real tokens only), so at a
   real position the hash is that of the row's real tokens alone.
2. The key of position p mixes the seed, p and both hashes into two 32-bit words
   (murmur3's finaliser, `fmix32`); in a padded batch p is the row's own position, counted from
   its first real token.
3. Element d of the noise is a uniform number from ``fmix32`` of the key words and d, turned into
   a standard normal by the inverse normal CDF (``sqrt(2) erfinv(2u - 1)``); ``"huginn"`` maps it
   into [Phi(-3), Phi(3)] first, the truncated normal Huginn draws its state from.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

MODULUS = 2**31 - 1  # a prime: every base has an inverse
BASES = (1_000_003, 972_663_749)
_MASK32 = 0xFFFFFFFF
# Phi(-3) and Phi(3): Huginn's truncated normal keeps draws within three standard deviations.
_TRUNCATION = (0.5 * math.erfc(3 / math.sqrt(2)), 0.5 * math.erfc(-3 / math.sqrt(2)))


@dataclass
class PrefixState:
    """The running sums ``sum_{i < length} (t_i + 1) B^(-i) mod M`` per row and base
    ([batch, 2]) after ``length`` positions: what the next chunk's prefix keys continue from."""

    sums: Tensor
    length: int


def _mul32(x: Tensor, constant: int) -> Tensor:
    """``x * constant mod 2^32`` for int64 ``x`` in [0, 2^32), without leaving int64's range."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + ((x * high) & 0xFFFF) * 65536) & _MASK32


def fmix32(h: Tensor) -> Tensor:
    """murmur3's 32-bit finaliser on int64 values in [0, 2^32): a bijection that mixes every bit."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


@functools.lru_cache(maxsize=8)
def _powers(base: int, length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(B^i mod M, B^(-i) mod M) for i = 0..length-1."""
    inverse = pow(base, MODULUS - 2, MODULUS)
    up, down = [1] * length, [1] * length
    for i in range(1, length):
        up[i] = up[i - 1] * base % MODULUS
        down[i] = down[i - 1] * inverse % MODULUS
    return tuple(up), tuple(down)


def prefix_hashes(
    tokens: Tensor,
    state: PrefixState | None = None,
    mask: Tensor | None = None,
    positions: Tensor | None = None,
) -> tuple[Tensor, PrefixState]:
    """Hashes [batch, pos, 2] of every prefix ``tokens[:, :p+1]`` (continuing ``state``'s
    positions when given), and the state after the last position. In a padded batch the tokens
    where ``mask`` [batch, pos] is False are left out and ``positions`` [batch, pos] (each row's
    own, real tokens counted) take the place of the indices."""
    batch, n = tokens.shape
    offset = 0 if state is None else state.length
    device = tokens.device
    digits = tokens.long() + 1
    if mask is not None:
        digits = digits * mask.to(device=device, dtype=torch.long)
    hashes, sums = [], []
    for j, base in enumerate(BASES):
        up, down = _powers(base, offset + n)
        if positions is None:
            up_t = torch.tensor(up[offset:], dtype=torch.long, device=device)
            down_t = torch.tensor(down[offset:], dtype=torch.long, device=device)
        else:  # [batch, pos]: each position's own powers
            index = positions.to(device=device, dtype=torch.long)
            up_t = torch.tensor(up, dtype=torch.long, device=device)[index]
            down_t = torch.tensor(down, dtype=torch.long, device=device)[index]
        terms = (digits % MODULUS) * down_t % MODULUS  # < 2^62
        running = terms.cumsum(dim=1)  # < n * 2^31
        if state is not None:
            running = running + state.sums[:, j : j + 1].to(device)
        running = running % MODULUS
        hashes.append(running * up_t % MODULUS)
        sums.append(running[:, -1])
    return torch.stack(hashes, dim=-1), PrefixState(torch.stack(sums, dim=-1), offset + n)


def position_keys(
    seed: int, hashes: Tensor, offset: int = 0, positions: Tensor | None = None
) -> Tensor:
    """Two 32-bit key words [batch, pos, 2] per position from the seed, the position (``offset``
    onwards, or ``positions`` [batch, pos]) and the prefix hashes [batch, pos, 2]."""
    n = hashes.shape[1]
    if positions is None:
        positions = torch.arange(offset, offset + n, dtype=torch.long, device=hashes.device)
    else:
        positions = positions.to(device=hashes.device, dtype=torch.long)
    seed_low, seed_high = int(seed) & _MASK32, (int(seed) >> 32) & _MASK32
    h = fmix32(torch.full_like(hashes[..., 0], seed_low) ^ _mul32(positions + 1, 0x9E3779B1))
    h = fmix32(h ^ seed_high ^ _mul32(hashes[..., 0], 0xCC9E2D51))
    first = fmix32(h ^ _mul32(hashes[..., 1], 0x1B873593))
    second = fmix32(first ^ _mul32(hashes[..., 0] ^ hashes[..., 1], 0x27D4EB2F) ^ 0x165667B1)
    return torch.stack((first, second), dim=-1)


def standard_normals(keys: Tensor, width: int, truncated: bool = False) -> Tensor:
    """[batch, pos, width] standard normals (float64 where the device has it, else float32), one
    per key [batch, pos, 2] and element; ``truncated``: within three standard deviations."""
    element = torch.arange(width, dtype=torch.long, device=keys.device)
    h = fmix32(keys[..., :1] ^ _mul32(element + 1, 0x85EBCA77))
    h = fmix32(h ^ keys[..., 1:])
    dtype = torch.float32 if keys.device.type == "mps" else torch.float64
    uniform = ((h >> 8).to(dtype) + 0.5) / 2**24  # in (0, 1), 24 bits
    if truncated:
        low, high = _TRUNCATION
        uniform = low + uniform * (high - low)
    return math.sqrt(2.0) * torch.erfinv(2.0 * uniform - 1.0)


def causal_noise(
    tokens: Tensor | None,
    n_positions: int,
    width: int,
    seed: int,
    truncated: bool = False,
    state: PrefixState | None = None,
    batch: int = 1,
    mask: Tensor | None = None,
    positions: Tensor | None = None,
) -> tuple[Tensor, PrefixState | None]:
    """Standard-normal noise [batch, pos, width] for ``tokens`` [batch, pos] (continuing
    ``state`` when a KV cache carries one), and the prefix state after them. In a padded batch
    ``mask`` [batch, pos] (True on real tokens) and ``positions`` [batch, pos] (each row's own)
    make each row's noise that of its real tokens alone.

    Without tokens (a forward resumed from a residual stream) the noise depends on the seed and
    the position only, the same for every row."""
    if tokens is None:
        hashes = torch.zeros(batch, n_positions, 2, dtype=torch.long)
        offset = 0 if state is None else state.length
        keys = position_keys(seed, hashes, offset)
        return standard_normals(keys, width, truncated), None
    hashes, after = prefix_hashes(tokens, state, mask, positions)
    keys = position_keys(seed, hashes, after.length - tokens.shape[1], positions)
    return standard_normals(keys, width, truncated), after
