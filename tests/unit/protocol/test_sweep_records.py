"""The sweep's accumulators: what a snapshot restores and what a merge over processes gives equal
what one uninterrupted process accumulates, bit for bit."""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch

from dcp_lens.protocol.sweep_records import (
    CELL_KEY,
    ExampleCellsAccumulator,
    MaximaAccumulator,
    NullControlAccumulator,
)
from dcp_lens.utils.snapshots import SnapshotFieldError


def _through_snapshot(state: object) -> object:
    """``state`` saved and loaded as `dcp_lens.utils.snapshots.Checkpoint` does."""
    buffer = io.BytesIO()
    torch.save({"done": 1, "state": state}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)["state"]


def test_example_cells_merge_in_batch_order_whoever_read_them() -> None:
    generator = torch.Generator().manual_seed(0)
    chunks = {b: [torch.randn(3, generator=generator) for _ in range(2)] for b in range(5)}
    one: ExampleCellsAccumulator[tuple[str, str, int]] = ExampleCellsAccumulator()
    ranks: list[ExampleCellsAccumulator[tuple[str, str, int]]] = [
        ExampleCellsAccumulator(),
        ExampleCellsAccumulator(),
    ]
    for batch, pieces in chunks.items():
        one.add(batch, {("loss", "truncate", 1): pieces})
        ranks[batch % 2].add(batch, {("loss", "truncate", 1): pieces})
    merged = ExampleCellsAccumulator.merged(ranks, torch.device("cpu"))
    expected = torch.cat([torch.cat(pieces) for pieces in chunks.values()]).double()
    assert torch.equal(merged.vectors()[("loss", "truncate", 1)], expected)
    assert torch.equal(one.vectors()[("loss", "truncate", 1)], expected)
    restored: ExampleCellsAccumulator[tuple[str, str, int]] = ExampleCellsAccumulator()
    restored.restore(_through_snapshot(one.state()))
    assert torch.equal(restored.vectors()[("loss", "truncate", 1)], expected)


def test_maxima_and_the_null_control_keep_a_nan_over_a_merge() -> None:
    left, right = NullControlAccumulator(["truncate"]), NullControlAccumulator(["truncate"])
    left.differences.add({"truncate": 0.5})
    right.differences.add({"truncate": math.nan})
    merged = NullControlAccumulator.merged([left, right])
    assert math.isnan(merged.differences.values["truncate"])
    maxima: MaximaAccumulator[int] = MaximaAccumulator()
    maxima.add({3: 0.25})
    maxima.add({3: 0.125, 4: 1.0})
    assert maxima.values == {3: 0.25, 4: 1.0}
    restored: MaximaAccumulator[int] = MaximaAccumulator()
    restored.restore(_through_snapshot(maxima.state()), "maxima", "count")
    assert restored.values == maxima.values


@pytest.mark.parametrize("value", ["0.5", True])
def test_the_null_control_refuses_a_maximum_that_is_no_number(value):
    null = NullControlAccumulator(["truncate"])
    null.differences.add({"truncate": 0.25})
    state: Any = _through_snapshot(null.state())
    restored = NullControlAccumulator(["truncate"])
    restored.restore(state)
    assert restored.state() == null.state()
    state["halves_difference"] = value
    with pytest.raises(SnapshotFieldError, match=r"field null\.halves_difference must be a number"):
        NullControlAccumulator(["truncate"]).restore(state)
    state["halves_difference"] = 0.0
    state["differences"]["truncate"] = value
    with pytest.raises(SnapshotFieldError, match=r"field null\.differences\['truncate'\] must be"):
        NullControlAccumulator(["truncate"]).restore(state)


@pytest.mark.parametrize("k", ["1", True, 1.0])
def test_cells_refuse_a_k_that_is_no_whole_number(k):
    cells: ExampleCellsAccumulator[tuple[str, str, int]] = ExampleCellsAccumulator()
    cells.add(0, {("loss", "truncate", 1): [torch.ones(2)]})
    state: Any = _through_snapshot(cells.state())
    restored: ExampleCellsAccumulator[tuple[str, str, int]] = ExampleCellsAccumulator()
    restored.restore(state, "values", CELL_KEY)
    assert torch.equal(
        restored.vectors()[("loss", "truncate", 1)], cells.vectors()[("loss", "truncate", 1)]
    )
    state[0] = (("loss", "truncate", k), state[0][1])
    with pytest.raises(SnapshotFieldError, match=r"field values\[0\] key must be a whole number"):
        restored.restore(state, "values", CELL_KEY)
    state[0] = (("loss", "truncate", 1), {"0": torch.ones(2)})
    with pytest.raises(SnapshotFieldError, match=r"field values\[0\] batch must be a whole number"):
        restored.restore(state, "values", CELL_KEY)
