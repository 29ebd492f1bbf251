"""The jackknife's evaluation examples: a fixed share, capped at a number of tokens so that its
readouts cost the same in a run of any size; the conditions the sweep reads at each k."""

from __future__ import annotations

import torch

from dcp_lens.protocol import sweep
from dcp_lens.protocol.calibration.affine import AffineCalibration, fit_calibration
from dcp_lens.protocol.conditions import Calibrate, Full, Replay, Shift, Truncate
from dcp_lens.protocol.fit import FittedMaps
from dcp_lens.protocol.maps import FittedMap
from dcp_lens.protocol.readout import needed_readouts
from dcp_lens.protocol.sweep import (
    CONTROL_TOKENS,
    JACKKNIFE_EVALUATION_STRIDE,
    JACKKNIFE_TOKENS,
    control_examples,
    jackknife_examples,
    sweep_conditions,
)
from dcp_lens.protocol.translator import AffineTranslator


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


def test_the_controls_subsample_holds_the_jackknifes_examples_then_the_smallest_keys():
    keys = _keys(512, seed=4)
    seq_len = 1024  # Huginn-0125's run: 64 of its 512 sequences
    jackknifed = jackknife_examples(keys, seq_len)
    chosen = control_examples(keys, seq_len, jackknifed, CONTROL_TOKENS)
    assert int(chosen.sum()) == CONTROL_TOKENS // seq_len == 64
    assert bool((jackknifed <= chosen).all())  # the jackknife reads inside it, paired
    rest = chosen & ~jackknifed
    assert float(keys[rest].max()) < float(keys[~chosen].min())
    order = torch.randperm(512, generator=torch.Generator().manual_seed(5))
    assert torch.equal(
        control_examples(keys[order], seq_len, jackknifed[order], 65536), chosen[order]
    )
    # Every example where the cap is off (0) or holds them all: a planted model's 512 x 8.
    assert bool(control_examples(keys, seq_len, jackknifed, 0).all())
    assert bool(control_examples(keys, 8, jackknife_examples(keys, 8), CONTROL_TOKENS).all())


def _fitted_maps(r: int, grid: tuple[int, ...], seed: int) -> FittedMaps:
    """Maps and translators from every source the sweep asks for, each its own object."""
    generator = torch.Generator().manual_seed(seed)
    sources = {c.at_depth(r).label for k in grid for c in (Truncate(k), Replay(k))}

    def fitted() -> AffineCalibration:
        return fit_calibration(torch.randn(64, 4, generator=generator), torch.randn(64, 4))

    maps: dict[str, FittedMap | None] = {label: fitted() for label in sources}
    translators = {label: AffineTranslator(4) for label in sources - {"full"}}
    return FittedMaps(maps, None, None, "full", r, translators)


def test_at_r_what_reads_full_depth_through_its_own_map_is_full_depth_and_not_read_out():
    r, grid = 4, (1, 2, 4)
    maps = _fitted_maps(r, grid, 0)
    at_r = sweep_conditions(r, maps)
    for name in ("truncate", "replay", "calibrate_truncate", "calibrate_replay", "shift"):
        assert at_r[name].at_depth(r) == Full(), name
    assert needed_readouts(r, at_r) == []  # nothing left to read at r (the base rate aside)
    below = sweep_conditions(2, maps)
    assert isinstance(below["calibrate_truncate"], Calibrate)
    assert isinstance(below["shift"], Shift)  # below r the map is another source's
    assert len(needed_readouts(r, below)) == 7
    # A left-out group's map of full depth onto itself is not read again either.
    left_out = _fitted_maps(r, grid, 1)
    moved = {n: c for n, c in sweep_conditions(r, left_out).items() if c != at_r[n]}
    assert moved == {}
    moved = {n: c for n, c in sweep_conditions(2, left_out).items() if c != below[n]}
    assert sorted(moved) == sorted(
        [
            "calibrate_truncate",
            "calibrate_replay",
            "shift",
            "translate_truncate",
            "translate_replay",
        ]
    )
