"""The sweep's accumulators: what a snapshot restores and what a merge over processes gives equal
what one uninterrupted process accumulates, bit for bit."""

from __future__ import annotations

import io
import math

import torch

from dcp_lens.protocol.sweep_records import ExampleCells, Maxima, NullControl


def _through_snapshot(state: object) -> object:
    """``state`` saved and loaded as `dcp_lens.utils.snapshots.Checkpoint` does."""
    buffer = io.BytesIO()
    torch.save({"done": 1, "state": state}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)["state"]


def test_example_cells_merge_in_batch_order_whoever_read_them() -> None:
    generator = torch.Generator().manual_seed(0)
    chunks = {b: [torch.randn(3, generator=generator) for _ in range(2)] for b in range(5)}
    one: ExampleCells[tuple[str, str, int]] = ExampleCells()
    ranks: list[ExampleCells[tuple[str, str, int]]] = [ExampleCells(), ExampleCells()]
    for batch, pieces in chunks.items():
        one.add(batch, {("loss", "truncate", 1): pieces})
        ranks[batch % 2].add(batch, {("loss", "truncate", 1): pieces})
    merged = ExampleCells.merged(ranks, torch.device("cpu"))
    expected = torch.cat([torch.cat(pieces) for pieces in chunks.values()]).double()
    assert torch.equal(merged.vectors()[("loss", "truncate", 1)], expected)
    assert torch.equal(one.vectors()[("loss", "truncate", 1)], expected)
    restored: ExampleCells[tuple[str, str, int]] = ExampleCells()
    restored.restore(_through_snapshot(one.state()))  # type: ignore[arg-type]
    assert torch.equal(restored.vectors()[("loss", "truncate", 1)], expected)


def test_maxima_and_the_null_control_keep_a_nan_over_a_merge() -> None:
    left, right = NullControl(["truncate"]), NullControl(["truncate"])
    left.differences.add({"truncate": 0.5})
    right.differences.add({"truncate": math.nan})
    merged = NullControl.merged([left, right])
    assert math.isnan(merged.differences.values["truncate"])
    maxima: Maxima[int] = Maxima()
    maxima.add({3: 0.25})
    maxima.add({3: 0.125, 4: 1.0})
    assert maxima.values == {3: 0.25, 4: 1.0}
    restored: Maxima[int] = Maxima()
    restored.restore(_through_snapshot(maxima.state()), "maxima", "count")  # type: ignore[arg-type]
    assert restored.values == maxima.values
