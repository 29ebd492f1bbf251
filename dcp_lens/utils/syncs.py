"""Count the host-device synchronisations a stretch of code makes.

A GPU run waits for the device whenever the host needs a tensor's value: ``.item()``,
``.tolist()``, ``.numpy()``, ``float()``, ``int()`` or ``bool()`` of a tensor, a copy to the
host (``.cpu()``, a blocking ``.to("cpu")``), and an explicit ``torch.cuda.synchronize()``.
Each stalls the device's queue, so a loop that makes one per chunk or per k stalls each time.

`counting_syncs` counts them. On a CUDA device it asks PyTorch itself
(``torch.cuda.set_sync_debug_mode``, which warns on every synchronising call, the ones a shim
cannot see included) and counts the warnings. Elsewhere a counting shim wraps the tensor
methods above for the duration: every conversion of a tensor to a Python value and every
``.cpu()`` is counted, whatever device the tensor is on, and a ``.to`` that moves a tensor from
another device to the host without ``non_blocking``. On the CPU the count is therefore an upper
bound of what a CUDA run would synchronise (a conversion of a tensor that lives on the host
anyway, such as the evaluation set's tokens, is counted too). The shim records where each call
came from (``sites``), to find the loop that makes them.

`DeferredScalars` keeps a loop's scalars on the device and reads them to the host together.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

# The tensor methods that hand a value to the host: a synchronisation on an accelerator.
CONVERSIONS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")
# The text of the warning ``torch.cuda.set_sync_debug_mode("warn")`` gives on each sync.
CUDA_SYNC_WARNING = "synchroniz"
_PACKAGE = "dcp_lens"


@dataclass
class SyncCount:
    """Synchronisations counted so far.

    Attributes:
        total: every one counted.
        sites: per ``module:line`` of the package's code that made them (the shim's; a CUDA
            count names the line that triggered the warning).
    """

    total: int = 0
    sites: Counter[str] = field(default_factory=Counter)

    def add(self, site: str) -> None:
        self.total += 1
        self.sites[site] += 1


def _caller_site() -> str:
    """``module:line`` of the innermost frame of the package (not this module) on the stack, or
    of the nearest caller where none is."""
    frame = sys._getframe(2)
    first = None
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if first is None:
            first = f"{name}:{frame.f_lineno}"
        if name.startswith(_PACKAGE) and name != __name__:
            return f"{name}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return first or "?"


@contextlib.contextmanager
def counting_syncs(device: torch.device | str | None = None) -> Iterator[SyncCount]:
    """Count the synchronisations made inside the block (`SyncCount`, filled as it runs).

    ``device``: the run's device. On CUDA PyTorch's sync debug mode counts; elsewhere the shim
    (every tensor-to-host conversion and ``torch.cuda.synchronize`` call). Blocks do not nest:
    an inner block takes over the count until it ends."""
    count = SyncCount()
    on_cuda = device is not None and torch.device(device).type == "cuda"
    with _cuda_counted(count) if on_cuda else _shim_counted(count):
        yield count


@contextlib.contextmanager
def _cuda_counted(count: SyncCount) -> Iterator[None]:
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    for warning in caught:
        if CUDA_SYNC_WARNING in str(warning.message).lower():
            count.add(f"{warning.filename}:{warning.lineno}")


@contextlib.contextmanager
def _shim_counted(count: SyncCount) -> Iterator[None]:
    originals: dict[str, Any] = {name: getattr(torch.Tensor, name) for name in CONVERSIONS}
    synchronize = torch.cuda.synchronize

    def counted(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            count.add(_caller_site())
            return original(*args, **kwargs)

        return call

    to = torch.Tensor.to

    @functools.wraps(to)
    def moved(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        # A blocking copy to the host synchronises; a non-blocking one (into pinned memory) not.
        targets = [*args, kwargs.get("device")]
        crossing = self.device.type != "cpu" and any(_is_host(t) for t in targets)
        if crossing and not kwargs.get("non_blocking", False):
            count.add(_caller_site())
        return to(self, *args, **kwargs)

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, counted(original))
        torch.Tensor.to = moved  # type: ignore[method-assign,assignment]
        torch.cuda.synchronize = counted(synchronize)  # type: ignore[method-assign]
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        torch.Tensor.to = to  # type: ignore[method-assign]
        torch.cuda.synchronize = synchronize  # type: ignore[method-assign]


def _is_host(target: object) -> bool:
    """Whether a ``Tensor.to`` argument names the host."""
    if isinstance(target, torch.device):
        return target.type == "cpu"
    return isinstance(target, str) and target.split(":")[0] == "cpu"


class DeferredScalars:
    """Scalars a loop computes on the device, kept there and read to the host together: one
    synchronisation for all of them, not one per value. Maxima propagate NaN (a NaN read once
    stays NaN, as `dcp_lens.protocol.sweep_records.nan_max` has it); sums add in float64."""

    def __init__(self) -> None:
        self.maxima: dict[Hashable, Tensor] = {}
        self.sums: dict[Hashable, Tensor] = {}

    def maximum(self, key: Hashable, value: Tensor) -> None:
        """Keep the largest 0-d ``value`` given under ``key`` (NaN once any is NaN)."""
        old = self.maxima.get(key)
        self.maxima[key] = value if old is None else torch.maximum(old, value)

    def add(self, key: Hashable, value: Tensor) -> None:
        """Add the 0-d ``value`` to ``key``'s float64 sum."""
        value = value.double()
        old = self.sums.get(key)
        self.sums[key] = value if old is None else old + value

    def read(self) -> tuple[dict[Hashable, float], dict[Hashable, float]]:
        """The maxima and the sums as floats (one transfer to the host), and forget them."""
        values = [*self.maxima.values(), *self.sums.values()]
        floats = torch.stack([v.double() for v in values]).tolist() if values else []
        maxima = dict(zip(self.maxima, floats[: len(self.maxima)], strict=True))
        sums = dict(zip(self.sums, floats[len(self.maxima) :], strict=True))
        self.maxima, self.sums = {}, {}
        return maxima, sums
