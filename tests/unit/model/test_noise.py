"""The causal initial-state noise (dcp_lens.model.noise): each guarantee its docstring states
(a position's noise depends on the seed, the position and the tokens up to it only; a KV
cache's continuation draws what one forward draws), the hashes against Python's integers, and
the draws' distribution."""

from __future__ import annotations

import math

import torch

from dcp_lens.model.noise import (
    BASES,
    MODULUS,
    PrefixState,
    causal_noise,
    fmix32,
    prefix_hashes,
)

WIDTH = 16


def tokens(seed: int = 0, batch: int = 3, n: int = 12) -> torch.Tensor:
    return torch.randint(0, 500, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_prefix_hashes_are_the_polynomial_hashes_of_each_prefix():
    given = tokens(n=7)
    hashes, state = prefix_hashes(given)
    for row in range(given.shape[0]):
        for p in range(given.shape[1]):
            for j, base in enumerate(BASES):
                digits = [int(t) + 1 for t in given[row, : p + 1]]
                expected = sum(d * pow(base, p - i, MODULUS) for i, d in enumerate(digits))
                assert int(hashes[row, p, j]) == expected % MODULUS
    assert state.length == 7


def test_a_prefix_draws_the_noise_of_the_longer_forward_at_its_positions():
    given = tokens()
    whole, _ = causal_noise(given, given.shape[1], WIDTH, seed=3)
    prefix, _ = causal_noise(given[:, :5], 5, WIDTH, seed=3)
    assert torch.equal(prefix, whole[:, :5])
    # A different last token changes the noise at that position only.
    changed = given.clone()
    changed[:, -1] += 1
    other, _ = causal_noise(changed, given.shape[1], WIDTH, seed=3)
    assert torch.equal(other[:, :-1], whole[:, :-1])
    assert not torch.equal(other[:, -1], whole[:, -1])


def test_a_cache_continuing_its_prefix_state_draws_what_one_forward_draws():
    given = tokens()
    whole, after_whole = causal_noise(given, given.shape[1], WIDTH, seed=5)
    first, state = causal_noise(given[:, :4], 4, WIDTH, seed=5)
    assert isinstance(state, PrefixState)
    rest, after = causal_noise(given[:, 4:], given.shape[1] - 4, WIDTH, seed=5, state=state)
    assert torch.equal(torch.cat([first, rest], dim=1), whole)
    assert after is not None and after_whole is not None
    assert torch.equal(after.sums, after_whole.sums) and after.length == after_whole.length


def test_a_rows_noise_does_not_depend_on_its_batch():
    given = tokens(batch=4)
    together, _ = causal_noise(given, given.shape[1], WIDTH, seed=1)
    alone, _ = causal_noise(given[2:3], given.shape[1], WIDTH, seed=1)
    assert torch.equal(alone[0], together[2])
    reversed_rows, _ = causal_noise(given.flip(0), given.shape[1], WIDTH, seed=1)
    assert torch.equal(reversed_rows.flip(0), together)


def test_the_seed_moves_every_draw():
    given = tokens()
    one, _ = causal_noise(given, given.shape[1], WIDTH, seed=0)
    two, _ = causal_noise(given, given.shape[1], WIDTH, seed=1)
    assert not torch.isclose(one, two).any()


def test_without_tokens_every_row_draws_the_same_noise_of_seed_and_position():
    noise, state = causal_noise(None, 6, WIDTH, seed=2, batch=3)
    assert state is None and noise.shape == (3, 6, WIDTH)
    assert torch.equal(noise[0], noise[1]) and torch.equal(noise[1], noise[2])
    later, _ = causal_noise(None, 2, WIDTH, seed=2, state=PrefixState(torch.zeros(1, 2), 4))
    assert torch.equal(later[0], noise[0, 4:])


def test_the_draws_are_standard_normal_and_the_truncated_ones_within_three_sigma():
    given = tokens(batch=8, n=64)
    noise, _ = causal_noise(given, 64, 256, seed=0)
    # 131072 draws: the standard error of the mean is 0.003, of the std 0.002.
    assert abs(float(noise.mean())) < 0.015
    assert abs(float(noise.std()) - 1.0) < 0.01
    assert abs(float((noise.abs() > 1.96).double().mean()) - 0.05) < 0.005
    truncated, _ = causal_noise(given, 64, 256, seed=0, truncated=True)
    assert float(truncated.abs().max()) <= 3.0 + 1e-9
    assert float(truncated.abs().max()) > 2.9  # the tails are reached, not clipped early
    assert truncated.dtype == torch.float64


def test_fmix32_is_a_bijection_on_a_sample_and_stays_in_32_bits():
    inputs = torch.arange(0, 2**32, 2**32 // 4096, dtype=torch.long)
    mixed = fmix32(inputs)
    assert int(mixed.min()) >= 0 and int(mixed.max()) < 2**32
    assert len(torch.unique(mixed)) == len(inputs)
    assert int(fmix32(torch.tensor([0]))) == 0  # murmur3's finaliser fixes 0
    assert math.isclose(float((mixed & 1).double().mean()), 0.5, abs_tol=0.05)
