"""The benchmark's memory: what a process or a GPU holds now and at its peak, a lower bound on a
benchmark's peak before it runs, and a device's total memory."""

from __future__ import annotations

import os
import resource

import torch


def memory_now(device: torch.device) -> float:
    """Memory held now, MB: CUDA allocated, or the process's resident set."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device) / 2**20
    return _proc_status_mb("VmRSS") or 0.0


def reset_peak(device: torch.device) -> None:
    """Start a new peak: CUDA's counter, or the kernel's resident high-water mark."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass


def peak_memory(device: torch.device) -> tuple[float, float]:
    """(the process's peak so far, the peak since `reset_peak`), MB. Without a resettable
    high-water mark both are the process's peak (an upper bound on the sweep's)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
        return peak, peak
    process = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return process, _proc_status_mb("VmHWM") or process


def _proc_status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def bench_bytes(
    batch: int,
    seq: int,
    n_heads: int,
    d_model: int,
    n_blocks: int,
    *,
    element: int = 4,
    d_vocab: int = 0,
    n_weights: int = 0,
) -> int:
    """A lower bound on the peak memory of `run_bench`, in bytes: the weights, one attention
    score tensor and its softmax [batch, heads, seq, seq] and the cached states of every block
    [blocks + 1, batch, seq, d_model] for the evaluation and calibration halves (all in the
    compute dtype, ``element`` bytes each), and one readout's float32 logits and
    log-probabilities [batch, seq, d_vocab]."""
    scores = 2 * batch * n_heads * seq * seq
    states = (n_blocks + 1) * batch * seq * d_model
    logits = 2 * 4 * batch * seq * d_vocab
    return element * (2 * (scores + states) + n_weights) + logits


def total_device_bytes(device: torch.device) -> int | None:
    """Total memory of ``device`` (physical memory for the CPU), or None when unknown."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    return None
