"""The memory estimate's host side: on an accelerator the calibration groups not being filled
wait on the host in float32, printed beside the device's peak; on the CPU nothing is apart."""

from __future__ import annotations

import weakref

import pytest
import torch

import dcp_lens.protocol.budget as budget_module
from dcp_lens.protocol.budget import (
    GIB,
    ModelShape,
    OutOfMemoryStop,
    estimate_run_memory,
    in_smaller_chunks,
)

HUGINN = ModelShape(5280, 65536, 17920, 32, 3_564_976_800, 2, 55)


def _estimate(device_type: str, groups: int = 10):
    return estimate_run_memory(
        HUGINN,
        batch_size=8,
        seq_len=1024,
        n_streams=17,
        calibration_groups=groups,
        readout_rows=4096,
        device_type=device_type,
    )


def test_parked_groups_are_host_memory_beside_the_devices_peak() -> None:
    gpu = _estimate("cuda")
    # One group's float32 scatter and vectors, each in a pinned block of the next power of two.
    scatter = 2**27 + 3 * 2**15
    assert 4 * 5280 * 5280 <= 2**27 < 8 * 5280 * 5280 and 4 * 5280 <= 2**15
    assert gpu.host == {"parked_groups": 17 * 9 * scatter}
    assert 19.0 < gpu.host_bytes / GIB < 20.0
    assert "host memory beside it: 19.14 GiB" in gpu.table()
    assert gpu.to_dict()["host_total_gib"] == gpu.host_bytes / GIB


def test_nothing_is_apart_on_the_cpu_or_without_the_jackknife() -> None:
    assert _estimate("cpu").host_bytes == 0
    assert _estimate("cuda", groups=0).host_bytes == 0
    assert "host memory beside it: 0.00 GiB (none)" in _estimate("cpu").table()


def test_a_retry_drops_the_failed_chunks_tensors_before_emptying_the_cache(monkeypatch) -> None:
    held: list[weakref.ref] = []
    alive_at_release: list[bool] = []
    monkeypatch.setattr(
        budget_module,
        "release_device_memory",
        lambda device: alive_at_release.append(any(ref() is not None for ref in held)),
    )

    def attempt(rows: int) -> int:
        chunk = torch.ones(rows, 8)  # what a chunk's readout would hold
        held.append(weakref.ref(chunk))
        if rows > 2:
            raise torch.OutOfMemoryError("simulated: out of memory")
        return int(chunk.sum())

    def halved(rows: int) -> int | None:
        return rows // 2 if rows > 1 else None

    result, fitted = in_smaller_chunks(attempt, 16, halved, torch.device("cpu"), str)
    assert (result, fitted) == (16, 2)
    assert alive_at_release == [False, False, False]  # 16, 8 and 4 rows failed, each dropped
    with pytest.raises(OutOfMemoryStop, match="stop at 1") as stop:
        in_smaller_chunks(
            lambda rows: attempt(rows + 8), 2, halved, torch.device("cpu"), "stop at {}".format
        )
    assert isinstance(stop.value.__cause__, torch.OutOfMemoryError)
    assert not any(alive_at_release)
