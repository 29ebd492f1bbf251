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
from collections.abc import Callable
from pathlib import Path
from typing import Any

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

    def restore(self, stage: str, device: torch.device) -> tuple[int, Any]:
        """``(batches done, state)`` of ``stage``'s last snapshot on ``device``; ``(0, None)``
        when there is none."""
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


def die_if_asked(point: str) -> None:
    """SIGKILL this process if ``$DCP_LENS_KILL_AT`` names ``point`` (tests of --resume)."""
    if os.environ.get(KILL_VARIABLE) == point:
        os.kill(os.getpid(), signal.SIGKILL)


__all__ = ["KILL_VARIABLE", "Checkpoint", "die_if_asked"]
