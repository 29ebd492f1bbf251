"""The memory estimate's host side: on an accelerator the calibration groups not being filled
wait on the host in float32, printed beside the device's peak; on the CPU nothing is apart."""

from __future__ import annotations

from dcp_lens.protocol.budget import GIB, ModelShape, estimate_run_memory

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
    scatter = 4 * (5280 * 5280 + 3 * 5280)  # one group's float32 scatter and vectors
    assert gpu.host == {"parked_groups": 17 * 9 * scatter}
    assert 15.0 < gpu.host_bytes / GIB < 17.0
    assert "host memory beside it: 15.90 GiB" in gpu.table()
    assert gpu.to_dict()["host_total_gib"] == gpu.host_bytes / GIB


def test_nothing_is_apart_on_the_cpu_or_without_the_jackknife() -> None:
    assert _estimate("cpu").host_bytes == 0
    assert _estimate("cuda", groups=0).host_bytes == 0
    assert "host memory beside it: 0.00 GiB (none)" in _estimate("cpu").table()
