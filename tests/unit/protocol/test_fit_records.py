"""The fit's accumulators: a snapshot restores a source's moments exactly, and a source whose
states turn non-finite is dropped."""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch

from dcp_lens.protocol.calibration import StreamingMoments
from dcp_lens.protocol.fit_records import GroupMoments
from dcp_lens.utils.snapshots import SnapshotFieldError


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
    restored.restore(_through_snapshot(moments.state()))
    total, again = moments.total(), restored.total()
    assert total is not None and again is not None
    assert torch.equal(total.mean, again.mean) and torch.equal(total.covariance, again.covariance)
    whole = StreamingMoments.from_samples(rows)
    assert total.count == whole.count == 40
    assert torch.allclose(total.mean, whole.mean)
    assert not moments.add(torch.full((40, 4), math.inf), present, rows=8)
    assert moments.groups is None and moments.total() is None


def test_parked_groups_hold_the_moments_of_groups_filled_together() -> None:
    """With a host, one group is filled at a time and the others' rows are parked; the moments
    equal those of every group filled at once, whatever order the rows come in."""
    generator = torch.Generator().manual_seed(2)
    n, d, n_groups = 300, 5, 3
    states = torch.randn(n, d, generator=generator, dtype=torch.float64) * 3.0 + 1.0
    group = torch.randint(0, n_groups, (n,), generator=generator)
    together = GroupMoments(n_groups, torch.float64)
    parked = GroupMoments(n_groups, torch.float64, host=torch.device("cpu"))
    # A mixed leading batch, then the rest group by group, in batches of 25.
    order = torch.cat([torch.arange(25), 25 + torch.argsort(group[25:], stable=True)])
    residents = set()
    for start in range(0, n, 25):
        rows = order[start : start + 25]
        present = [(g, group[rows] == g) for g in range(n_groups) if bool((group[rows] == g).any())]
        assert together.add(states[rows], present, rows=8)
        assert parked.add(states[rows], present, rows=8)
        residents.add(parked.resident)
    assert residents == set(range(n_groups))  # every group was filled in its turn
    together.flush()
    parked.flush()
    assert all(not rows for rows in parked.parked)
    for mine, theirs in zip(parked.groups or [], together.groups or [], strict=True):
        assert mine.count == theirs.count
        assert torch.allclose(mine.mean, theirs.mean, atol=1e-12)
        assert torch.allclose(mine.covariance, theirs.covariance, atol=1e-10)
    whole, reference = parked.total(), together.total()
    assert whole is not None and reference is not None
    assert torch.allclose(whole.covariance, reference.covariance, atol=1e-10)


def test_the_rows_waiting_stay_within_a_buffer_per_group_whatever_the_groups_shares() -> None:
    """The waiting rows are folded in once they hold a buffer per group between them: with one
    group getting most of each batch and the others a few rows, they never exceed that and a
    batch, so the memory estimate's bound holds; the moments are those of every row at once."""
    generator = torch.Generator().manual_seed(3)
    n_groups, buffer, batch, d = 4, 16, 24, 3
    moments = GroupMoments(n_groups, torch.float64)
    seen = []
    for _ in range(30):
        rows = torch.randn(batch, d, generator=generator, dtype=torch.float64)
        # Group 0 takes 21 of every 24 rows, the others one each.
        group = torch.tensor([0] * 21 + [1, 2, 3])
        present = [(g, group == g) for g in range(n_groups)]
        assert moments.add(rows, present, rows=buffer)
        waiting = sum(len(x) for pending in moments.pending for x in pending)
        assert waiting < n_groups * buffer + batch
        seen.append(rows)
        if len(seen) == 4:
            # Folded per stream: the groups with a few rows went in with the others, rather
            # than waiting for a buffer of their own (16 batches here).
            assert all(m.count > 0 for m in moments.groups or [])
    moments.flush()
    whole, reference = moments.total(), StreamingMoments.from_samples(torch.cat(seen))
    assert whole is not None and whole.count == reference.count == 30 * batch
    assert torch.allclose(whole.covariance, reference.covariance, atol=1e-10)


def test_group_major_keeps_the_leading_batches_and_orders_the_rest_by_group() -> None:
    from dcp_lens.protocol.evaluation_set import EvaluationSet
    from dcp_lens.protocol.fit_records import group_major

    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 50, (40, 6), generator=generator)
    data = EvaluationSet(tokens, tokens.roll(-1, 1))
    ordered = group_major(data, batch_size=8, n_groups=4, leading_rows=3)
    assert torch.equal(ordered.tokens[:8], data.tokens[:8])  # the first batch as it was
    groups = ordered.example_keys()[8:] % 4
    assert bool((groups[1:] >= groups[:-1]).all())  # then group by group
    assert sorted(map(tuple, ordered.tokens.tolist())) == sorted(map(tuple, data.tokens.tolist()))


@pytest.mark.parametrize("value", ["8", True, -1])
def test_group_moments_refuse_a_count_that_is_no_count(value):
    rows = torch.randn(40, 4, generator=torch.Generator().manual_seed(4))
    groups = torch.arange(40) % 2
    moments = GroupMoments(2, torch.float32)
    assert moments.add(rows, [(g, groups == g) for g in range(2)], rows=8)
    state: Any = _through_snapshot(moments.state())
    state[1]["count"] = value
    with pytest.raises(SnapshotFieldError, match=r"field groups\[1\]\.count must be a whole"):
        GroupMoments(2, torch.float32).restore(state)
    with pytest.raises(SnapshotFieldError, match=r"field groups must be a list of 3 groups"):
        GroupMoments(3, torch.float32).restore(_through_snapshot(moments.state()))
