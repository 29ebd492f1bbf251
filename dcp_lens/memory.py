"""Keep peak memory set by the batch: the allocator setting `dcp-lens` applies at start.

glibc's malloc serves a request of at least ``M_MMAP_THRESHOLD`` bytes with its own mmap, returned
to the system on free. The threshold is dynamic by default: each large block freed raises it (up
to 32 MB), so the sweep's per-batch tensors of a few hundred kB to a few MB then come from the
heap, and the heap fragments and grows with the number of batches (issue 13 measured +4.6 GB at
4096 sequences). Fixing the threshold keeps those tensors on mmap, so freed batches return their
memory; `MALLOC_MMAP_THRESHOLD_` does the same but only when set before the process starts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 128 * 1024


def limit_heap_fragmentation(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes (no effect elsewhere).

    Returns:
        True if the setting was applied (Linux with glibc), False otherwise.
    """
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))
