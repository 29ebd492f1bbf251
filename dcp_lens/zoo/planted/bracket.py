"""Planted models for the S bracket (docs/bracket.md): computations the input reaches through the
concat adapter, a flipped frame, a skewed or smooth cycle, a three-way mixture.
"""

from __future__ import annotations

import math

import torch

from dcp_lens.zoo.planted.base import (
    PlantedModel,
    PlantedTask,
    adapter_config,
    at_least,
    base_config,
    blank_model,
    mixture,
    route,
    set_linear_mlp,
)
from dcp_lens.zoo.planted.factors import distinct_computation, mixture_shift_blocks


def distinct_computation_context(
    size: int = 11, n_iterations: int = 8, seed: int = 0, skew: int = 0
) -> PlantedModel:
    """D only, and identifiable: what is left to compute after k is absent from s_k.

    A token is a pair (start node, step) of a ``size``-cycle (``size`` prime, > r). The state is
    [node one-hot (size), step one-hot (size), carrier]; s_0 = e. Each iteration the adapter
    feeds the node from the state and the step from the input e, and the MLP moves the node by
    the step (one unit per (node, step), firing when both are on) and clears the step from the
    state. So s_k holds node_k = start + k step only, and the answer, start + r step = node_k +
    (r - k) step, is independent of node_k (the step is uniform and (r - k) step is uniform mod a
    prime): no map of s_k, affine or not, beats the base rate (S = 0); a replayed update
    lands on no node the readout reads as new (B = 0); each iteration is new work (D = 1).
    Replay's readout input s_k + (r - k)(s_k - s_{k-1}) does hold node_{k-1} beside node_k, and
    so the answer, but only through their modular sum: its least-squares affine map onto s_r is
    flat in the population, and the paired translator is replaced by the mean (the protocol's
    held-out gate, `dcp_lens.protocol.fit`).

    ``skew`` > 0 adds ``skew`` * ``size`` tokens that copy the pairs whose answer is node 0:
    answer 0 then holds (1 + skew) / (size + skew) of the answers while node_k stays uniform, so
    full depth's marginal differs from truncation's and marginal matching pulls the readout
    toward the frequent answer (a base-rate gain, not readout shift).
    """
    n = at_least(size, 3, "size")
    r = at_least(n_iterations, 2, "n_iterations")
    extra = at_least(skew, 0, "skew")
    pairs = [(start, step) for start in range(n) for step in range(n)]
    pairs += [((-r * step) % n, step) for _ in range(extra) for step in range(n)]
    n_inputs = len(pairs)
    d_model = 2 * n + 1
    node, steps, carrier = slice(0, n), slice(n, 2 * n), 2 * n
    units = [(i, step) for i in range(n) for step in range(1, n)]
    cfg = adapter_config(d_model, n_inputs, r, len(units) + 2 * n)
    model = blank_model(cfg)
    carrier_size = 10.0
    rms = math.sqrt((carrier_size**2 + 2.0) / d_model)  # u = [node, step, carrier]: fixed norm
    sharpness = 20.0  # gelu(20) = 20, gelu(0) = 0, gelu(-20) ~ 0: a unit is on or off
    with torch.no_grad():
        start = torch.tensor([p[0] for p in pairs])
        step = torch.tensor([p[1] for p in pairs])
        W_E = model.embed.W_E
        W_E[torch.arange(n_inputs), start] = 1.0
        W_E[torch.arange(n_inputs), n + step] = 1.0
        W_E[:, carrier] = carrier_size
        route(model, [*range(n), carrier], range(n, 2 * n))
        mlp = model._core[0][0].mlp
        for unit, (i, j) in enumerate(units):  # on iff node i and step j: node i -> i + j
            mlp.W_in[i, unit] = sharpness * rms
            mlp.W_in[n + j, unit] = sharpness * rms
            mlp.W_in[carrier, unit] = -sharpness * rms / carrier_size
            mlp.W_out[unit, (i + j) % n] = 1.0 / sharpness
            mlp.W_out[unit, i] = -1.0 / sharpness
        clear = len(units)  # gelu(z) - gelu(-z) = z: take the step back out of the state
        for j in range(n):
            mlp.W_in[n + j, clear + 2 * j] = rms
            mlp.W_in[n + j, clear + 2 * j + 1] = -rms
            mlp.W_out[clear + 2 * j, n + j] = -1.0
            mlp.W_out[clear + 2 * j + 1, n + j] = 1.0
        readout_rms = math.sqrt((carrier_size**2 + 1.0) / d_model)  # s_t = [node, 0, carrier]
        W_U = torch.zeros(d_model, n_inputs)
        W_U[node, :n] = 10.0 * readout_rms * torch.eye(n)
        W_U[carrier, n:] = -10.0 * readout_rms / carrier_size  # non-nodes are never answers
        W_U[steps, :] = 0.0
        model.unembedding.copy_(W_U)
    answers = (start + r * step) % n
    model.planted_task = PlantedTask(answers, n_inputs, seed)
    return model


def distinct_computation_skewed(
    size: int = 11, n_iterations: int = 8, seed: int = 0
) -> PlantedModel:
    """Ambiguous for marginal matching: `distinct_computation_context` with a skewed answer prior
    (about half the answers are node 0). The truth is D = 1; calibration books the base rate as
    S unless it is discounted (docs/bracket.md)."""
    return distinct_computation_context(size, n_iterations, seed, skew=size - 1)


def block_count_context(
    size: int = 256, n_iterations: int = 8, seed: int = 0, vote: float = 0.3
) -> PlantedModel:
    """B only, and identifiable: `block_count` with the features that cast the vote kept out of
    the state.

    The state is [answer, x1, x2, carrier], s_0 = e = [eta, x1, x2, carrier]. Each iteration the
    adapter feeds the answer and carrier from the state and x1, x2 from the input e; the MLP adds
    ``vote`` * x1 x2 to the answer and clears x1, x2 from the state. So s_k = [eta + k vote x1 x2,
    0, 0, carrier]: what is left to add depends on x1 x2, which s_k holds only through the sum,
    and by symmetry the truncated readout's sign is already the best read of it (S = 0).
    Replaying any update k >= 2 reproduces full depth exactly (B = 1), and no iteration computes
    anything the first did not (D = 0).
    """
    n_inputs = at_least(size, 8, "size")
    r = at_least(n_iterations, 2, "n_iterations")
    cfg = adapter_config(4, n_inputs, r, 8)
    model = blank_model(cfg)
    generator = torch.Generator().manual_seed(seed)
    features = torch.stack([torch.arange(n_inputs) % 2, (torch.arange(n_inputs) // 2) % 2], 1)
    features = 2.0 * features.float() - 1.0
    offsets = torch.randn(n_inputs, generator=generator)
    carrier = 100.0
    sharpness = 2000.0
    rms = math.sqrt((carrier**2 + 2.0) / 4.0)  # up to the answer coordinate's own size
    with torch.no_grad():
        model.embed.W_E.copy_(
            torch.stack(
                [offsets, features[:, 0], features[:, 1], torch.full((n_inputs,), carrier)], 1
            )
        )
        route(model, [0, 3], [1, 2])
        mlp = model._core[0][0].mlp
        plus, minus = torch.tensor([0.0, 1.0, 1.0, 0.0]), torch.tensor([0.0, 1.0, -1.0, 0.0])
        mlp.W_in[:, :4] = torch.stack([plus, -plus, minus, -minus], 1) * sharpness
        mlp.W_out[:4, 0] = torch.tensor([1.0, 1.0, -1.0, -1.0]) * vote * rms / (2.0 * sharpness)
        for i, coordinate in enumerate((1, 2)):  # clear x1, x2: gelu(z) - gelu(-z) = z
            mlp.W_in[coordinate, 4 + 2 * i] = rms
            mlp.W_in[coordinate, 5 + 2 * i] = -rms
            mlp.W_out[4 + 2 * i, coordinate] = -1.0
            mlp.W_out[5 + 2 * i, coordinate] = 1.0
        scale = 20.0 * carrier / 2.0  # the answer coordinate is the logit
        W_U = torch.zeros(4, n_inputs)
        W_U[0, 0], W_U[0, 1] = scale / carrier, -scale / carrier
        W_U[3, 2:] = -1.0
        model.unembedding.copy_(W_U)
    answers = torch.where(features[:, 0] * features[:, 1] > 0, 0, 1)
    model.planted_task = PlantedTask(answers, n_inputs, seed)
    return model


def frame_flip(n_iterations: int = 8, seed: int = 0) -> PlantedModel:
    """Ambiguous: readout shift that keeps the marginal (truth S = 1, not identifiable).

    The state is an answer's code in {-1, +1}^4 (16 answers, every code used once), and each
    iteration flips the sign of its first two coordinates, a linear change of frame that maps the
    set of codes onto itself. Nothing is computed: s_k holds the answer in full, in the frame of
    s_r when r - k is even and the flipped frame when it is odd. The codes' distribution is the
    same at every depth, so no map fitted to marginals can see the change (S_lower = 0), while a
    paired map learns the flip (S_upper = 1). The same holds, with the opposite convention, of
    `distinct_computation`, whose permutation of a one-hot state is also a change of frame.
    """
    r = at_least(n_iterations, 2, "n_iterations")
    cfg = base_config(4, 16, r, 8)
    model = blank_model(cfg)
    bits = (torch.arange(16)[:, None] >> torch.arange(4)) & 1
    codes = 2.0 * bits.float() - 1.0  # [16, 4], token t's code
    flip = torch.diag(torch.tensor([-1.0, -1.0, 1.0, 1.0]))
    with torch.no_grad():
        model.embed.W_E.copy_(codes)
        set_linear_mlp(model, flip - torch.eye(4), 1.0)  # every code has RMS 1
        model.unembedding.copy_(3.0 * codes.T)  # logit of answer j: 3 <code_j, s>
    model.planted_task = PlantedTask(torch.arange(16), 16, seed)
    return model


def mixture_three_way(n_iterations: int = 8, seed: int = 0) -> PlantedModel:
    """Ambiguous: S + B + D, a third of the tokens each: `mixture_shift_blocks` (S and B) beside
    a 32-cycle `distinct_computation` (D, a permutation a paired map can learn)."""
    return mixture(
        mixture_shift_blocks(n_iterations, seed),
        distinct_computation(32, n_iterations, seed),
        ("S+B", "D"),
    )


def distinct_computation_smooth(
    size: int = 13, n_iterations: int = 8, seed: int = 0, width: float = 3.0
) -> PlantedModel:
    """Ambiguous for B: `distinct_computation` read by a smooth unembedding (answer j's logit
    falls off as a Gaussian of width ``width`` in the cycle distance from the node). Replaying
    the last update, (r - k + 1) e_{n_k} - (r - k) e_{n_k - 1}, then moves the argmax forward
    along the cycle: replay walks between valid answers. The truth is D = 1 (each iteration is a
    new step); docs/bracket.md explains why B is flagged rather than booked here."""
    model = distinct_computation(size, n_iterations, seed)
    n = model.cfg.d_model
    index = torch.arange(n)
    distance = (index[:, None] - index[None, :]).abs()
    distance = torch.minimum(distance, n - distance).float()
    with torch.no_grad():
        model.unembedding.copy_(10.0 * torch.exp(-(distance**2) / (2 * width**2)))
    return model
