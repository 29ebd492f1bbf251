"""The planted models for the S bracket (docs/bracket.md) are what their docstrings claim."""

from __future__ import annotations

import pytest
import torch

from dcp_lens.protocol.conditions import Replay
from dcp_lens.protocol.states import capture_states
from dcp_lens.zoo import planted


def every_token(model: planted.PlantedModel) -> torch.Tensor:
    """[n_inputs, 1]: each input token once, as its own sequence."""
    return torch.arange(model.planted_task.n_inputs)[:, None]


def test_context_d_leaves_no_trace_of_the_answer_in_the_truncated_state():
    model = planted.distinct_computation_context()
    tokens = every_token(model)
    answers = model.planted_task.answers
    n = 11
    with torch.no_grad():
        states, logits = capture_states(model, tokens)
    assert bool((logits[:, 0].argmax(-1) == answers).all())
    for k in range(1, model.n_iterations):
        node = states[k, :, 0, :n].argmax(-1)
        # The step is cleared from the state: s_k is [node one-hot, 0, carrier].
        assert float(states[k, :, 0, n : 2 * n].abs().max()) < 1e-4
        # Every (node_k, answer) pair occurs exactly once: no map of s_k beats chance.
        pairs = torch.bincount(node * n + answers, minlength=n * n)
        assert bool((pairs == 1).all()), k


def test_a_skewed_prior_moves_full_depths_marginal_but_not_truncations():
    model = planted.distinct_computation_skewed()
    tokens = every_token(model)
    with torch.no_grad():
        states, logits = capture_states(model, tokens)
    answers = logits[:, 0].argmax(-1)
    assert bool((answers == model.planted_task.answers).all())
    assert float((answers == 0).double().mean()) > 0.45
    for k in (1, 4, 7):
        nodes = states[k, :, 0, :11].argmax(-1)
        assert int(torch.bincount(nodes, minlength=11).max()) <= 2 * len(tokens) // 11


def test_context_b_is_repaired_by_replay_and_keeps_the_features_out_of_the_state():
    model = planted.block_count_context()
    tokens = every_token(model)
    with torch.no_grad():
        states, logits = capture_states(model, tokens)
        for k in range(2, model.n_iterations):
            replayed = model.readout(Replay(k).readout_input(states))
            assert float((replayed - logits).abs().max()) < 0.05 * float(logits.abs().max())
            assert float(states[k, :, 0, 1:3].abs().max()) < 0.01
    truncated = model.readout(states[1])
    full_correct = logits.argmax(-1) == model.planted_task.answers[tokens]
    truncated_correct = truncated.argmax(-1) == model.planted_task.answers[tokens]
    assert float(full_correct.double().mean()) > float(truncated_correct.double().mean()) + 0.2


def test_a_frame_flip_keeps_the_set_of_states_and_breaks_the_readout_at_odd_distance():
    model = planted.frame_flip()
    tokens = every_token(model)
    r = model.n_iterations
    with torch.no_grad():
        states, logits = capture_states(model, tokens)
    reference = {tuple(row.round().tolist()) for row in states[r, :, 0]}
    for k in range(1, r):
        assert {tuple(row.round().tolist()) for row in states[k, :, 0]} == reference
        correct = model.readout(states[k]).argmax(-1)[:, 0] == model.planted_task.answers
        assert bool(correct.all()) == ((r - k) % 2 == 0), k


def test_a_smooth_readout_walks_replay_between_valid_answers():
    model = planted.distinct_computation_smooth()
    tokens = every_token(model)
    with torch.no_grad():
        states, logits = capture_states(model, tokens)
        full = logits.argmax(-1)
        for k in range(1, 6):
            truncated = model.readout(states[k]).argmax(-1)
            replayed = model.readout(Replay(k).readout_input(states)).argmax(-1)
            assert bool(((replayed != truncated) & (replayed != full)).all()), k
    # The one-hot readout of the same model does not walk (replay reads the node it has).
    plain = planted.distinct_computation()
    with torch.no_grad():
        states, _ = capture_states(plain, tokens)
        for k in range(1, 6):
            same = plain.readout(Replay(k).readout_input(states)).argmax(-1)
            assert bool((same == plain.readout(states[k]).argmax(-1)).all())


def test_the_three_way_mixture_knows_its_three_factors():
    model = planted.mixture_three_way()
    evaluation = model.planted_task.evaluation(64)
    shares = planted.expected_shares(
        "mixture_three_way", model, evaluation, "accuracy", range(1, 8)
    )
    assert set(model.planted_task.factors or ()) == {"S", "B", "D"}
    assert sum(shares.values()) == pytest.approx(1.0)
    assert all(share > 0.05 for share in shares.values()), shares


def test_every_bracket_model_has_its_truth_and_identifiability():
    for name in planted.BRACKET_PLANTED:
        assert name in planted.EXPECTED_FACTOR and name in planted.IDENTIFIABLE
    assert set(planted.PLANTED) < set(planted.BRACKET_PLANTED)
