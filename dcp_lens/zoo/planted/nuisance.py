"""Planted models whose stream is mostly content the readout does not read, for the paired
translators' held-out gate (`dcp_lens.protocol.gate`, docs/bracket.md): a gate that judges the
error of every coordinate of the state, not what the readout reads, gets them wrong.

- ``nuisance_shift``: a readout shift (S = 1) in 11 coordinates the readout reads, in a stream
  of 158 whose last iteration adds content that no earlier state predicts.
- ``nuisance_distinct``: distinct computation (D = 1) in coordinates the readout reads, beside a
  block the readout ignores that any affine map of an earlier state predicts exactly.
"""

from __future__ import annotations

import math

import torch

from dcp_lens.zoo.planted.base import (
    SEQUENCE_LENGTH,
    PlantedModel,
    PlantedTask,
    adapter_config,
    at_least,
    blank_model,
    position_table,
    route,
)
from dcp_lens.zoo.planted.bracket import distinct_computation_context

TOKENS_PER_ANSWER = 256  # more tokens than coordinates: s_k cannot name the token
NUISANCE_NORM = 7.0  # the nuisance block's norm: most of the full-depth state's
GROWTH = 3.0  # nuisance_shift's Y over X' in norm


def _class_centred(n_inputs: int, answers: torch.Tensor, width: int, seed: int) -> torch.Tensor:
    """``[n_inputs, width]`` random vectors of norm `NUISANCE_NORM` whose mean over the tokens
    of each answer is zero, so that the answer says nothing about them."""
    generator = torch.Generator().manual_seed(seed)
    vectors = torch.randn(n_inputs, width, generator=generator)
    for answer in answers.unique():
        same = answers == answer
        vectors[same] -= vectors[same].mean(0)
    return NUISANCE_NORM * vectors / vectors.norm(dim=1, keepdim=True)


def nuisance_shift(
    size: int = 8, n_iterations: int = 8, seed: int = 0, width: int = 158
) -> PlantedModel:
    """S only, in a wide stream whose last iteration adds content no earlier state predicts.

    The state is [answer one-hot (``size``), clock (2), constant 1, X, X', Y], X, X' and Y each a
    third of the ``width - size - 3`` remaining coordinates. The readout reads the answer, the
    clock and the constant: it adds lambda <w_j, clock - c_r> to answer j, as in
    `readout_shift` (the clock turns by 2 pi / 11 each iteration, a change of frame an affine
    map undoes, S = 1). `TOKENS_PER_ANSWER` tokens share each answer; each carries its own random
    vectors in X and X' (mean zero over the tokens of an answer, norm `NUISANCE_NORM`). X stays
    in the state until the last iteration (every s_k is as wide as the stream, as a real
    model's is); X' comes from the input at every iteration and the MLP takes it back out of the
    state. The last iteration (units that fire when the clock reads c_{r-1}) removes X and writes
    a random rotation of X', `GROWTH` times as long, into Y. With more tokens than coordinates,
    no affine map of s_k, k < r, predicts Y (beyond
    the small part X's span shares by chance), and the readout does not read it.
    """
    n_answers = at_least(size, 2, "size")
    r = at_least(n_iterations, 2, "n_iterations")
    third = (at_least(width, n_answers + 6, "width") - n_answers - 3) // 3
    d_model = n_answers + 3 + 3 * third
    n_inputs = TOKENS_PER_ANSWER * n_answers
    clock, constant = slice(n_answers, n_answers + 2), n_answers + 2
    kept = slice(n_answers + 3, n_answers + 3 + third)
    x = slice(kept.stop, kept.stop + third)
    y = slice(x.stop, d_model)
    cfg = adapter_config(d_model, n_inputs, r, 5 + 4 * third)
    model = blank_model(cfg)
    angle = 2 * math.pi / 11
    turn = torch.tensor([[math.cos(angle), math.sin(angle)], [-math.sin(angle), math.cos(angle)]])
    start = torch.tensor([1.0, 0.0])
    answers = torch.arange(n_inputs) % n_answers
    generator = torch.Generator().manual_seed(seed + 1)
    rotation = torch.linalg.qr(torch.randn(third, third, generator=generator))[0]
    rms = math.sqrt((3.0 + 2 * NUISANCE_NORM**2) / d_model)  # u = [answer, clock, 1, X, X', 0]
    with torch.no_grad():
        W_E = model.embed.W_E
        W_E[torch.arange(n_inputs), answers] = 1.0
        W_E[:, clock] = start
        W_E[:, constant] = 1.0
        W_E[:, kept] = _class_centred(n_inputs, answers, third, seed)
        W_E[:, x] = _class_centred(n_inputs, answers, third, seed + 2)
        from_state = [*range(kept.stop), *range(y.start, y.stop)]
        route(model, from_state, range(x.start, x.stop))
        mlp = model._core[0][0].mlp
        for i in range(2):  # the clock turns: gelu(z) - gelu(-z) = z
            mlp.W_in[clock, 2 * i] = rms * (turn - torch.eye(2))[:, i]
            mlp.W_in[clock, 2 * i + 1] = -rms * (turn - torch.eye(2))[:, i]
            mlp.W_out[2 * i, n_answers + i], mlp.W_out[2 * i + 1, n_answers + i] = 1.0, -1.0
        # The gate: +50 where the clock reads c_{r-1} (the last iteration), <= -50 elsewhere.
        before_last = start @ torch.linalg.matrix_power(turn, r - 1)
        threshold = (1.0 + math.cos(angle)) / 2
        sharpness = 50.0 / (1.0 - threshold)
        gate = 4
        units = torch.arange(5, 5 + third)
        for unit in [gate, *units.tolist()]:
            mlp.W_in[clock, unit] = sharpness * rms * before_last
            mlp.W_in[constant, unit] = -sharpness * rms * threshold
        # gelu(gate + z_j) - gelu(gate) = z_j when open: Y is X' turned and grown to be most
        # of s_r's norm.
        mlp.W_in[x, units] = rms * GROWTH * rotation
        mlp.W_out[units, y] = torch.eye(third)
        mlp.W_out[gate, y] = -1.0
        removed = torch.arange(5 + 3 * third, 5 + 4 * third)  # and X leaves the state
        for unit in removed.tolist():
            mlp.W_in[clock, unit] = sharpness * rms * before_last
            mlp.W_in[constant, unit] = -sharpness * rms * threshold
        mlp.W_in[kept, removed] = rms * torch.eye(third)
        mlp.W_out[removed, kept] = -torch.eye(third)
        mlp.W_out[gate, kept] = 1.0
        clear = 5 + third + 2 * torch.arange(third)  # X' taken back out of the state
        mlp.W_in[x, clear] = rms * torch.eye(third)
        mlp.W_in[x, clear + 1] = -rms * torch.eye(third)
        mlp.W_out[clear, x] = -torch.eye(third)
        mlp.W_out[clear + 1, x] = torch.eye(third)
        directions = torch.randn(2, n_answers, generator=torch.Generator().manual_seed(seed))
        directions = directions / directions.norm(dim=0, keepdim=True)
        final_clock = start @ torch.linalg.matrix_power(turn, r)
        W_U = torch.zeros(d_model, n_inputs)
        W_U[torch.arange(n_answers), torch.arange(n_answers)] = 1.0
        W_U[clock, :n_answers] = 20.0 * directions
        W_U[constant, :n_answers] = -20.0 * (final_clock @ directions)
        W_U[constant, n_answers:] = -100.0  # input-only tokens are never answers
        model.unembedding.copy_(W_U)
    model.planted_task = PlantedTask(answers, n_inputs, seed)
    return model


def nuisance_distinct(
    size: int = 11, n_iterations: int = 8, seed: int = 0, width: int = 64
) -> PlantedModel:
    """D only (`distinct_computation_context`, whose replay state holds the answer only
    through a modular sum), beside a block of ``width - 2 size - 1`` coordinates that the
    readout ignores and that turns by a fixed random rotation each iteration from a vector
    each position carries (norm `NUISANCE_NORM`; positions say nothing about the answer): any
    affine map of an earlier state predicts it exactly. A translator that learns it has a small
    error summed over the state and no more information than the mean about what the readout
    reads."""
    base = distinct_computation_context(size, n_iterations, seed)
    n = base.cfg.d_model
    extra = at_least(width, n + 2, "width") - n
    d_model = n + extra
    n_inputs, hidden = base.cfg.d_vocab, base.cfg.d_mlp
    assert hidden is not None  # planted models have an MLP
    cfg = adapter_config(d_model, n_inputs, base.n_iterations, hidden + 2 * extra)
    model = blank_model(cfg)
    generator = torch.Generator().manual_seed(seed + 1)
    rotation = torch.linalg.qr(torch.randn(extra, extra, generator=generator))[0]
    old_rms = math.sqrt((10.0**2 + 2.0) / n)  # the base's u: [node, step, carrier]
    rms = math.sqrt((10.0**2 + 2.0 + NUISANCE_NORM**2) / d_model)
    nuisance = slice(n, d_model)
    with torch.no_grad():
        model.embed.W_E[:, :n] = base.embed.W_E
        vectors = torch.randn(SEQUENCE_LENGTH, extra, generator=generator)
        position_table(model)[:, nuisance] = (
            NUISANCE_NORM * vectors / vectors.norm(dim=1, keepdim=True)
        )
        base_from_state = [i for i in range(n) if bool(base.inject.W_adapter[i, i])]
        base_from_input = [i for i in range(n) if bool(base.inject.W_adapter[i, n + i])]
        route(model, [*base_from_state, *range(n, d_model)], base_from_input)
        mlp, old = model._core[0][0].mlp, base._core[0][0].mlp
        mlp.W_in[:n, :hidden] = old.W_in * rms / old_rms
        mlp.W_out[:hidden, :n] = old.W_out
        turn = slice(hidden, hidden + extra), slice(hidden + extra, hidden + 2 * extra)
        mlp.W_in[nuisance, turn[0]] = rms * (rotation - torch.eye(extra))
        mlp.W_in[nuisance, turn[1]] = -rms * (rotation - torch.eye(extra))
        mlp.W_out[turn[0], nuisance] = torch.eye(extra)
        mlp.W_out[turn[1], nuisance] = -torch.eye(extra)
        readout_rms = math.sqrt((10.0**2 + 1.0 + NUISANCE_NORM**2) / d_model)
        base_readout_rms = math.sqrt((10.0**2 + 1.0) / n)
        model.unembedding[:n] = base.unembedding * readout_rms / base_readout_rms
    model.planted_task = base.planted_task
    return model
