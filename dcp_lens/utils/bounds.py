"""Bounds on every size a flag or a file sets, checked before anything of that size is
allocated: counts past these are typos, not runs, and a count that fits the bound but not this
machine's memory (`dcp_lens.utils.memory`) is refused with what it would need."""

from __future__ import annotations

import os

from dcp_lens.utils.errors import ResourceLimitError
from dcp_lens.utils.memory import available_memory_bytes, physical_memory_bytes

MAX_SEQUENCES = 1 << 22  # --n-eval, --n-calibration
MAX_STEPS = 10_000_000  # train --steps: far past every preset, far below a loop of years
MAX_THREADS = 1024
MAX_COVERAGE = 10_000  # validate --coverage replicates: each is a protocol run per model
MAX_LINE_BYTES = 64 << 20  # one line of a .jsonl or text corpus read with --max-tokens


def check_threads(threads: int | None) -> None:
    cores = os.cpu_count() or 1
    if threads is not None and threads > max(MAX_THREADS, cores):
        raise ResourceLimitError(
            f"--threads {threads} is more than this machine can run ({cores} CPUs; at most "
            f"{max(MAX_THREADS, cores)}); pass at most {cores}."
        )


def check_steps(steps: int | None) -> None:
    if steps is not None and steps > MAX_STEPS:
        raise ResourceLimitError(
            f"--steps {steps} is past dcp-lens's bound of {MAX_STEPS:,} training steps (years "
            "on this machine); pass a number of steps a run can finish."
        )


def check_coverage(replicates: int | None) -> None:
    if replicates is not None and replicates > MAX_COVERAGE:
        raise ResourceLimitError(
            f"--coverage {replicates} is past dcp-lens's bound of {MAX_COVERAGE:,} replicates "
            "(each a protocol run per model); pass fewer (100 measures coverage to +-4%)."
        )


def check_sequences(n_eval: int | None, n_calibration: int | None, seq_len: int | None) -> None:
    """--n-eval and --n-calibration: the bound, then their tokens and targets (int64) against
    half of this machine's memory."""
    counts = {"--n-eval": n_eval, "--n-calibration": n_calibration}
    for flag, count in counts.items():
        if count is not None and count > MAX_SEQUENCES:
            raise ResourceLimitError(
                f"{flag} {count} is past dcp-lens's bound of {MAX_SEQUENCES:,} sequences; pass "
                "fewer (512 is the default)."
            )
    total = sum(count for count in counts.values() if count is not None)
    check_allocation(
        total * (seq_len or 128) * 8 * 2, f"--n-eval and --n-calibration ({total:,} sequences)"
    )


def check_allocation(needed: int, what: str, fix: str = "pass fewer or smaller") -> None:
    """Refuse ``what`` if its ``needed`` bytes exceed half of this machine's physical memory
    or all of what is available now."""
    physical, available = physical_memory_bytes(), available_memory_bytes()
    limit = min(x for x in (physical and physical // 2, available, 1 << 62) if x)
    if needed > limit:
        raise ResourceLimitError(
            f"{what} need about {needed / 2**30:.1f} GiB, more than this machine can give "
            f"({limit / 2**30:.1f} GiB: half its memory, or what is free); {fix}."
        )


__all__ = [
    "MAX_COVERAGE",
    "MAX_LINE_BYTES",
    "MAX_SEQUENCES",
    "check_allocation",
    "check_coverage",
    "check_sequences",
    "check_steps",
    "check_threads",
]
