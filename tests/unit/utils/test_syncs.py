"""The synchronisation counter and the scalars read together (dcp_lens.utils.syncs)."""

from __future__ import annotations

import math

import torch

from dcp_lens.utils.syncs import CONVERSIONS, DeferredScalars, counting_syncs


def test_every_read_of_a_value_in_a_loop_is_counted() -> None:
    values = torch.arange(10.0)
    with counting_syncs() as count:
        for i in range(10):
            values[i].item()
        float(values.sum())
        bool(values.any())
        values.tolist()
        values.cpu()
    assert count.total == 14
    assert sum(count.sites.values()) == 14


def test_work_that_stays_on_the_device_is_not_counted() -> None:
    values = torch.randn(64, 8)
    with counting_syncs() as count:
        total = (values @ values.T).abs().max()
        values.to(torch.float64)
        torch.maximum(total, total)
    assert count.total == 0


def test_the_tensor_methods_come_back_after_the_block() -> None:
    before = {name: getattr(torch.Tensor, name) for name in (*CONVERSIONS, "to")}
    with counting_syncs():
        pass
    after = {name: getattr(torch.Tensor, name) for name in (*CONVERSIONS, "to")}
    assert before == after
    with counting_syncs() as count:
        pass
    torch.ones(1).item()
    assert count.total == 0


def test_deferred_scalars_are_read_in_one_synchronisation() -> None:
    deferred = DeferredScalars()
    with counting_syncs() as count:
        for k in range(9):
            deferred.maximum(("replay", k), torch.tensor(float(k)))
            deferred.maximum(("replay", k), torch.tensor(float(k) / 2))
            deferred.add("accuracy", torch.tensor(0.5, dtype=torch.float32))
        maxima, sums = deferred.read()
    assert count.total == 1
    assert maxima == {("replay", k): float(k) for k in range(9)}
    assert sums == {"accuracy": 4.5}
    assert deferred.read() == ({}, {})


def test_a_deferred_maximum_stays_nan_once_nan() -> None:
    deferred = DeferredScalars()
    deferred.maximum("null", torch.tensor(1.0))
    deferred.maximum("null", torch.tensor(math.nan))
    deferred.maximum("null", torch.tensor(2.0))
    maxima, _ = deferred.read()
    assert math.isnan(maxima["null"])
