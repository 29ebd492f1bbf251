"""`dcp_lens.model.padding` by hand: positions counted from each row's first real token, which
keys a query may read, the masked loss, and the noise keyed by a row's own real prefix."""

from __future__ import annotations

import pytest
import torch

from dcp_lens.model.noise import causal_noise
from dcp_lens.model.padding import (
    PaddingError,
    attention_allowed,
    padded_outputs,
    padding_for,
)

MASK = torch.tensor([[False, False, True, True], [True, False, True, True]])


def test_positions_count_real_tokens_from_each_rows_first() -> None:
    padding = padding_for(MASK, (2, 4), torch.device("cpu"))
    assert padding is not None
    assert padding.positions.tolist() == [[0, 0, 0, 1], [0, 0, 1, 2]]
    # Two more tokens after the cached four: positions go on from each row's count.
    later = padding_for(None, (2, 2), torch.device("cpu"), past_mask=MASK, past=4)
    assert later is not None
    assert later.positions.tolist() == [[2, 3], [3, 4]]
    assert later.query_mask.all() and torch.equal(later.key_mask[:, :4], MASK)
    assert padding_for(torch.ones(2, 4), (2, 4), torch.device("cpu")) is None  # nothing to mask


def test_a_query_reads_real_keys_up_to_itself_and_itself() -> None:
    allowed = attention_allowed(MASK, n_query=4, past=0)[:, 0]
    expected_row0 = [
        [True, False, False, False],  # a pad query reads only itself
        [False, True, False, False],
        [False, False, True, False],
        [False, False, True, True],
    ]
    assert allowed[0].tolist() == expected_row0
    assert allowed[1, 3].tolist() == [True, False, True, True]
    # One new query after three cached keys: it reads the real ones and itself.
    assert attention_allowed(MASK, n_query=1, past=3)[1, 0].tolist() == [[True, False, True, True]]


def test_the_loss_counts_a_real_token_predicted_from_a_real_one() -> None:
    logits = torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([[0, 0, 3, 1], [2, 0, 4, 4]])
    losses = padded_outputs(logits, tokens, MASK, "loss", loss_per_token=True)
    by_hand = -logits.log_softmax(-1)[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    scored = torch.tensor([[False, False, True], [False, False, True]])
    torch.testing.assert_close(losses[scored], by_hand[scored])
    assert not losses[~scored].any()
    mean = padded_outputs(logits, tokens, MASK, "loss", loss_per_token=False)
    torch.testing.assert_close(mean, by_hand[scored].mean())
    zeroed = padded_outputs(logits, tokens, MASK, "logits", loss_per_token=False)
    assert not zeroed[~MASK].any() and torch.equal(zeroed[MASK], logits[MASK])


@pytest.mark.parametrize("truncated", [False, True])
def test_a_rows_noise_is_that_of_its_real_tokens_alone(truncated: bool) -> None:
    tokens = torch.tensor([[9, 9, 5, 7, 2], [5, 9, 7, 2, 9]])
    mask = torch.tensor([[False, False, True, True, True], [True, False, True, True, False]])
    padding = padding_for(mask, (2, 5), torch.device("cpu"))
    assert padding is not None
    noise, _ = causal_noise(tokens, 5, 8, 3, truncated, mask=mask, positions=padding.positions)
    alone, _ = causal_noise(torch.tensor([[5, 7, 2]]), 3, 8, 3, truncated)
    torch.testing.assert_close(noise[0, mask[0]], alone[0], rtol=0, atol=0)
    torch.testing.assert_close(noise[1, mask[1]], alone[0], rtol=0, atol=0)
    # In two chunks, the second continuing the first's prefix state: the same draws.
    first = padding_for(mask[:, :3], (2, 3), torch.device("cpu"))
    assert first is not None
    head, state = causal_noise(
        tokens[:, :3], 3, 8, 3, truncated, mask=mask[:, :3], positions=first.positions
    )
    second = padding_for(mask[:, 3:], (2, 2), torch.device("cpu"), past_mask=mask[:, :3], past=3)
    assert second is not None
    tail, _ = causal_noise(
        tokens[:, 3:], 2, 8, 3, truncated, state, mask=mask[:, 3:], positions=second.positions
    )
    torch.testing.assert_close(torch.cat((head, tail), dim=1), noise, rtol=0, atol=0)


def test_a_row_with_no_real_token_is_refused() -> None:
    with pytest.raises(PaddingError, match=r"rows \[1\]"):
        padding_for(torch.tensor([[True, False], [False, False]]), (2, 2), torch.device("cpu"))
