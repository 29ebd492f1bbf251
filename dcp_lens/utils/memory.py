"""Keep peak memory set by the batch, not by the number of batches, at the speed of the heap.

glibc's malloc serves a request of at least ``M_MMAP_THRESHOLD`` bytes with its own mmap, returned
to the system on free; smaller ones come from the heap. By default the threshold is dynamic (each
large block freed raises it, up to 32 MB), and so is the trimming of the heap's top. Left so, a
DCP sweep's per-batch tensors come from a heap that fragments, so that what it holds grows with
the number of batches, and tensors freed and allocated again are often unmapped and faulted in
afresh.

`dcp-lens` therefore, when it starts (`limit_heap_fragmentation`), fixes the mmap threshold at its
largest (32 MB) and the heap's automatic trimming at 512 MB, so that within a batch freed tensors
are reused, and the protocol calls `release_free_memory` after every batch: once the heap holds
more than `TRIM_KEEP_BYTES` (256 MB) free, glibc's ``malloc_trim(0)`` returns its free pages,
fragmented or not. Below that the pages stay for the next batch: trimming after every batch makes
the kernel fault and zero them again each time, which costs time for little memory (the
measurements are in docs/models.md).

A fixed small threshold (every tensor above it a fresh mapping whose pages the kernel zeroes on
first touch) bounds memory too, but slowly. It stays available:
``DCP_LENS_MMAP_THRESHOLD=BYTES`` fixes that threshold instead; ``DCP_LENS_TRIM_KEEP=BYTES`` sets
the free heap kept (0: trim after every batch); ``DCP_LENS_TRIM=0`` turns the trimming off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter numbers
M_TRIM_THRESHOLD = -1
MMAP_THRESHOLD_MAX = 32 * 1024 * 1024  # glibc's largest on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD_BYTES = 512 * 1024 * 1024
THRESHOLD_VARIABLE = "DCP_LENS_MMAP_THRESHOLD"
TRIM_VARIABLE = "DCP_LENS_TRIM"
KEEP_VARIABLE = "DCP_LENS_TRIM_KEEP"
# Free heap left untrimmed between batches: about two batches' temporaries of a `dcp-lens bench`
# sweep (80-130 MB), so that a sweep's next batch reuses pages rather than faulting them in.
TRIM_KEEP_BYTES = 256 * 1024 * 1024


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
    threshold = _bytes_variable(
        THRESHOLD_VARIABLE, 0, "(e.g. 131072; 0 or unset: the default setting)"
    )
    return threshold if threshold > 0 else None


def release_free_memory(keep: int | None = None) -> bool:
    """Return the heap's free pages to the system (glibc's ``malloc_trim(0)``) once the heap
    holds more than ``keep`` free bytes, so that a loop over batches keeps peak memory set by
    one batch even when its heap fragments. Below ``keep`` the free pages stay for the next
    batch's tensors: trimming them would only have the kernel map and zero them again.

    ``keep``: None reads ``$DCP_LENS_TRIM_KEEP`` (bytes; default `TRIM_KEEP_BYTES`; 0 trims
    after every batch). No effect where there is no glibc, or with ``$DCP_LENS_TRIM=0``; where
    glibc cannot report its free bytes (before 2.33) it trims every time. Returns whether it
    trimmed.

    Raises:
        ValueError: ``$DCP_LENS_TRIM_KEEP`` is not a number of bytes >= 0.
    """
    keep = release_keep() if keep is None else keep
    libc = None if os.environ.get(TRIM_VARIABLE, "1").strip() == "0" else _glibc()
    if libc is None:
        return False
    free = free_heap_bytes()
    if free is not None and free <= keep:
        return False
    libc.malloc_trim(0)
    return True


def release_keep() -> int:
    """The free heap `release_free_memory` keeps by default, in bytes: ``$DCP_LENS_TRIM_KEEP``,
    else `TRIM_KEEP_BYTES`.

    Raises:
        ValueError: the variable is not a number of bytes >= 0.
    """
    return _bytes_variable(KEEP_VARIABLE, TRIM_KEEP_BYTES, "(e.g. 0: trim after every batch)")


def free_heap_bytes() -> int | None:
    """Free bytes the heap holds (glibc's ``mallinfo2().fordblks``, over every arena); None
    where glibc is missing or older than 2.33."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    return int(libc.mallinfo2().fordblks)


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _bytes_variable(name: str, default: int, example: str) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit():
        raise ValueError(f"{name}={text!r} must be a number of bytes {example}.")
    return int(text)


_LIBC: list[ctypes.CDLL | None] = []  # [the C library] once looked up; [None] where it is not glibc


def _glibc() -> ctypes.CDLL | None:
    if not _LIBC:
        library = None
        if sys.platform.startswith("linux"):
            try:
                library = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                library.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)  # musl has no mallopt
                library.mallopt.restype = ctypes.c_int
                library.malloc_trim.argtypes = (ctypes.c_size_t,)
                library.malloc_trim.restype = ctypes.c_int
                if hasattr(library, "mallinfo2"):  # glibc >= 2.33
                    library.mallinfo2.restype = _MallInfo2
            except (OSError, AttributeError):
                library = None
        _LIBC.append(library)
    return _LIBC[0]


def physical_memory_bytes() -> int | None:
    """This machine's physical memory in bytes, or None where the system does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def available_memory_bytes() -> int | None:
    """Memory this machine can give a process now (``MemAvailable`` of ``/proc/meminfo``), or
    its physical memory where that file is missing; None where neither is known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return physical_memory_bytes()


def annotated(result: dict[str, object]) -> dict[str, object]:
    """A benchmark's ``result`` with the allocator setting it ran under (``"allocator"``)."""
    threshold = fixed_threshold()
    result["allocator"] = (
        f"as in run: glibc's, mmap threshold {MMAP_THRESHOLD_MAX >> 20} MB, free heap past "
        f"{release_keep() >> 20} MB returned after each batch"
        if threshold is None
        else f"fixed {threshold}-byte mmap threshold ($DCP_LENS_MMAP_THRESHOLD)"
    )
    return result
