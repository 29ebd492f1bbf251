"""Keep peak memory set by the batch, not by the number of batches.

glibc's malloc serves a request of at least ``M_MMAP_THRESHOLD`` bytes with its own mmap, returned
to the system on free. The threshold is dynamic by default: each large block freed raises it (up
to 32 MB), so a sweep's per-batch tensors of a few hundred kB to a few MB come from the heap. The
heap then fragments, and what it holds grows with the number of batches: 2.3 GB at 500k tokens
of `dcp-lens run --model huginn:demos/data/fixtures/huginn_tiny --task text:...` (3.8 GB before
the sweep's temporaries were trimmed), against 0.6 GB at 50k.

`release_free_memory` (glibc's ``malloc_trim(0)``) returns the heap's free pages to the system;
the protocol calls it after every batch, so what a fragmented heap holds but does not use is
given back, and the next batch's tensors still come from the heap, without a fresh mapping each.
The same run peaked at 607 MB at 50k tokens, 798 MB at 500k and 802 MB on the whole corpus
(16647 windows), in 28 s, 223 s and 351 s.

The older bound, a fixed 128 kB threshold (every tensor above it a fresh mapping whose pages the
kernel zeroes on first touch), held the 500k run at 705 MB but took 1.6-2x the time (360 s). It
stays available: ``DCP_LENS_MMAP_THRESHOLD=BYTES`` in the environment fixes the threshold when
`dcp-lens` starts (`limit_heap_fragmentation`); ``DCP_LENS_TRIM=0`` turns the trimming off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Any

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
THRESHOLD_VARIABLE = "DCP_LENS_MMAP_THRESHOLD"
TRIM_VARIABLE = "DCP_LENS_TRIM"


def limit_heap_fragmentation(threshold: int | None = None) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes (no effect elsewhere); None: the value
    of ``$DCP_LENS_MMAP_THRESHOLD`` if set, else nothing is changed; 0: glibc's default.

    Returns:
        True if a threshold was applied (Linux with glibc), False otherwise.

    Raises:
        ValueError: ``$DCP_LENS_MMAP_THRESHOLD`` is not a number of bytes >= 0.
    """
    if threshold is None:
        text = os.environ.get(THRESHOLD_VARIABLE, "").strip()
        if text and not (text.isdigit()):
            raise ValueError(
                f"{THRESHOLD_VARIABLE}={text!r} must be a number of bytes (e.g. 131072; 0 or "
                "unset: glibc's default)."
            )
        threshold = int(text) if text else 0
    libc = _glibc()
    if threshold == 0 or libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))


def fixed_threshold() -> int | None:
    """The mmap threshold ``$DCP_LENS_MMAP_THRESHOLD`` fixes (None: glibc's dynamic default)."""
    text = os.environ.get(THRESHOLD_VARIABLE, "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


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
                library.mallopt, library.malloc_trim  # noqa: B018 (glibc has both; musl not)
                library.malloc_trim.argtypes = (ctypes.c_size_t,)
                library.malloc_trim.restype = ctypes.c_int
            except (OSError, AttributeError):
                library = None
        _LIBC.append(library)
    return _LIBC[0]
