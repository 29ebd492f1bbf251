"""Data parallel DCP on `torch.distributed`: which batches a rank takes, and how ranks combine.

Under an initialised process group (``torchrun --nproc_per_node N -m dcp_lens run ...``, or the
Python API after `torch.distributed.init_process_group`) batch i of a split goes to rank
i % world. Calibration moments and subsamples are gathered to every rank and merged in rank
order, so every rank fits the same maps; per-example metric vectors, null controls and probe
subsamples are gathered to rank 0, which decomposes, runs the probe and writes. Without a
process group (or with one rank) every helper is the identity and nothing is communicated.
Objects travel through the object collectives, moved to the CPU first (a pickled CUDA tensor
would come back on the sender's device index).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torch import Tensor

_T = TypeVar("_T")


def rank_and_world() -> tuple[int, int]:
    """``(rank, world size)`` of the current process group; ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_main() -> bool:
    """True on rank 0 (and in a single process): the rank that decomposes and writes."""
    return rank_and_world()[0] == 0


def assigned(items: Sequence[_T]) -> list[tuple[int, _T]]:
    """``(index, item)`` of the items this rank takes: index i goes to rank i % world."""
    rank, world = rank_and_world()
    return [(i, item) for i, item in enumerate(items) if i % world == rank]


def all_gather(value: Any) -> list[Any]:
    """Every rank's ``value`` (moved to the CPU), in rank order, on every rank."""
    rank, world = rank_and_world()
    if world == 1:
        return [value]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, to_cpu(value))
    return gathered


def gather_to_main(value: _T) -> list[_T] | None:
    """Every rank's ``value`` (moved to the CPU), in rank order, on rank 0; None elsewhere."""
    rank, world = rank_and_world()
    if world == 1:
        return [value]
    gathered: list[_T | None] | None = [None] * world if rank == 0 else None
    dist.gather_object(to_cpu(value), gathered, dst=0)
    return cast(list[_T] | None, gathered)  # on rank 0 every rank filled its slot


def broadcast_from_main(value: _T | None) -> _T:
    """Rank 0's ``value`` (moved to the CPU) on every rank; the other ranks pass None."""
    if rank_and_world()[1] == 1:
        return cast(_T, value)  # one rank: rank 0's own value
    box = [to_cpu(value) if is_main() else None]
    dist.broadcast_object_list(box, src=0)
    return cast(_T, value if is_main() else box[0])  # rank 0 passes a _T


def to_cpu(value: _T) -> _T:
    """``value`` with every tensor in its dicts, lists, tuples and objects moved to the CPU."""
    return moved(value, torch.device("cpu"))


def moved(value: _T, device: torch.device | str) -> _T:
    """A copy of ``value`` with every tensor in its dicts, lists, tuples and plain objects
    (those with a ``__dict__``) on ``device``."""
    # Each branch rebuilds a value of the type it was given.
    if isinstance(value, Tensor):
        return cast(_T, value.detach().to(device))
    if isinstance(value, dict):
        return cast(_T, {key: moved(item, device) for key, item in value.items()})
    if isinstance(value, list | tuple):
        return cast(_T, type(value)(moved(item, device) for item in value))
    if hasattr(value, "__dict__") and not isinstance(value, type):
        copy = object.__new__(type(value))
        copy.__dict__.update({key: moved(item, device) for key, item in vars(value).items()})
        return cast(_T, copy)
    return value


def init_from_environment(device: str) -> str:
    """Join the process group torchrun describes (``WORLD_SIZE`` > 1 in the environment):
    NCCL for a CUDA ``device``, else gloo. Returns the device this rank computes on
    (``cuda:LOCAL_RANK`` for ``cuda``); ``device`` unchanged without torchrun."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return device
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = f"cuda:{local}"
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    return device


def finish(wait: bool = True) -> None:
    """Leave the process group `init_from_environment` joined, after every rank is done
    (``wait``; pass False on an error, where the other ranks may never arrive)."""
    if dist.is_available() and dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()


__all__ = [
    "all_gather",
    "assigned",
    "broadcast_from_main",
    "finish",
    "gather_to_main",
    "init_from_environment",
    "is_main",
    "moved",
    "rank_and_world",
    "to_cpu",
]
