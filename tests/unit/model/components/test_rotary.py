"""Rotary frequencies: Llama 3's scaling against the rule stated by the retrofit fixtures."""

from __future__ import annotations

import math

import torch

from dcp_lens.model.components.rotary import llama3_frequencies, rotary_tables


def test_llama3_scaling_keeps_high_divides_low_and_blends_between() -> None:
    """d_head 16, base 500000, factor 32, low 1, high 4, original context 8192: pairs 0..3 keep
    their frequency, pair 4 (wavelength about 4443) is blended, pairs 5..7 are divided by 32."""
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    scaled = llama3_frequencies(inv_freq, 32.0, 1.0, 4.0, 8192.0)
    assert torch.equal(scaled[:4], inv_freq[:4])
    assert torch.allclose(scaled[5:], inv_freq[5:] / 32)
    wavelength = 2 * math.pi / inv_freq[4].item()
    assert 4400 < wavelength < 4500
    blend = (8192 / wavelength - 1) / 3
    expected = (1 - blend) * inv_freq[4] / 32 + blend * inv_freq[4]
    assert torch.allclose(scaled[4], expected)
    assert inv_freq[4] / 32 < scaled[4] < inv_freq[4]


def test_tables_use_the_scaled_frequencies() -> None:
    cos, sin = rotary_tables(64, 16, 500000.0, (32.0, 1.0, 4.0, 8192.0))
    plain_cos, _ = rotary_tables(64, 16, 500000.0)
    assert torch.equal(cos[:, :4], plain_cos[:, :4])
    assert not torch.allclose(cos[:, 5:], plain_cos[:, 5:])
    assert torch.allclose(cos.square() + sin.square(), torch.ones_like(cos), atol=1e-6)
