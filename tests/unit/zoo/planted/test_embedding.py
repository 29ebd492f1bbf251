"""Planted models embedded at real width keep their truth: the same logits at every depth,
under replay and under any affine combination of states, with most of the stream unread."""

from __future__ import annotations

import pytest
import torch

from dcp_lens.protocol.states import capture_states
from dcp_lens.utils.errors import ConfigError, ConfigTypeError
from dcp_lens.zoo import planted
from dcp_lens.zoo.planted.embedding import SilentAttention, embed

WIDTH = 96  # above every planted model's own width (at most 48), cheap to build and run
# Float64 throughout: what differs is rounding, amplified at most by the sharpest planted unit.
TOLERANCE = 1e-6


def _pair(name: str, width: int = WIDTH, seed: int = 0):
    original = planted.BUILDERS[name](seed=seed).double()
    return original, embed(original, width, seed=seed)


def _states(model, tokens):
    with torch.no_grad():
        return capture_states(model, tokens)


@pytest.mark.parametrize("name", planted.BRACKET_PLANTED)
def test_logits_equal_the_originals_at_every_k_under_replay_and_mixing(name):
    original, embedded = _pair(name)
    tokens = original.planted_task.evaluation(16).tokens
    (states, logits), (wide_states, wide_logits) = (
        _states(original, tokens),
        _states(embedded, tokens),
    )
    scale = float(logits.abs().max())
    r = original.n_iterations
    generator = torch.Generator().manual_seed(1)
    weights = torch.randn(r + 1, generator=generator, dtype=torch.float64)
    weights[-1] += 1.0 - weights.sum()  # an affine combination: coefficients sum to 1
    pairs = [(logits, wide_logits)]
    with torch.no_grad():
        for k in range(r + 1):
            pairs.append((original.readout(states[k]), embedded.readout(wide_states[k])))
        for k in range(1, r):  # replay(k): s_k + (r - k) (s_k - s_{k-1})
            replay = states[k] + (r - k) * (states[k] - states[k - 1])
            wide_replay = wide_states[k] + (r - k) * (wide_states[k] - wide_states[k - 1])
            pairs.append((original.readout(replay), embedded.readout(wide_replay)))
        mixed = torch.einsum("t,tbpd->bpd", weights, states)
        wide_mixed = torch.einsum("t,tbpd->bpd", weights, wide_states)
        pairs.append((original.readout(mixed), embedded.readout(wide_mixed)))
    for before, after in pairs:
        assert (before - after).abs().max() <= TOLERANCE * scale


@pytest.mark.parametrize("name", ["readout_shift_step", "distinct_computation", "block_count"])
def test_the_readout_reads_a_rotated_small_part_of_a_mostly_nuisance_stream(name):
    original, embedded = _pair(name, width=256)
    d = original.cfg.d_model
    read = embedded.unembedding  # [width, vocab]
    assert torch.linalg.matrix_rank(read) <= d
    # Not coordinate-aligned: no single coordinate carries a tenth of the readout's weight.
    rows = read.pow(2).sum(1)
    assert rows.max() < 0.1 * rows.sum()
    basis = torch.linalg.svd(read, full_matrices=False)[0][:, :d]  # [width, d]
    tokens = original.planted_task.evaluation(32).tokens
    states, _ = _states(embedded, tokens)
    inside = (states @ basis).pow(2).sum(-1)
    assert bool((inside < 0.2 * states.pow(2).sum(-1)).all())  # >= 80% of every state unread


def test_nuisance_depends_on_token_position_and_iteration():
    original, embedded = _pair("readout_shift_step", width=256)
    basis = torch.linalg.svd(embedded.unembedding.detach(), full_matrices=False)[0]
    basis = basis[:, : original.cfg.d_model]

    def unread(x):
        return x - (x @ basis) @ basis.T

    tokens = torch.tensor([[0, 0, 1, 1, 2, 2, 3, 3]])
    states, _ = _states(embedded, tokens)
    nuisance = unread(states[:, 0]).detach()  # [t, pos, width]
    size = float(nuisance.norm(dim=-1).mean())
    assert (nuisance[0, 0] - nuisance[0, 2]).norm() > 0.1 * size  # by token
    assert (nuisance[0, 0] - nuisance[0, 1]).norm() > 0.1 * size  # by position
    r = original.n_iterations
    assert (nuisance[r, 0] - nuisance[0, 0]).norm() > 0  # by iteration (the shadow)


def test_unread_content_the_first_k_iterations_cannot_predict():
    """On distinct computation with the input routed past the state, the best affine map from
    s_k to s_r leaves most of its error outside what the readout reads."""
    original, embedded = _pair("distinct_computation_context", width=128)
    tokens = original.planted_task.evaluation(256).tokens
    states, _ = _states(embedded, tokens)
    basis = torch.linalg.svd(embedded.unembedding, full_matrices=False)[0]
    basis = basis[:, : original.cfg.d_model]
    k, r = 2, original.n_iterations
    source = states[k].reshape(-1, states.shape[-1])
    target = states[r].reshape(-1, states.shape[-1])
    design = torch.cat([source, torch.ones(len(source), 1, dtype=source.dtype)], 1)
    solution = torch.linalg.lstsq(design, target).solution
    residual = target - design @ solution
    read_part = (residual @ basis).pow(2).sum()
    assert residual.pow(2).sum() > 3.0 * read_part  # most of the error is unread content
    change = target - source
    assert residual.pow(2).sum() > 0.1 * (change - change.mean(0)).pow(2).sum()


def test_truth_of_a_mixture_is_unchanged():
    original, embedded = _pair("mixture_shift_blocks")
    evaluation = original.planted_task.evaluation(64)
    for metric in ("accuracy", "cross_entropy"):
        before = planted.expected_shares(
            "mixture_shift_blocks", original, evaluation, metric, [2, 4]
        )
        after = planted.expected_shares(
            "mixture_shift_blocks", embedded, evaluation, metric, [2, 4]
        )
        for factor in before:
            assert after[factor] == pytest.approx(before[factor], abs=1e-9)


def test_the_embedded_model_is_cheap_at_width():
    original, embedded = _pair("distinct_computation_context", width=1024)
    block = embedded._core[0][0]
    assert isinstance(block.attn, SilentAttention)
    assert sum(p.numel() for p in embedded.parameters()) < 1024 * 1000  # no width^2 weights
    with embedded.iterations(original.n_iterations + 2):  # a longer view keeps attention silent
        assert all(isinstance(b.attn, SilentAttention) for b in embedded.blocks)
        embedded(original.planted_task.evaluation(2).tokens)


def test_load_planted_embeds_with_width():
    model = planted.load_planted("block_count", width=64, seed=1)
    assert model.cfg.d_model == 64 and model.embedding["seed"] == 1
    assert model.tokenizer is not None


def test_bad_widths_are_refused_with_the_reason():
    original = planted.BUILDERS["block_count_context"]()
    with pytest.raises(ConfigError, match="below the planted model's own d_model=4"):
        embed(original, 3)
    with pytest.raises(ConfigTypeError, match="width must be an int"):
        embed(original, True)
    with pytest.raises(ConfigError, match="static_scale"):
        embed(original, 64, static_scale=5.0)
    with pytest.raises(ConfigError, match="already embedded"):
        embed(embed(original, 64), 128)


def test_the_nuisance_makes_no_function_of_the_token_affine():
    """block_count's answer (an XOR of the token's features) is no affine function of s_0 as
    built; embedded, it must stay none (a code per token would be a lookup table)."""
    original, embedded = _pair("block_count", width=512)
    n = original.planted_task.n_inputs
    tokens = torch.arange(n)[:, None]  # every token, at position 0
    states, _ = _states(embedded, tokens)
    source = states[0, :, 0].detach()
    design = torch.cat([source, torch.ones(n, 1, dtype=source.dtype)], 1)
    target = 2.0 * (original.planted_task.answers == 0).double() - 1.0
    fitted = design @ torch.linalg.lstsq(design, target[:, None]).solution
    explained = 1.0 - (target - fitted[:, 0]).pow(2).sum() / (target - target.mean()).pow(2).sum()
    assert explained < 0.1
