"""The jackknife's evaluation examples: a fixed share, capped at a number of tokens so that its
readouts cost the same in a run of any size."""

from __future__ import annotations

import torch

from dcp_lens.protocol import sweep
from dcp_lens.protocol.sweep import (
    JACKKNIFE_EVALUATION_STRIDE,
    JACKKNIFE_TOKENS,
    jackknife_examples,
)


def _keys(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 2**60, (n,), generator=torch.Generator().manual_seed(seed))


def test_below_the_cap_the_jackknife_reads_every_example_of_its_stride():
    keys = _keys(512)
    chosen = jackknife_examples(keys, 8)  # the planted models' length: 512 x 8 tokens
    stride = keys % JACKKNIFE_EVALUATION_STRIDE == 0
    assert int(stride.sum()) * 8 <= JACKKNIFE_TOKENS
    assert torch.equal(chosen, stride)


def test_past_the_cap_it_reads_the_smallest_keys_of_its_stride_up_to_the_tokens():
    keys = _keys(512, seed=1)
    seq_len = 1024  # Huginn-0125's run: 8 examples of 1024 tokens
    chosen = jackknife_examples(keys, seq_len)
    stride = keys % JACKKNIFE_EVALUATION_STRIDE == 0
    assert int(chosen.sum()) == JACKKNIFE_TOKENS // seq_len == 8
    assert bool((chosen <= stride).all())  # a subset of the stride's examples
    assert float(keys[chosen].max()) < float(keys[stride & ~chosen].min())
    # The same examples in any order and inside a larger set: the cost does not grow with it.
    order = torch.randperm(512, generator=torch.Generator().manual_seed(2))
    assert torch.equal(jackknife_examples(keys[order], seq_len), chosen[order])
    larger = torch.cat([keys, _keys(2048, seed=3)])
    assert int(jackknife_examples(larger, seq_len).sum()) == 8


def test_at_least_one_example_and_the_cap_is_read_at_call_time(monkeypatch):
    keys = torch.arange(0, 200, 10)
    assert int(jackknife_examples(keys, 10 * JACKKNIFE_TOKENS).sum()) == 1
    monkeypatch.setattr(sweep, "JACKKNIFE_TOKENS", 30)
    assert jackknife_examples(keys, 10).nonzero().squeeze(1).tolist() == [0, 1, 2]
    assert not jackknife_examples(keys + 1, 10).any()  # no key of the stride: none read
