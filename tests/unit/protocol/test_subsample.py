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
