"""`Subsample`: a snapshot restores exactly the rows kept, and a field of the wrong kind is
refused with its name."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from dcp_lens.protocol.subsample import Subsample
from dcp_lens.utils.snapshots import SnapshotFieldError


def _through_snapshot(state: object) -> Any:
    """``state`` saved and loaded as `dcp_lens.utils.snapshots.Checkpoint` does."""
    buffer = io.BytesIO()
    torch.save({"done": 1, "state": state}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)["state"]


def _filled() -> Subsample:
    generator = torch.Generator().manual_seed(5)
    sample = Subsample(6, seed=3)
    keys = torch.arange(4).repeat_interleave(5)
    sample.add(torch.randn(20, 3, generator=generator), keys, torch.arange(20) % 5)
    return sample


def test_a_restored_subsample_keeps_what_comes_next_as_the_original_does():
    original, restored = _filled(), Subsample(6, seed=3)
    restored.restore(_through_snapshot(original.state()))
    more = torch.randn(10, 3, generator=torch.Generator().manual_seed(6))
    for sample in (original, restored):
        sample.add(more, torch.arange(4, 14), torch.zeros(10, dtype=torch.int64))
    assert torch.equal(restored.tensor(), original.tensor())  # type: ignore[arg-type]
    assert torch.equal(restored.groups(), original.groups())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("priority", "12", "a tensor"),
        ("priority", torch.zeros(3), "a 1-d int64 tensor"),
        ("rows", True, "a tensor or None"),
        ("keys", 3, "a tensor or None"),
    ],
)
def test_a_subsample_field_of_the_wrong_kind_is_refused(name, value, expected):
    state = _through_snapshot(_filled().state())
    state[name] = value
    with pytest.raises(SnapshotFieldError, match=rf"field probe\.{name} must be {expected}"):
        Subsample(6, seed=3).restore(state, "probe")


def test_rows_made_only_where_kept_keep_what_adding_every_row_keeps() -> None:
    """`Subsample.add_selected` asks for at most ``size`` rows a batch and keeps exactly the rows,
    keys and order `Subsample.add` of the whole batch keeps."""
    generator = torch.Generator().manual_seed(0)
    every, selected = Subsample(50, 3), Subsample(50, 3)
    asked: list[int] = []
    for _ in range(8):
        n = int(torch.randint(1, 120, (1,), generator=generator))
        rows = torch.randn(n, 4, generator=generator)
        keys = torch.randint(0, 40, (n,), generator=generator)
        positions = torch.randint(0, 10, (n,), generator=generator)
        every.add(rows, keys, positions)

        def rows_of(index: torch.Tensor, rows: torch.Tensor = rows) -> torch.Tensor:
            asked.append(len(index))
            return rows[index]

        selected.add_selected(rows_of, keys, positions)
        assert torch.equal(every.tensor(), selected.tensor())
        assert torch.equal(every.groups(), selected.groups())
        assert (every.priority == selected.priority).all()
    assert max(asked) <= 50 and sum(asked) < 8 * 50
