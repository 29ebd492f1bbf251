"""The fit's accumulators: a snapshot restores a source's moments exactly, and a source whose
states turn non-finite is dropped."""

from __future__ import annotations

import io
import math

import torch

from dcp_lens.protocol.calibration import StreamingMoments
from dcp_lens.protocol.fit_records import GroupMoments


def _through_snapshot(state: object) -> object:
    """``state`` saved and loaded as `dcp_lens.utils.snapshots.Checkpoint` does."""
    buffer = io.BytesIO()
    torch.save({"done": 1, "state": state}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)["state"]


def test_group_moments_restore_exactly_and_drop_a_non_finite_source() -> None:
    generator = torch.Generator().manual_seed(1)
    rows = torch.randn(40, 4, generator=generator)
    groups = torch.arange(40) % 2
    present = [(g, groups == g) for g in range(2)]
    moments = GroupMoments(2, torch.float32)
    assert moments.add(rows, present, rows=8)
    restored = GroupMoments(2, torch.float32)
    restored.restore(_through_snapshot(moments.state()))  # type: ignore[arg-type]
    total, again = moments.total(), restored.total()
    assert total is not None and again is not None
    assert torch.equal(total.mean, again.mean) and torch.equal(total.covariance, again.covariance)
    whole = StreamingMoments.from_samples(rows)
    assert total.count == whole.count == 40
    assert torch.allclose(total.mean, whole.mean)
    assert not moments.add(torch.full((40, 4), math.inf), present, rows=8)
    assert moments.groups is None and moments.total() is None
