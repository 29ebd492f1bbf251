"""Devices and dtypes, checked once where they enter (a loader, `train`, the CLI), so that an
unavailable device is one line naming it and what this machine has, not a torch traceback."""

from __future__ import annotations

from typing import Any

import torch

from dcp_lens.utils.checks import WEIGHT_DTYPES
from dcp_lens.utils.errors import DeviceError


def available_devices() -> list[str]:
    """The devices this machine can compute on: ``cpu``, then ``cuda:i`` / ``mps`` / ... ."""
    found = ["cpu"]
    if torch.cuda.is_available():
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        found.append("mps")
    for kind in ("xpu",):
        backend = getattr(torch, kind, None)
        if backend is not None and getattr(backend, "is_available", lambda: False)():
            found += [f"{kind}:{i}" for i in range(backend.device_count())]
    return found


def check_device(device: object) -> torch.device:
    """``device`` (a name such as ``"cuda:0"`` or a ``torch.device``) if it exists here.

    Raises:
        DeviceError: the name is not a device, or this machine does not have it (the message
            lists the devices it has).
    """
    if isinstance(device, torch.device):
        parsed = device
    elif isinstance(device, str) and device.strip():
        try:
            parsed = torch.device(device.strip())
        except (RuntimeError, ValueError) as error:
            raise DeviceError(
                f"device {device!r} is not a device name; available here: {_listing()}."
            ) from error
    else:
        raise DeviceError(
            f"device must be a device name such as 'cpu' or 'cuda:0', got {device!r}; available "
            f"here: {_listing()}."
        )
    if parsed.type == "cpu":
        return parsed
    if parsed.type == "meta":
        raise DeviceError(
            "device 'meta' holds shapes but no values, so nothing can run on it; available "
            f"here: {_listing()}."
        )
    have = available_devices()
    wanted = str(parsed) if parsed.index is not None else parsed.type
    if not any(name == wanted or name.split(":")[0] == wanted for name in have):
        raise DeviceError(f"device {str(device)!r} is not available; available here: {_listing()}.")
    return parsed


def check_dtype(dtype: object) -> torch.dtype:
    """A floating dtype dcp-lens computes in, from a ``torch.dtype`` or a name (``"bfloat16"``)."""
    if isinstance(dtype, str) and dtype in WEIGHT_DTYPES:
        return WEIGHT_DTYPES[dtype]
    if isinstance(dtype, torch.dtype) and dtype in WEIGHT_DTYPES.values():
        return dtype
    raise DeviceError(
        f"dtype={dtype!r} is not one of {sorted(WEIGHT_DTYPES)}; dcp-lens computes in floating "
        "point only (integer, complex and float8 dtypes are refused)."
    )


def _listing() -> str:
    names = available_devices()
    note = "" if torch.cuda.is_available() else " (no CUDA device: torch sees none)"
    return ", ".join(names) + note


__all__ = ["available_devices", "check_device", "check_dtype"]


def copy_without_wait(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``, the host not waiting for the copy where it need not.

    From a CUDA device to the host, into newly pinned (page-locked) host memory with
    ``non_blocking=True``: the copy is queued on the device's current stream, and the returned
    tensor holds its values only once the stream has reached it. A host-side read must wait for
    that first (`host_copy_done`); a copy back to the device from it needs no wait, the stream
    runs the two copies in order. From pinned host memory to the device, also without waiting
    (PyTorch's pinned-memory allocator does not hand the buffer out again before the copy is
    done). Anything else is an ordinary ``.to(device)``."""
    if tensor.device == device:
        return tensor
    if device.type == "cpu" and tensor.device.type == "cuda":
        pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return pinned.copy_(tensor, non_blocking=True)
    if tensor.device.type == "cpu" and device.type == "cuda" and tensor.is_pinned():
        return tensor.to(device, non_blocking=True)
    return tensor.to(device)


def host_copy_done(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded on ``device``'s current stream after the copies `copy_without_wait`
    queued there (None off CUDA): ``event.synchronize()`` before the host reads them."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def on_host_together(tensors: dict[Any, torch.Tensor]) -> dict[Any, torch.Tensor]:
    """``tensors`` (each 1-d) on the host, copied in one transfer per device they are on, not
    one per tensor (each transfer from an accelerator waits for it)."""
    moved: dict[Any, torch.Tensor] = {}
    by_device: dict[torch.device, list[Any]] = {}
    for key, tensor in tensors.items():
        by_device.setdefault(tensor.device, []).append(key)
    for device, keys in by_device.items():
        if device.type == "cpu":
            moved.update((key, tensors[key]) for key in keys)
            continue
        parts = torch.cat([tensors[key] for key in keys]).cpu()
        sizes = [tensors[key].numel() for key in keys]
        moved.update(zip(keys, parts.split(sizes), strict=True))
    return {key: moved[key] for key in tensors}
