"""Planted models that are ambiguous in the map class or in the order of S and B: a gated flip,
a warped frame, a walking readout.
"""

from __future__ import annotations

import math

import torch

from dcp_lens.utils.errors import ConfigError
from dcp_lens.zoo.planted.base import (
    PlantedModel,
    PlantedTask,
    at_least,
    base_config,
    blank_model,
)


def frame_flip_gated(
    n_iterations: int = 8, seed: int = 0, flipped: tuple[int, int] = (0, 1), gate: int = 2
) -> PlantedModel:
    """Ambiguous: readout shift that no affine map undoes (truth S = 1, not identifiable).

    Like `frame_flip`, the state is an answer's code in {-1, +1}^4 (16 answers) and nothing is
    computed; but each iteration flips the sign of the coordinates ``flipped`` only where the
    coordinate ``gate`` is +1: c_i -> -c_i c_g when it flips, a product of two coordinates. So
    s_k holds the answer in full, in a frame that differs from s_r's by a gated sign flip when
    r - k is odd. The codes' distribution is the same at every depth, and the product c_i c_3
    is uncorrelated with every coordinate, so neither marginal matching nor a paired affine
    translator recovers any of it: the affine maps see a gap they cannot repair, and the right
    answer is "not recovered by an affine change of frame" (distinct computation, or a
    non-affine shift), never "distinct computation".
    """
    r = at_least(n_iterations, 2, "n_iterations")
    if len({*flipped, gate}) != 3 or not all(0 <= i < 4 for i in (*flipped, gate)):
        raise ConfigError(f"flipped={flipped} and gate={gate} must be three distinct of 0..3.")
    cfg = base_config(4, 16, r, 12)
    model = blank_model(cfg)
    bits = (torch.arange(16)[:, None] >> torch.arange(4)) & 1
    codes = 2.0 * bits.float() - 1.0  # [16, 4], token t's code; every state has RMS 1
    sharpness = 2000.0  # |z| = (gelu(cz) + gelu(-cz)) / c, exact for z in {0, +-2}
    with torch.no_grad():
        model.embed.W_E.copy_(codes)
        mlp = model._core[0][0].mlp
        for n, i in enumerate(flipped):  # delta c_i = -c_i - c_i c_g (the flip where c_g = +1)
            linear, product = 2 * n, 4 + 4 * n
            mlp.W_in[i, linear], mlp.W_in[i, linear + 1] = 1.0, -1.0
            mlp.W_out[linear, i], mlp.W_out[linear + 1, i] = -1.0, 1.0
            # c_i c_g = (|c_i + c_g| - |c_i - c_g|) / 2
            for unit, (a, b) in enumerate(((1, 1), (-1, -1), (1, -1), (-1, 1))):
                mlp.W_in[i, product + unit] = a * sharpness
                mlp.W_in[gate, product + unit] = b * sharpness
                sign = -1.0 if unit < 2 else 1.0
                mlp.W_out[product + unit, i] = sign / (2.0 * sharpness)
        model.unembedding.copy_(3.0 * codes.T)  # logit of answer j: 3 <code_j, s>
    model.planted_task = PlantedTask(torch.arange(16), 16, seed)
    return model


def frame_warp(
    n_iterations: int = 8, seed: int = 0, magnitudes: tuple[float, float] = (0.5, 1.5)
) -> PlantedModel:
    """Ambiguous: an invertible elementwise warp of the frame (truth S = 1, not identifiable).

    The state is [x (2), carrier]: the answer's code, each coordinate at one of the levels
    +-m_1, +-m_2 (``magnitudes``, default 0.5 and 1.5; 16 answers). Each iteration warps every
    coordinate by w, which swaps the two magnitudes and keeps the sign (w(x) = (m_1 + m_2)
    sign(x) - x on the levels, its own inverse). Nothing is computed: s_k holds the answer in
    full, in s_r's frame when r - k is even and warped when it is odd. The levels' distribution
    is the same at every depth (no marginal map sees the warp), and w is not affine (at the
    default levels the best affine fit of w(x) from x has slope 0.6), so the affine maps
    recover little of the gap: the right answer is "not recovered by an affine change of
    frame", never "distinct computation".
    """
    r = at_least(n_iterations, 2, "n_iterations")
    small, large = (float(m) for m in magnitudes)
    if not 0.1 <= small < large <= 3.0:
        raise ConfigError(f"magnitudes={magnitudes} must be two levels 0.1 <= m_1 < m_2 <= 3.")
    levels = torch.tensor([-large, -small, small, large])
    total = small + large
    codes = torch.stack([levels.repeat_interleave(4), levels.repeat(4)], 1)  # [16, 2]
    d_model = 3
    cfg = base_config(d_model, 16, r, 10)
    model = blank_model(cfg)
    carrier = 2
    carrier_size = 100.0  # dominates the norm: the warp moves the RMS by < 0.02%
    rms = math.sqrt((carrier_size**2 + small**2 + large**2) / d_model)  # mean code norm^2
    sharpness = 100.0 / (small / rms)  # clip(c u, -1, 1) is sign(x) for |x| >= m_1
    with torch.no_grad():
        model.embed.W_E[:, :2] = codes
        model.embed.W_E[:, carrier] = carrier_size
        mlp = model._core[0][0].mlp
        for i in (0, 1):  # delta x_i = (m_1 + m_2) sign(x_i) - 2 x_i
            base = 5 * i
            # sign(x) = gelu(c u + 1) - gelu(c u - 1) - 1, with the 1s from the carrier
            mlp.W_in[i, base], mlp.W_in[carrier, base] = sharpness, rms / carrier_size
            mlp.W_in[i, base + 1], mlp.W_in[carrier, base + 1] = sharpness, -rms / carrier_size
            mlp.W_out[base, i], mlp.W_out[base + 1, i] = total, -total
            # -2 x = -2 rms (gelu(u) - gelu(-u)); the constant -2 from the carrier unit below
            mlp.W_in[i, base + 2], mlp.W_in[i, base + 3] = 1.0, -1.0
            mlp.W_out[base + 2, i], mlp.W_out[base + 3, i] = -2.0 * rms, 2.0 * rms
            mlp.W_in[carrier, base + 4] = rms / carrier_size  # gelu(1) ~ 0.841: a constant unit
            mlp.W_out[base + 4, i] = -total / float(torch.nn.functional.gelu(torch.tensor(1.0)))
        # Nearest code: logit_j = beta (<code_j, x> - |code_j|^2 / 2), read from s / RMS(s).
        beta = 20.0
        W_U = torch.zeros(d_model, 16)
        W_U[:2] = beta * rms * codes.T
        W_U[carrier] = -beta * rms * (codes**2).sum(1) / (2.0 * carrier_size)
        model.unembedding.copy_(W_U)
    model.planted_task = PlantedTask(torch.arange(16), 16, seed)
    return model


def readout_shift_walk(
    size: int = 8, n_iterations: int = 8, seed: int = 0, strength: float = 3.0
) -> PlantedModel:
    """Ambiguous for the order of S and B: a constant per-step update (truth S = 1 or B = 1).

    The state is [answer one-hot (size), walk t, carrier]. Every iteration adds 1 to t (from the
    carrier), and the readout biases answer j's logit by lambda w_j (t - r): zero at full depth
    only. Nothing is computed. The shift is a translation along a line, so mean matching undoes
    it (S = gap taken first), and replaying any update walks the rest of the line to full depth
    (B = gap taken first): the two orders of S and B give 1 and 0, and the split of S and B is
    a convention, not a measurement. The right answer is inconclusive (the order decides).
    """
    n_answers = at_least(size, 2, "size")
    r = at_least(n_iterations, 2, "n_iterations")
    d_model = n_answers + 2
    n_inputs = 4 * n_answers
    cfg = base_config(d_model, n_inputs, r, 2)
    model = blank_model(cfg)
    walk, carrier = n_answers, n_answers + 1
    carrier_size = 100.0  # dominates the norm: the walk moves the RMS by < 0.4%
    answers = torch.arange(n_inputs) % n_answers
    rms = math.sqrt((1.0 + carrier_size**2) / d_model)
    with torch.no_grad():
        W_E = model.embed.W_E
        W_E[torch.arange(n_inputs), answers] = 1.0
        W_E[:, carrier] = carrier_size
        mlp = model._core[0][0].mlp
        mlp.W_in[carrier, 0], mlp.W_in[carrier, 1] = 1.0, -1.0
        mlp.W_out[0, walk] = rms / carrier_size
        mlp.W_out[1, walk] = -rms / carrier_size
        generator = torch.Generator().manual_seed(seed)
        directions = torch.randn(n_answers, generator=generator)
        W_U = torch.zeros(d_model, n_inputs)
        W_U[torch.arange(n_answers), torch.arange(n_answers)] = 4.0 * rms
        W_U[walk, :n_answers] = strength * rms * directions
        W_U[carrier, :n_answers] = -strength * rms * r * directions / carrier_size
        W_U[carrier, n_answers:] = -rms  # input-only tokens are never answers
        model.unembedding.copy_(W_U)
    model.planted_task = PlantedTask(answers, n_inputs, seed)
    return model
