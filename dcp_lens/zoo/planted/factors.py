"""Planted models of one factor each (S, D or B), their mixtures and their soft-answer versions."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dcp_lens.protocol.states import capture_states
from dcp_lens.zoo.planted.base import (
    PlantedModel,
    PlantedTask,
    at_least,
    base_config,
    blank_model,
    mixture,
    position_table,
    set_linear_mlp,
    soft_answers,
)


def readout_shift(
    size: int = 8, n_iterations: int = 8, seed: int = 0, angle: float = 2 * math.pi / 11
) -> PlantedModel:
    """S only: DCP must attribute the gap to readout shift (S ~ gap; B, D ~ 0).

    ``size`` answer classes. The state is [answer one-hot (size), clock (2), constant 1]; the
    answer is in e and never changes. The core rotates the clock by ``angle`` (a linear map, so
    each iteration's update points elsewhere and replaying one update misses). The readout adds
    lambda <w_j, clock - c_r> to answer j: zero only when the clock is where it is after r
    iterations. Calibration (even mean-only) moves the clock back; nothing is computed, so D = 0.
    """
    n_answers = at_least(size, 2, "size")
    d_model = n_answers + 3
    n_inputs = 4 * n_answers
    cfg = base_config(d_model, n_inputs, at_least(n_iterations, 2, "n_iterations"), 2 * d_model)
    model = blank_model(cfg)
    clock = slice(n_answers, n_answers + 2)
    constant = n_answers + 2
    start = torch.tensor([1.0, 0.0])
    rotation = torch.tensor(
        [[math.cos(angle), math.sin(angle)], [-math.sin(angle), math.cos(angle)]]
    )  # row-vector convention: c_t = c_{t-1} @ rotation
    answers = torch.arange(n_inputs) % n_answers
    with torch.no_grad():
        W_E = model.embed.W_E
        W_E[torch.arange(n_inputs), answers] = 1.0
        W_E[:, clock] = start
        W_E[:, constant] = 1.0
        rms = math.sqrt((1.0 + 1.0 + 1.0) / d_model)  # every state has norm^2 = 3
        linear = torch.zeros(d_model, d_model)
        linear[clock, clock] = rotation - torch.eye(2)
        set_linear_mlp(model, linear, rms)
        final_clock = start @ torch.linalg.matrix_power(rotation, cfg.n_iterations)
        generator = torch.Generator().manual_seed(seed)
        directions = torch.randn(2, n_answers, generator=generator)
        directions = directions / directions.norm(dim=0, keepdim=True)
        strength = 20.0
        W_U = torch.zeros(d_model, n_inputs)
        W_U[torch.arange(n_answers), torch.arange(n_answers)] = 1.0
        W_U[clock, :n_answers] = strength * directions
        W_U[constant, :n_answers] = -strength * (final_clock @ directions)
        W_U[constant, n_answers:] = -100.0  # input-only tokens are never answers
        model.unembedding.copy_(W_U)
    model.planted_task = PlantedTask(answers, n_inputs, seed)
    return model


def readout_shift_step(size: int = 8, n_iterations: int = 8, seed: int = 0) -> PlantedModel:
    """S only, with replay exactly neutral: the clock turns once, at the last iteration.

    `readout_shift` turns its clock a little every iteration, and replaying the k-th update
    extrapolates along the chord, which for k near r lands near c_r: replay then repairs part of
    the shift (B 0.02 of its gap, more on some seeds), an interaction the mixtures' planted truth
    cannot book. Here the state is [answer one-hot (size), clock (2), counter q, carrier C]. Each
    iteration adds 1 to q (from the carrier), and a sharp GELU unit that fires only when q = r - 1
    turns the clock from c_0 to c_r = -c_0 at iteration r. So s_k, k < r, holds the answer in
    full with the clock at c_0 (the readout biases answer j's logit by lambda <w_j, c_0 - c_r>,
    the same bias for every token: a translation that mean matching undoes, S = gap),
    and the k-th update, k < r, moves q only, so replay's readout is truncation's (B = 0), and
    calibrated replay is full depth (D = 0).
    """
    n_answers = at_least(size, 2, "size")
    r = at_least(n_iterations, 2, "n_iterations")
    d_model = n_answers + 4
    n_inputs = 4 * n_answers
    cfg = base_config(d_model, n_inputs, r, 4)
    model = blank_model(cfg)
    clock, counter, carrier = slice(n_answers, n_answers + 2), n_answers + 2, n_answers + 3
    carrier_size = 100.0  # dominates the norm: the counter moves the RMS by < 0.4%
    start = torch.tensor([1.0, 0.0])
    final = -start
    answers = torch.arange(n_inputs) % n_answers
    rms = math.sqrt((1.0 + 1.0 + carrier_size**2) / d_model)  # at q = 0
    with torch.no_grad():
        W_E = model.embed.W_E
        W_E[torch.arange(n_inputs), answers] = 1.0
        W_E[:, clock] = start
        W_E[:, carrier] = carrier_size
        mlp = model._core[0][0].mlp
        # Units 0, 1: gelu(u_C) - gelu(-u_C) = C / rms, scaled to add 1 to q every iteration.
        mlp.W_in[carrier, 0], mlp.W_in[carrier, 1] = 1.0, -1.0
        mlp.W_out[0, counter] = rms / carrier_size
        mlp.W_out[1, counter] = -rms / carrier_size
        # Unit 2: preactivation 100 (q - r + 1.5), times rms / RMS(s): +50 at q = r - 1, -50
        # (gelu ~ 0) at q <= r - 2; its output turns the clock by final - start.
        sharpness = 100.0 * rms
        mlp.W_in[counter, 2] = sharpness
        mlp.W_in[carrier, 2] = -sharpness * (r - 1.5) / carrier_size
        mlp.W_out[2, clock] = (final - start) / 50.0
        generator = torch.Generator().manual_seed(seed)
        directions = torch.randn(2, n_answers, generator=generator)
        directions = directions / directions.norm(dim=0, keepdim=True)
        strength = 20.0
        # The readout sees s / RMS(s): scale by rms so that answer j's logit is about
        # s_j + strength <w_j, clock - c_r>.
        W_U = torch.zeros(d_model, n_inputs)
        W_U[torch.arange(n_answers), torch.arange(n_answers)] = rms
        W_U[clock, :n_answers] = strength * rms * directions
        W_U[carrier, :n_answers] = -strength * rms * (final @ directions) / carrier_size
        W_U[carrier, n_answers:] = -rms  # input-only tokens are never answers (logit -100)
        model.unembedding.copy_(W_U)
        # The RMS grows with q, so the unit fires a little below 50: rescale its output so that
        # the clock lands on c_r exactly (every token has the same norm, so one factor does).
        reached = capture_states(model, torch.zeros(1, 1, dtype=torch.long))[0][r][0, 0, clock]
        mlp.W_out[2, clock] *= (final - start).norm() / (reached - start).norm()
    model.planted_task = PlantedTask(answers, n_inputs, seed)
    return model


def distinct_computation(size: int = 13, n_iterations: int = 8, seed: int = 0) -> PlantedModel:
    """D only: DCP must attribute the gap to distinct computation (D ~ gap; S, B ~ 0).

    The state is a one-hot node of a ``size``-cycle; each iteration moves it one step (a
    permutation, linear). Start nodes are uniform, so every depth sees the same state distribution
    (S = 0); the answer is the node after r steps, so each iteration is new work, and a replayed
    update lands on no node that answers correctly (B = 0). ``size`` should exceed r.
    """
    n_nodes = at_least(size, 3, "size")
    cfg = base_config(n_nodes, n_nodes, at_least(n_iterations, 2, "n_iterations"), 2 * n_nodes)
    model = blank_model(cfg)
    step = torch.roll(torch.eye(n_nodes), shifts=1, dims=1)  # e_i @ step = e_{i+1}
    with torch.no_grad():
        model.embed.W_E.copy_(torch.eye(n_nodes))
        set_linear_mlp(model, step - torch.eye(n_nodes), math.sqrt(1.0 / n_nodes))
        model.unembedding.copy_(torch.eye(n_nodes))
    answers = (torch.arange(n_nodes) + cfg.n_iterations) % n_nodes
    model.planted_task = PlantedTask(answers, n_nodes, seed)
    return model


def block_count(
    size: int = 256, n_iterations: int = 8, seed: int = 0, vote: float = 0.3
) -> PlantedModel:
    """B only: DCP must attribute the gap to block applications (B ~ gap; S, D ~ 0).

    ``size`` input tokens, each with two +-1 features x1, x2 and a fixed N(0, 1) offset eta. The
    state is [x1, x2, carrier, answer]; the answer coordinate starts at eta and every iteration adds
    ``vote`` * x1 x2 (an XOR, computed by the MLP from |x1 + x2| - |x1 - x2|: not linear in the
    state, so no affine calibration can supply it). The readout takes the sign. Accuracy grows with
    the number of applications; replaying the first update reproduces full depth; calibration
    cannot raise the signal-to-noise ratio; no iteration computes anything the first did not.
    """
    n_inputs = at_least(size, 8, "size")
    cfg = base_config(4, n_inputs, at_least(n_iterations, 2, "n_iterations"), 4)
    model = blank_model(cfg)
    generator = torch.Generator().manual_seed(seed)
    features = torch.stack([torch.arange(n_inputs) % 2, (torch.arange(n_inputs) // 2) % 2], 1)
    features = 2.0 * features.float() - 1.0  # x1, x2 in {-1, +1}, balanced
    offsets = torch.randn(n_inputs, generator=generator)
    carrier = 100.0  # dominates the state's norm, so the RMS norm barely changes as votes add up
    sharpness = 2000.0  # gelu(c z) / c is |z|-exact far from 0
    with torch.no_grad():
        model.embed.W_E.copy_(
            torch.stack(
                [features[:, 0], features[:, 1], torch.full((n_inputs,), carrier), offsets], 1
            )
        )
        mlp = model._core[0][0].mlp
        rms = carrier / 2.0  # sqrt(carrier^2 / 4) up to the small coordinates
        plus, minus = torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([1.0, -1.0, 0.0, 0.0])
        mlp.W_in.copy_(torch.stack([plus, -plus, minus, -minus], 1) * sharpness)
        # (|u1 + u2| - |u1 - u2|) = 2 x1 x2 / rms for u = s / rms: scale back to `vote` per step.
        scale = vote * rms / (2.0 * sharpness)
        mlp.W_out.zero_()
        mlp.W_out[:4, 3] = torch.tensor([1.0, 1.0, -1.0, -1.0]) * scale
        W_U = torch.zeros(4, n_inputs)
        W_U[3, 0], W_U[3, 1] = 1.0, -1.0  # token 0: x1 x2 = +1; token 1: x1 x2 = -1
        W_U[2, 2:] = -1.0  # other tokens are never answers
        model.unembedding.copy_(W_U)
    answers = torch.where(features[:, 0] * features[:, 1] > 0, 0, 1)
    model.planted_task = PlantedTask(answers, n_inputs, seed)
    return model


def _type_dependent_shift(
    by: str, size: int, n_iterations: int, seed: int, shift_size: float = 3.0
) -> PlantedModel:
    """S only, a shift that differs between inputs (`readout_shift_by_token_type`, `..._position`).

    The state is [answer logits z (size), clock A (2), clock B (2), carrier]. Half the inputs are
    type A, half type B, by token (``by="token"``) or by the position's parity (``by="position"``).
    A type-A input's clock starts at c0 and turns by +2 pi / 11 per iteration; a type-B input's
    starts at c0's mirror image and turns the other way (the other clock stays 0). Every
    iteration adds the turn of the clock to z through a fixed random map (W for clock A, -W
    mirrored for clock B) and e starts z where the r turns bring it to the answer's one-hot:
    z_k = onehot + delta_type(k), with delta_B(k) = -delta_A(k) and delta(r) = 0. The readout
    reads z only. The answer is in z at every depth and nothing is computed (D = 0); the turning
    clock makes replay miss (B ~ 0, as in `readout_shift`). Within a type the shift is a
    translation, so an affine map fitted per cluster of the state (the clocks separate the types)
    repairs both truncate and replay exactly; pooled over types the mean of z never moves and the
    shift shows only as between-type spread of z, which moment matching squeezes rather than
    undoes. (One pooled affine map does exist: subtract the clocks' contribution. A shift that
    no pooled affine map repairs needs different linear maps per type on the same coordinates;
    the ones moment matching can recover are stretches, whose updates are collinear, so replay
    repairs them too: a B/S confound, not an S-only model.)
    """
    n_answers = at_least(size, 3, "size")
    r = at_least(n_iterations, 2, "n_iterations")
    n_inputs = 2 * n_answers if by == "token" else n_answers
    d_model = n_answers + 5
    cfg = base_config(d_model, n_inputs, r, 2 * d_model)
    model = blank_model(cfg)
    z, clock_a, clock_b, carrier = (
        slice(0, n_answers),
        [n_answers, n_answers + 1],
        [n_answers + 2, n_answers + 3],
        n_answers + 4,
    )
    angle = 2 * math.pi / 11
    turn = torch.tensor([[math.cos(angle), math.sin(angle)], [-math.sin(angle), math.cos(angle)]])
    mirror = torch.diag(torch.tensor([1.0, -1.0]))
    turn_b = mirror @ turn @ mirror  # the mirror image turns the other way
    generator = torch.Generator().manual_seed(seed)
    into_z = shift_size * torch.randn(2, n_answers, generator=generator) / math.sqrt(2)
    into_z_b = -mirror @ into_z  # so that delta_B = -delta_A
    start_a = torch.tensor([1.0, 0.0])
    start_b = start_a @ mirror
    final_a = start_a @ torch.linalg.matrix_power(turn, r)
    final_b = start_b @ torch.linalg.matrix_power(turn_b, r)
    offset_a = (start_a - final_a) @ into_z  # z_0 - onehot for type A
    offset_b = (start_b - final_b) @ into_z_b
    answers = torch.arange(n_inputs) % n_answers
    carrier_size = 100.0  # dominates the norm, so the RMS norm barely moves as z shifts
    with torch.no_grad():
        W_E = model.embed.W_E
        W_E[torch.arange(n_inputs), answers] = 1.0
        W_E[:, carrier] = carrier_size
        # The type, and with it the clock and z's start, comes with the token or the position.
        table: Tensor = W_E if by == "token" else position_table(model)
        rows = (torch.arange(table.shape[0]) // (n_answers if by == "token" else 1)) % 2 == 0
        table[rows, clock_a[0] : clock_a[1] + 1] = start_a
        table[~rows, clock_b[0] : clock_b[1] + 1] = start_b
        table[rows, z] += offset_a
        table[~rows, z] += offset_b
        rms = math.sqrt((carrier_size**2 + 2.0) / d_model)
        linear = torch.zeros(d_model, d_model)
        linear[clock_a[0] : clock_a[1] + 1, clock_a[0] : clock_a[1] + 1] = turn - torch.eye(2)
        linear[clock_b[0] : clock_b[1] + 1, clock_b[0] : clock_b[1] + 1] = turn_b - torch.eye(2)
        linear[clock_a[0] : clock_a[1] + 1, z] = (turn - torch.eye(2)) @ into_z
        linear[clock_b[0] : clock_b[1] + 1, z] = (turn_b - torch.eye(2)) @ into_z_b
        set_linear_mlp(model, linear, rms)
        sharpness = 4.0  # logit of answer j: sharpness * z_j
        W_U = torch.zeros(d_model, n_inputs)
        W_U[torch.arange(n_answers), torch.arange(n_answers)] = sharpness * rms
        W_U[carrier, n_answers:] = -1.0  # input-only tokens are never answers
        model.unembedding.copy_(W_U)
    model.planted_task = PlantedTask(answers, n_inputs, seed)
    return model


def readout_shift_by_token_type(
    size: int = 8, n_iterations: int = 8, seed: int = 0
) -> PlantedModel:
    """S only, a shift that depends on the token's type; see `_type_dependent_shift`.

    Tokens 0..size-1 are type A, size..2 size-1 type B; token t answers t mod size.
    """
    return _type_dependent_shift("token", size, n_iterations, seed)


def readout_shift_by_position(size: int = 8, n_iterations: int = 8, seed: int = 0) -> PlantedModel:
    """S only, a shift that depends on the position's parity; see `_type_dependent_shift`:
    even positions are type A, odd ones type B; token t answers t."""
    return _type_dependent_shift("position", size, n_iterations, seed)


def mixture_shift_distinct(n_iterations: int = 8, seed: int = 0) -> PlantedModel:
    """S + D: half the tokens are `readout_shift_step` (size 8, 32 tokens), half
    `distinct_computation` (a 32-cycle). The true shares are the two halves' truncation gaps:
    `expected_shares` measures them on the evaluation set (S about 0.47 of the accuracy gap).
    The S half is the step clock, not `readout_shift`'s turning one, because a mixture's truth
    books each half's gap to its own factor: that holds only where replay leaves the S half's
    readout as truncation left it (docs/validation.md, "Coverage of the intervals")."""
    return mixture(
        readout_shift_step(8, n_iterations, seed),
        distinct_computation(32, n_iterations, seed),
        ("S", "D"),
    )


def mixture_shift_blocks(n_iterations: int = 8, seed: int = 0) -> PlantedModel:
    """S + B: half the tokens are `readout_shift_step` (size 8, 32 tokens), half `block_count`
    (32 tokens, its readout scaled by 50 so that its answer coordinate is the logit and its gap
    shows on the losses too). True shares as for `mixture_shift_distinct`, and the S half is
    the step clock for the same reason."""
    blocks = block_count(32, n_iterations, seed)
    with torch.no_grad():
        blocks.unembedding.mul_(50.0)
    return mixture(readout_shift_step(8, n_iterations, seed), blocks, ("S", "B"))


def readout_shift_soft(size: int = 8, n_iterations: int = 8, seed: int = 0) -> PlantedModel:
    """`readout_shift` with soft answers (`soft_answers`): S only, on cross-entropy and KL too."""
    return soft_answers(readout_shift(size, n_iterations, seed), 1.0)


def distinct_computation_soft(size: int = 13, n_iterations: int = 8, seed: int = 0) -> PlantedModel:
    """`distinct_computation` with soft answers (`soft_answers`): D only, on cross-entropy, KL."""
    return soft_answers(distinct_computation(size, n_iterations, seed), 1.0)


def block_count_soft(size: int = 256, n_iterations: int = 8, seed: int = 0) -> PlantedModel:
    """`block_count` with soft answers (see `soft_answers`; the readout scaled so that the answer
    coordinate is the logit): B only, on cross-entropy and KL."""
    return soft_answers(block_count(size, n_iterations, seed), 20.0)
