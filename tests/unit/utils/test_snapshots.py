"""Run snapshots: a field is read with its kind (a string or a bool is no number), and a field
an accumulator refuses is reported with the snapshot's file, which is left as it was."""

from __future__ import annotations

import math

import pytest
import torch

from dcp_lens.utils.errors import DamagedFileError
from dcp_lens.utils.snapshots import (
    Checkpoint,
    SnapshotFieldError,
    snapshot_field,
    snapshot_key,
    snapshot_numbers,
    snapshot_value,
)


@pytest.mark.parametrize(
    ("value", "kind", "read"),
    [
        (8, "count", 8),
        (0, "count", 0),
        (3, "number", 3.0),
        (math.inf, "number", math.inf),
        ((1, 2), "list", [1, 2]),
        (None, "optional tensor", None),
        ("truncate", "str", "truncate"),
    ],
)
def test_a_field_of_its_kind_is_read(value, kind, read):
    assert snapshot_value(value, "f", kind) == read


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        ("8", "count"),
        (True, "count"),
        (-1, "count"),
        (8.0, "count"),
        ("0.5", "number"),
        (False, "number"),
        (None, "number"),
        (None, "tensor"),
        ([1.0], "tensor"),
        (3, "str"),
        ("ab", "list"),
        ({"a": 1}, "optional list"),
    ],
)
def test_a_field_of_another_kind_is_refused_with_its_name(value, kind):
    with pytest.raises(SnapshotFieldError, match=r"field a\.b must be .*\(got "):
        snapshot_value(value, "a.b", kind)


def test_entries_keys_and_numbers_name_the_field_refused():
    with pytest.raises(SnapshotFieldError, match=r"field s\.count must be present"):
        snapshot_field({}, "count", "s", "count")
    with pytest.raises(SnapshotFieldError, match=r"field s must be a dict"):
        snapshot_field([1], "count", "s", "count")
    assert snapshot_key(("loss", "truncate", 2), "k", ("str", "str", "count")) == (
        "loss",
        "truncate",
        2,
    )
    with pytest.raises(
        SnapshotFieldError, match=r"field k must be a whole number >= 0 \(got '2'\)"
    ):
        snapshot_key(("loss", "truncate", "2"), "k", ("str", "str", "count"))
    assert snapshot_numbers({"a": 1, "b": math.nan}, "n", "str")["a"] == 1.0
    with pytest.raises(SnapshotFieldError, match=r"field n\['a'\] must be a number \(got True\)"):
        snapshot_numbers({"a": True}, "n", "str")


def test_checkpoint_names_the_file_and_field_an_accumulator_refuses(tmp_path):
    checkpoint = Checkpoint(tmp_path, every=1)
    checkpoint.save("calibration", 1, 2, lambda: {"count": "8"})
    path = next(tmp_path.glob("calibration.*.pt"))
    before = path.read_bytes()

    def into(state: object) -> None:
        snapshot_field(state, "count", "state", "count")

    with pytest.raises(DamagedFileError) as refused:
        checkpoint.restore("calibration", torch.device("cpu"), into)
    message = str(refused.value)
    assert str(path) in message and "field state.count must be a whole number" in message
    assert "(got '8')" in message and "without --resume" in message
    assert path.read_bytes() == before
    checkpoint.save("calibration", 2, 2, lambda: {"count": 8})
    seen: list[object] = []
    assert checkpoint.restore("calibration", torch.device("cpu"), seen.append)[0] == 2
    assert seen == [{"count": 8}]
