"""Keep peak memory set by the batch, not by the number of batches, at the speed of the heap.

glibc's malloc serves a request of at least ``M_MMAP_THRESHOLD`` bytes with its own mmap, returned
to the system on free; smaller ones come from the heap. By default the threshold is dynamic (each
large block freed raises it, up to 32 MB), and so is the trimming of the heap's top. Left so, a
DCP sweep's per-batch tensors come from a heap that fragments, and what it holds grows with the
number of batches: 2.3 GB at 500k tokens of `dcp-lens run --model
huginn:demos/data/fixtures/huginn_tiny --task text:demos/data/tinyshakespeare.txt` (3.8 GB before
this release trimmed the sweep's temporaries), against 0.6 GB at 50k; and tensors freed and
allocated again are often unmapped and faulted in afresh (half a million page faults a
`dcp-lens bench` sweep).

`dcp-lens` therefore, when it starts (`limit_heap_fragmentation`), fixes the mmap threshold at its
largest (32 MB) and the heap's automatic trimming at 512 MB, so that within a batch freed tensors
are reused, and the protocol calls `release_free_memory` (glibc's ``malloc_trim(0)``) after every
batch, which returns the heap's free pages, fragmented or not. The run above peaked at 603 MB at
50k tokens (25 s), 823 MB at 500k (158 s) and 774 MB on the whole corpus (16647 windows, 314 s).

The older bound, a fixed 128 kB threshold (every tensor above it a fresh mapping whose pages the
kernel zeroes on first touch), held the 500k run at 705 MB but took 360 s. It stays available:
``DCP_LENS_MMAP_THRESHOLD=BYTES`` fixes that threshold instead; ``DCP_LENS_TRIM=0`` turns the
trimming after each batch off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Any

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter numbers
M_TRIM_THRESHOLD = -1
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's largest on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD_BYTES = 512 * 1024 * 1024
THRESHOLD_VARIABLE = "DCP_LENS_MMAP_THRESHOLD"
TRIM_VARIABLE = "DCP_LENS_TRIM"


def limit_heap_fragmentation(threshold: int | None = None) -> bool:
    """Set glibc's allocator up for batch loops (no effect without glibc); returns whether a
    setting was applied. What `dcp-lens` does when it starts; a notebook may call it too.

    ``threshold``: a fixed mmap threshold in bytes (None: ``$DCP_LENS_MMAP_THRESHOLD``), the
    strict, slower bound: every tensor above it a fresh mapping. Without one (unset or 0), the
    mmap threshold is fixed at glibc's largest, 32 MB, and the automatic trimming of the heap's
    top at `TRIM_THRESHOLD_BYTES`, so that within a batch freed tensors are reused rather than
    unmapped and faulted in again; `release_free_memory` after each batch returns the free pages.

    Raises:
        ValueError: ``$DCP_LENS_MMAP_THRESHOLD`` is not a number of bytes >= 0.
    """
    if threshold is None:
        threshold = fixed_threshold() or 0
    libc = _glibc()
    if libc is None:
        return False
    if threshold > 0:
        return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


def fixed_threshold() -> int | None:
    """The mmap threshold ``$DCP_LENS_MMAP_THRESHOLD`` fixes, in bytes (None: unset or 0).

    Raises:
        ValueError: the variable is not a number of bytes >= 0.
    """
    text = os.environ.get(THRESHOLD_VARIABLE, "").strip()
    if text and not text.isdigit():
        raise ValueError(
            f"{THRESHOLD_VARIABLE}={text!r} must be a number of bytes (e.g. 131072; 0 or unset: "
            "the default setting)."
        )
    return int(text) if text and int(text) > 0 else None


def release_free_memory() -> bool:
    """Return the heap's free pages to the system (glibc's ``malloc_trim(0)``), so that a loop
    over batches keeps peak memory set by one batch even when its heap fragments. No effect
    where there is no glibc, or with ``$DCP_LENS_TRIM=0``. Returns whether it ran."""
    libc = None if os.environ.get(TRIM_VARIABLE, "1").strip() == "0" else _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


_LIBC: list[Any] = []  # [the C library] once looked up; [None] where it is not glibc


def _glibc() -> Any:
    if not _LIBC:
        library = None
        if sys.platform.startswith("linux"):
            try:
                library = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                library.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)  # musl has no mallopt
                library.mallopt.restype = ctypes.c_int
                library.malloc_trim.argtypes = (ctypes.c_size_t,)
                library.malloc_trim.restype = ctypes.c_int
            except (OSError, AttributeError):
                library = None
        _LIBC.append(library)
    return _LIBC[0]
