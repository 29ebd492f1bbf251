"""The paired translators' held-out gate: a least-squares translator that predicts no held-out
full-depth state better than their mean is replaced by the mean; one with information is kept;
an under-determined fit is never tested."""

from __future__ import annotations

import torch

from dcp_lens.protocol.fit import (
    GATE_FOLDS,
    GATE_POINTS_PER_PARAMETER,
    _gated,
    _least_squares_left_out,
)
from dcp_lens.protocol.translator import MeanTranslator


def _gate(source: torch.Tensor, target: torch.Tensor):
    group = torch.arange(source.shape[0]) % GATE_FOLDS
    whole, refits = _least_squares_left_out(source, target, group, GATE_FOLDS)
    return whole, _gated(source, target, group, whole, refits)


def test_a_translator_without_information_becomes_the_mean() -> None:
    generator = torch.Generator().manual_seed(0)
    n, d = 4000, 6
    # One-hot sources, targets drawn independently of them: no map of the source predicts.
    source = torch.nn.functional.one_hot(torch.randint(0, d, (n,), generator=generator), d).float()
    target = torch.nn.functional.one_hot(torch.randint(0, d, (n,), generator=generator), d).float()
    whole, (gated, refits) = _gate(source, target)
    assert not isinstance(whole, MeanTranslator)
    assert isinstance(gated, MeanTranslator)
    assert all(refit is gated for refit in refits)  # not refitted per fold
    moved = gated(source[:5])
    assert torch.allclose(moved, target.mean(0).expand(5, d), atol=1e-6)


def test_a_translator_with_information_is_kept() -> None:
    generator = torch.Generator().manual_seed(1)
    n, d = 4000, 6
    source = torch.randn(n, d, generator=generator)
    turn = torch.linalg.qr(torch.randn(d, d, generator=generator))[0]
    target = source @ turn + 0.5 + 0.3 * torch.randn(n, d, generator=generator)
    whole, (gated, refits) = _gate(source, target)
    assert gated is whole and not isinstance(gated, MeanTranslator)
    assert len(refits) == GATE_FOLDS and all(refit is not None for refit in refits)


def test_an_under_determined_fit_is_not_tested() -> None:
    generator = torch.Generator().manual_seed(2)
    d = 6
    n = GATE_POINTS_PER_PARAMETER * (d + 1) - 1  # one position short of the test
    source = torch.nn.functional.one_hot(torch.randint(0, d, (n,), generator=generator), d).float()
    target = torch.nn.functional.one_hot(torch.randint(0, d, (n,), generator=generator), d).float()
    whole, (gated, _) = _gate(source, target)
    assert gated is whole
