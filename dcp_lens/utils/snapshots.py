"""Atomic snapshots of the sweep's loops, so `dcp-lens run --resume` continues a killed run.

A stage (``calibration``, ``evaluation.0``, ...) saves what its loop has accumulated, tensors and
plain values only, every ``every`` batches and after its last batch: `torch.save` to a temporary
file of a unique name, flushed to disk, then an atomic rename
(`dcp_lens.utils.files.written_atomically`), so a kill or a full disk leaves the previous
snapshot or the new one, never half of one. Each rank of a data-parallel run keeps its own
snapshots (its batches are its own). Resumed, a loop skips the batches its snapshot has folded
in and continues with the same accumulators, so the run ends with the results an uninterrupted
run gives.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from dcp_lens.utils import distributed
from dcp_lens.utils.errors import DamagedFileError
from dcp_lens.utils.files import written_atomically

# Tests set this to "STAGE:BATCHES" (or "model:N") to SIGKILL the run at that point.
KILL_VARIABLE = "DCP_LENS_KILL_AT"


class Checkpoint:
    """Snapshots of one model's sweep in ``folder``, every ``every`` batches of a stage."""

    def __init__(self, folder: str | Path, every: int = 16) -> None:
        if every < 1:
            raise ValueError(f"every={every} must be >= 1 (batches between snapshots).")
        self.folder = Path(folder)
        self.every = every

    def restore(
        self, stage: str, device: torch.device, into: Callable[[Any], None] | None = None
    ) -> tuple[int, Any]:
        """``(batches done, state)`` of ``stage``'s last snapshot on ``device``; ``(0, None)``
        when there is none. ``into`` (an accumulator's ``restore``) is handed the state; a field
        it refuses (`SnapshotFieldError`) is reported with this snapshot's file."""
        path = self._path(stage)
        if not path.is_file():
            return 0, None
        recovery = (
            "it is damaged or was not written by this run; start the run again without --resume "
            "(its snapshots are discarded)."
        )
        try:
            snapshot = torch.load(path, map_location=device, weights_only=True)
        except Exception as cause:  # truncated, random bytes, a pickle of other objects, ...
            text = " ".join(str(cause).split())[:200] or type(cause).__name__
            raise DamagedFileError(
                f"--resume snapshot {path} cannot be read ({text}); {recovery}"
            ) from cause
        done = snapshot.get("done") if isinstance(snapshot, dict) else None
        if type(done) is not int or done < 0 or "state" not in snapshot:
            raise DamagedFileError(
                f"--resume snapshot {path} is not a snapshot of dcp-lens (expected a dict with "
                f"'done' batches and 'state', got {type(snapshot).__name__}); {recovery}"
            )
        if into is not None:
            try:
                into(snapshot["state"])
            except SnapshotFieldError as error:
                raise DamagedFileError(f"--resume snapshot {path}: {error}; {recovery}") from error
        return done, snapshot["state"]

    def save(self, stage: str, done: int, total: int, state: Callable[[], object]) -> None:
        """Snapshot ``state()`` after ``done`` of ``total`` batches, every ``every`` batches and
        after the last (``state`` is called only then)."""
        if done % self.every and done != total:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self._path(stage)
        with written_atomically(path) as partial:
            torch.save({"done": done, "state": state()}, partial)
        die_if_asked(f"{stage}:{done}")

    def _path(self, stage: str) -> Path:
        rank, world = distributed.rank_and_world()
        return self.folder / f"{stage}.rank{rank}of{world}.pt"


class SnapshotFieldError(DamagedFileError):
    """A field of a run snapshot is missing or holds a value of the wrong type (a string or a
    bool where a number belongs, ...). Raised by the accumulators' ``restore``, which do not know
    the snapshot's file; `Checkpoint.restore` reports it with the file and how to recover."""

    def __init__(self, field: str, expected: str, value: object) -> None:
        self.field = field
        shown = " ".join(repr(value).split())
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        super().__init__(f"field {field} must be {expected} (got {shown})")


# What a field of a snapshot may hold: "count" a whole number >= 0 (a bool is not one),
# "number" an int or a float (read as a float), the others their type; "optional ..." adds None.
FieldKind = Literal[
    "count",
    "number",
    "str",
    "tensor",
    "optional tensor",
    "dict",
    "optional dict",
    "list",
    "optional list",
]
_FIELD_KINDS: dict[str, tuple[str, Callable[[object], bool]]] = {
    "count": ("a whole number >= 0", lambda v: type(v) is int and v >= 0),
    "number": ("a number", lambda v: type(v) in (int, float)),
    "str": ("a string", lambda v: type(v) is str),
    "tensor": ("a tensor", lambda v: isinstance(v, torch.Tensor)),
    "dict": ("a dict", lambda v: type(v) is dict),
    "list": ("a list", lambda v: type(v) in (list, tuple)),
}


def snapshot_value(value: object, field: str, kind: FieldKind) -> Any:
    """``value``, the snapshot's ``field``, checked to be of ``kind`` (a "number" as a float, a
    "list" as a list); raises `SnapshotFieldError` otherwise."""
    optional = kind.startswith("optional ")
    if optional and value is None:
        return None
    expected, accepts = _FIELD_KINDS[kind.removeprefix("optional ")]
    if not accepts(value):
        raise SnapshotFieldError(field, expected + (" or None" if optional else ""), value)
    if kind == "number" and isinstance(value, (int, float)):
        return float(value)
    if kind.endswith("list") and isinstance(value, (list, tuple)):
        return list(value)
    return value


def snapshot_field(state: object, name: str, field: str, kind: FieldKind) -> Any:
    """The entry ``name`` of the snapshot's dict ``state`` (at ``field``), of ``kind``."""
    entries = snapshot_value(state, field, "dict")
    if name not in entries:
        raise SnapshotFieldError(f"{field}.{name}", "present", "nothing")
    return snapshot_value(entries[name], f"{field}.{name}", kind)


def snapshot_key(value: object, field: str, kinds: Sequence[FieldKind]) -> Any:
    """A key of a snapshot's dict (at ``field``): of ``kinds[0]`` alone, or a tuple of ``kinds``
    (a k of the grid stored as "3" would silently name another cell)."""
    if len(kinds) == 1:
        return snapshot_value(value, field, kinds[0])
    if type(value) is not tuple or len(value) != len(kinds):
        raise SnapshotFieldError(field, f"a tuple of {len(kinds)}", value)
    return tuple(snapshot_value(v, field, kind) for v, kind in zip(value, kinds, strict=True))


def snapshot_numbers(value: object, field: str, key: FieldKind) -> dict[Any, float]:
    """A snapshot's dict of numbers (at ``field``) by keys of ``key``, the numbers as floats."""
    return {
        snapshot_key(name, f"{field} key", (key,)): snapshot_value(
            number, f"{field}[{name!r}]", "number"
        )
        for name, number in snapshot_value(value, field, "dict").items()
    }


def die_if_asked(point: str) -> None:
    """SIGKILL this process if ``$DCP_LENS_KILL_AT`` names ``point`` (tests of --resume)."""
    if os.environ.get(KILL_VARIABLE) == point:
        os.kill(os.getpid(), signal.SIGKILL)


__all__ = [
    "KILL_VARIABLE",
    "Checkpoint",
    "FieldKind",
    "SnapshotFieldError",
    "die_if_asked",
    "snapshot_field",
    "snapshot_key",
    "snapshot_numbers",
    "snapshot_value",
]
