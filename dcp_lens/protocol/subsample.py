"""`Subsample`: a fixed-size pseudo-random subsample of rows streamed in batches (the probe's
states and the states a sample-fitted calibration map is fitted to), keyed by example and
position so it never depends on the batch size, the order of the examples or the process."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypedDict

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from dcp_lens.utils.snapshots import SnapshotFieldError, snapshot_field


class SubsampleState(TypedDict):
    """A `Subsample`'s kept rows, their example keys and priorities (int64 bits of the uint64)."""

    rows: Tensor | None
    keys: Tensor | None
    priority: Tensor


class Subsample:
    """A fixed-size pseudo-random subsample of rows streamed in batches (for the probe and the
    mixture calibration): the ``size`` rows of smallest priority, a hash of the seed, the row's
    example key and its position. Which rows are kept, and their order, depend on the examples
    only, never on the batch size or the order of the examples."""

    def __init__(self, size: int, seed: int) -> None:
        self.size = size
        self.seed = np.uint64(seed % 2**63)
        self.rows: Tensor | None = None
        self.keys: Tensor | None = None  # the example of each kept row
        self.priority = np.zeros(0, dtype=np.uint64)

    def add(
        self,
        rows: Float[Tensor, "n d"],
        keys: Int[Tensor, " n"],
        positions: Int[Tensor, " n"],
    ) -> None:
        if rows.shape[0] == 0:
            return
        priority = _mix(keys.cpu().numpy(), positions.cpu().numpy(), self.seed)
        self._keep(priority, rows.detach(), keys.cpu())

    def add_selected(
        self,
        rows_of: Callable[[Int[Tensor, " m"]], Float[Tensor, "m d"]],
        keys: Int[Tensor, " n"],
        positions: Int[Tensor, " n"],
    ) -> None:
        """`add` of ``n`` rows that are made only where kept: ``rows_of(index)`` gives the new
        rows at ``index`` (int64 on the CPU, into ``keys``), so that a batch's rows are never
        all copied at once. Keeps exactly what `add` of every row would."""
        if keys.shape[0] == 0:
            return
        priority = _mix(keys.cpu().numpy(), positions.cpu().numpy(), self.seed)
        held = 0 if self.rows is None else len(self.priority)
        combined = priority if self.rows is None else np.concatenate([self.priority, priority])
        order = np.argsort(combined, kind="stable")[: self.size]
        old = torch.from_numpy(order < held)
        fresh = torch.from_numpy(order[order >= held].astype(np.int64) - held)
        new_rows = rows_of(fresh).detach()
        if self.rows is None or self.keys is None:
            self.rows, self.keys = new_rows, keys.cpu()[fresh]
        else:
            kept = torch.from_numpy(order[order < held].astype(np.int64))
            rows = new_rows.new_empty((len(order), *new_rows.shape[1:]))
            rows[old.to(rows.device)] = self.rows[kept.to(self.rows.device)]
            rows[(~old).to(rows.device)] = new_rows
            merged = torch.empty(len(order), dtype=self.keys.dtype)
            merged[old], merged[~old] = self.keys[kept], keys.cpu()[fresh]
            self.rows, self.keys = rows, merged
        self.priority = combined[order]

    def _keep(self, priority: np.ndarray, rows: Tensor, keys: Tensor) -> None:
        """Keep the ``size`` rows of smallest priority among those kept and these."""
        if self.rows is not None and self.keys is not None:
            priority = np.concatenate([self.priority, priority])
            rows = torch.cat([self.rows, rows])
            keys = torch.cat([self.keys, keys])
        order = np.argsort(priority, kind="stable")[: self.size]
        index = torch.from_numpy(order.astype(np.int64))
        self.rows, self.keys = rows[index.to(rows.device)], keys[index]
        self.priority = priority[order]

    def state(self) -> SubsampleState:
        """The kept rows, their example keys and priorities (tensors), for `restore`."""
        priority = torch.from_numpy(self.priority.view(np.int64).copy())
        return {"rows": self.rows, "keys": self.keys, "priority": priority}

    def restore(self, state: object, field: str = "subsample") -> None:
        """Keep exactly what `state` recorded (a field of the wrong type raises
        `SnapshotFieldError` naming it; ``field`` is where ``state`` sits in its snapshot)."""
        rows = snapshot_field(state, "rows", field, "optional tensor")
        keys = snapshot_field(state, "keys", field, "optional tensor")
        priority = snapshot_field(state, "priority", field, "tensor")
        if priority.dtype != torch.int64 or priority.ndim != 1:
            raise SnapshotFieldError(f"{field}.priority", "a 1-d int64 tensor", priority)
        self.rows, self.keys = rows, None if keys is None else keys.cpu()
        self.priority = priority.cpu().numpy().view(np.uint64).copy()

    @classmethod
    def merged(cls, parts: Sequence[Subsample]) -> Subsample:
        """The subsample of the union of the rows the ``parts`` (same size and seed) saw."""
        merged = cls(parts[0].size, 0)
        merged.seed = parts[0].seed
        for part in parts:
            if part.rows is not None and part.keys is not None:
                merged._keep(part.priority, part.rows, part.keys)
        return merged

    def tensor(self) -> Tensor | None:
        return self.rows

    def groups(self) -> Tensor | None:
        """The example key of each kept row."""
        return self.keys


def row_ids(
    keys: Int[Tensor, " batch"], keep: Bool[Tensor, "batch pos"]
) -> tuple[Int[Tensor, " n"], Int[Tensor, " n"]]:
    """The example key and the position of every kept (batch, position), on the CPU."""
    keep = keep.cpu()
    example = keys[:, None].expand(keep.shape)[keep]
    position = torch.arange(keep.shape[1])[None].expand(keep.shape)[keep]
    return example, position


def _mix(keys: np.ndarray, positions: np.ndarray, seed: np.uint64) -> np.ndarray:
    """A splitmix64-style hash of (example key, position, seed), uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = keys.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        x ^= positions.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9) + seed
        x ^= x >> np.uint64(31)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(29)
    return x
