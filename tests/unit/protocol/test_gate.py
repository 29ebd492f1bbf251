"""The paired translators' held-out gate (`dcp_lens.protocol.gate`): every fold's refit from one
eigen-decomposition equals the direct fit without the fold; a translator is judged by the
readout's error, not by the error of coordinates the readout does not read; one without
information becomes the mean; a test that cannot be made keeps the translator."""

from __future__ import annotations

import math

import torch

from dcp_lens.protocol import fit
from dcp_lens.protocol.gate import (
    KEPT,
    REPLACED,
    UNTESTABLE,
    GateRecord,
    ReadoutGeometry,
    _RidgePath,
    judge,
    ridge_scale,
)
from dcp_lens.protocol.translator import MeanTranslator

FOLDS = 10


def _reading(d: int, read: int, vocab: int = 5, seed: int = 0):
    """A readout that normalises the whole state (RMS) and unembeds only its first ``read``
    coordinates."""
    unembed = torch.zeros(d, vocab)
    unembed[:read] = torch.randn(read, vocab, generator=torch.Generator().manual_seed(seed))

    def readout(states: torch.Tensor) -> torch.Tensor:
        scale = states.pow(2).mean(-1, keepdim=True).add(1e-12).sqrt()
        return (states / scale) @ unembed

    return readout


def _held_out_state_error(source, target, group) -> tuple[float, float]:
    """The old gate's numbers: held-out squared error over every coordinate, refits at a small
    ridge and the other folds' mean."""
    fitted = mean = 0.0
    for g in range(FOLDS):
        held = group == g
        refit = fit._least_squares(source[~held], target[~held], 1e-4 * ridge_scale(source))
        assert refit is not None
        fitted += float(((refit(source[held]) - target[held]) ** 2).sum())
        mean += float(((target[~held].mean(0) - target[held]) ** 2).sum())
    return fitted, mean


def test_every_held_out_refit_equals_the_direct_fit_without_its_fold() -> None:
    generator = torch.Generator().manual_seed(0)
    n, d = 120, 30  # few positions per parameter: the ridge matters
    source = torch.randn(n, d, generator=generator, dtype=torch.float64) * 2 + 1
    target = source @ torch.randn(d, d, generator=generator, dtype=torch.float64)
    target = target + torch.randn(n, d, generator=generator, dtype=torch.float64)
    path = _RidgePath(source, target)
    rows = torch.arange(7, 19)
    keep = torch.ones(n, dtype=torch.bool)
    keep[rows] = False
    for ridge in (1e-3, 1.0, 50.0):
        direct = fit._least_squares(source[keep], target[keep], ridge)
        assert direct is not None
        want = direct(source[rows].float()).double()
        got = path.held_out(rows, ridge)
        assert torch.allclose(got, want, rtol=1e-3, atol=1e-3 * float(want.abs().max()))


def test_a_translator_without_information_becomes_the_mean() -> None:
    generator = torch.Generator().manual_seed(1)
    n, d = 2000, 6
    source = torch.nn.functional.one_hot(torch.randint(0, d, (n,), generator=generator), d).float()
    target = torch.nn.functional.one_hot(torch.randint(0, d, (n,), generator=generator), d).float()
    group = torch.arange(n) % FOLDS
    record = judge(source, target, group, FOLDS, _reading(d, d))
    assert record.judged == REPLACED and record.folds == FOLDS
    translator, refits = fit._gated_fit(source, target, group, FOLDS, record)
    assert isinstance(translator, MeanTranslator) and all(r is translator for r in refits)
    assert torch.allclose(translator(source[:3]), target.mean(0).expand(3, d), atol=1e-6)


def test_unpredictable_content_the_readout_ignores_keeps_the_translator() -> None:
    """The readout reads 4 of 120 coordinates, which an affine map of the source gives exactly;
    the other 116 hold noise no map predicts, and there are 3 positions per parameter. The old
    gate's summed state error prefers the mean; the readout's error keeps the translator."""
    generator = torch.Generator().manual_seed(2)
    n, d, read = 360, 120, 4
    source = torch.randn(n, d, generator=generator)
    target = torch.randn(n, d, generator=generator)  # unpredictable
    shift = torch.randn(d, read, generator=generator)
    target[:, :read] = source @ shift * 0.3 + 1.0  # an affine change of frame of the source
    group = torch.arange(n) % FOLDS
    fitted, mean = _held_out_state_error(source, target, group)
    assert fitted > mean  # the bug: judged on every coordinate, it would be replaced
    record = judge(source, target, group, FOLDS, _reading(d, read))
    assert record.judged == KEPT
    assert record.translator_error < 0.5 * record.mean_error


def test_a_translator_worse_on_the_read_coordinates_is_replaced() -> None:
    """Easy coordinates (copies of the source) make the summed state error small, but on the
    coordinates the readout reads the source carries nothing: the translator gives way."""
    generator = torch.Generator().manual_seed(3)
    n, d, read = 1000, 40, 3
    source = torch.randn(n, d, generator=generator) * 3.0
    source[:, read:] += 10.0  # streams carry a large mean on what the readout does not read
    target = source.clone()  # easy: the identity predicts these
    target[:, :read] = torch.randn(n, read, generator=generator)  # unpredictable, read
    group = torch.arange(n) % FOLDS
    fitted, mean = _held_out_state_error(source, target, group)
    assert fitted < mean  # the old gate kept it
    record = judge(source, target, group, FOLDS, _reading(d, read))
    assert record.judged == REPLACED


def test_one_fold_is_untestable_and_keeps_the_translator() -> None:
    source = torch.randn(50, 4)
    record = judge(source, source, torch.zeros(50, dtype=torch.long), FOLDS, _reading(4, 4))
    assert record.judged == UNTESTABLE
    translator, _ = fit._gated_fit(source, source, torch.zeros(50, dtype=torch.long), 0, record)
    assert translator is not None and not isinstance(translator, MeanTranslator)


def test_readout_error_weighs_only_what_the_readout_reads() -> None:
    readout = _reading(6, 2)
    at = torch.tensor([1.0, -1.0, 0.5, 0.5, 0.0, 2.0])
    unread = torch.zeros(3, 6)
    unread[:, 2:] = torch.randn(3, 4)
    tail = at[2:] / at[2:].norm()
    unread[:, 2:] -= (unread[:, 2:] @ tail)[:, None] * tail  # and no change of the state's scale
    assert float(ReadoutGeometry(readout, at)(unread).sum()) < 1e-9
    read = torch.zeros(3, 6)
    read[:, 0] = 1.0
    assert bool((ReadoutGeometry(readout, at)(read) > 1e-3).all())


def test_the_record_round_trips() -> None:
    record = GateRecord(KEPT, 1e-3, 0.5, 2.0, 10, 2048, "why")
    assert GateRecord.from_record(record.record()) == record
    missing = GateRecord.from_record(
        GateRecord(UNTESTABLE, 1e-4, math.nan, math.nan, 0, 9, "no folds").record()
    )
    assert missing.judged == UNTESTABLE and math.isnan(missing.mean_error)


def test_a_readout_without_forward_mode_gets_the_same_geometry(monkeypatch) -> None:
    """Where forward mode is not implemented (a fused attention kernel), a central difference
    stands in for it and gives the same quadratic form."""
    readout = _reading(6, 3)
    at = torch.tensor([1.0, -1.0, 0.5, 0.5, 0.3, 2.0])
    exact = ReadoutGeometry(readout, at).metric

    def unsupported(*args, **kwargs):
        raise NotImplementedError("forward AD")

    monkeypatch.setattr(torch.func, "jvp", unsupported)
    stepped = ReadoutGeometry(readout, at).metric
    assert torch.allclose(stepped, exact, rtol=1e-2, atol=1e-3 * float(exact.abs().max()))


def test_a_narrow_readout_is_judged_in_the_coordinates_it_reads() -> None:
    """A vocabulary narrower than the stream (8 logits of 64 coordinates): the geometry keeps
    B = (P C J)^T [64, 8], whose B B^T is J^T P C J from the readout's explicit Jacobian, and
    the gate judges in those 8 coordinates with the numbers of the 64-wide quadratic form."""
    generator = torch.Generator().manual_seed(6)
    n, d, read, vocab = 400, 64, 6, 8
    readout = _reading(d, read, vocab)
    source = torch.randn(n, d, generator=generator)
    target = torch.randn(n, d, generator=generator)
    target[:, :read] = source[:, :read] @ torch.randn(read, read, generator=generator) + 1.0
    at = target.double().mean(0).float()
    geometry = ReadoutGeometry(readout, at)
    assert geometry.factor is not None and geometry.factor.shape == (d, vocab)
    jacobian = torch.autograd.functional.jacobian(lambda x: readout(x[None])[0], at).double()
    logits = readout(at[None])[0].double()
    direction = (logits - logits.mean()) / (logits - logits.mean()).norm()
    identity = torch.eye(vocab, dtype=torch.float64)
    projection = (identity - torch.outer(direction, direction)) @ (identity - 1.0 / vocab)
    want = jacobian.T @ projection @ jacobian
    assert torch.allclose(geometry.metric, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
    wide = ReadoutGeometry.__new__(ReadoutGeometry)
    wide.factor, wide.metric = None, geometry.metric
    group = torch.arange(n) % FOLDS
    narrow_record = judge(source, target, group, FOLDS, geometry)
    wide_record = judge(source, target, group, FOLDS, wide)
    assert (narrow_record.judged, narrow_record.ridge) == (wide_record.judged, wide_record.ridge)
    for key in ("translator_error", "mean_error"):
        got, expected = getattr(narrow_record, key), getattr(wide_record, key)
        assert abs(got - expected) <= 1e-9 * abs(expected), (key, got, expected)
