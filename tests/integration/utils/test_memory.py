"""CPU proxies of the real-scale memory bounds, on a Huginn-shaped model scaled down (d_model
256, r = 8, vocabulary 32768): a run over four times the evaluation batches, one of them full
of the jackknife's examples, peaks where the one-batch run does; the estimate is within 25% of
the measured peak. Each run is its own process, its peak read from the kernel (VmHWM)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
RUN = r"""
import json, sys, torch
torch.set_num_threads(1)
from dcp_lens.utils.memory import limit_heap_fragmentation
limit_heap_fragmentation()
import dcp_lens.protocol.dcp as dcp
from dcp_lens import DepthControlProtocol, EvaluationSet, HookedRecurrentTransformer
from dcp_lens.studies.bench import bench_config

def resident(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

n_eval, seq = int(sys.argv[1]), 32
cfg = bench_config("huginn", d_model=256, n_iterations=8, d_vocab=32768, seq=seq)
model = HookedRecurrentTransformer(cfg).eval()
generator = torch.Generator().manual_seed(0)
pool = EvaluationSet.from_tokens(torch.randint(0, cfg.d_vocab, (400, seq), generator=generator))
keys = pool.example_keys()
chosen = (keys % 10 == 0).nonzero().squeeze(1)[:4]  # the jackknife's examples
others = (keys % 10 != 0).nonzero().squeeze(1)
# The small set: one batch; the large: four, the last made of four of the jackknife's examples.
rows = others[:n_eval] if n_eval == 4 else torch.cat([others[: n_eval - 4], chosen])
evaluation = EvaluationSet.from_tokens(pool.tokens[rows])
calibration = EvaluationSet.from_tokens(pool.tokens[others[-16:]])
protocol = DepthControlProtocol(
    model, batch_size=4, n_bootstrap=10, probe="trajectory", progress=False
)
estimate = protocol.estimate(evaluation, calibration)
protocol.run(evaluation, calibration)  # every module the run imports, loaded before measuring

# The peak above the baseline of each stage: VmHWM reset as a stage starts, read as it ends.
peaks, current = {}, [None]

def enter(stage):
    if current[0] is not None:
        peaks[current[0]] = max(peaks.get(current[0], 0), resident("VmHWM") - baseline)
    with open("/proc/self/clear_refs", "w") as file:
        file.write("5")
    current[0] = stage

def entering(stage, call):
    def entered(*args, **kwargs):
        enter(stage)
        return call(*args, **kwargs)
    return entered

each = protocol.context.each
def staged(items, description):
    yield from each(items, description)
    if description == "calibration":
        enter("jackknife fits")
protocol.context.each = staged
protocol._fit = entering("calibration", protocol._fit)
protocol.fit_temperatures = entering("confidence matching", protocol.fit_temperatures)
dcp.evaluate_with_noise = entering("evaluation", dcp.evaluate_with_noise)
protocol._probe = entering("probe", protocol._probe)
protocol._decompose = entering("decomposition", protocol._decompose)
with open("/proc/self/clear_refs", "w") as file:
    file.write("5")  # the peak (VmHWM) from here
baseline = resident("VmRSS")
protocol.run(evaluation, calibration)
enter(None)
weights = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({
    "above_baseline": max(peaks.values()),
    "stages_above_baseline": peaks,
    "weights": weights,
    "estimate": estimate.peak_bytes,
    "stage": estimate.peak_stage,
    "stage_estimates": {stage: estimate.stage_bytes(stage) for stage in estimate.stages},
}))
"""


def _measured(n_eval: int) -> dict[str, float]:
    # A fixed mmap threshold: every tensor its own mapping, so the resident size follows the
    # tensors alive rather than what the heap keeps (`dcp_lens.utils.memory`).
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "DCP_LENS_MMAP_THRESHOLD": "131072",
    }
    done = subprocess.run(
        [sys.executable, "-c", RUN, str(n_eval)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs() -> dict[int, dict[str, float]]:
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak resident size")
    return {n: _measured(n) for n in (4, 16)}


def test_four_times_the_evaluation_batches_peak_where_one_batch_does(runs) -> None:
    small, large = runs[4]["above_baseline"], runs[16]["above_baseline"]
    assert large <= 1.10 * small, (
        f"peak above baseline {large / 2**20:.0f} MB vs {small / 2**20:.0f} MB"
    )


def test_the_estimate_is_within_a_quarter_of_the_measured_peak(runs) -> None:
    for measured in runs.values():
        # The baseline holds the weights: the estimate's peak less them is the run's own.
        own = measured["estimate"] - measured["weights"]
        assert abs(own - measured["above_baseline"]) <= 0.25 * measured["above_baseline"], measured


def test_the_estimate_at_huginn_shape_fits_one_80_gb_gpu() -> None:
    """The default run of 512 + 512 sequences x 1024 tokens at Huginn-0125's shape (bfloat16,
    batches of 8, the default k grid and 10 calibration groups): at most 60 GiB at its peak, and
    on an accelerator the fit's moments within 8 GiB (one calibration group on the device)."""
    import torch

    from dcp_lens import HookedRecurrentTransformer
    from dcp_lens.protocol.budget import GIB, ModelShape, estimate_run_memory
    from dcp_lens.studies.bench import bench_config
    from dcp_lens.studies.bench_work import run_estimate

    estimate = run_estimate("huginn", batch=8, dtype="bfloat16")
    assert estimate["peak_gib"] <= 60.0, estimate["table"]
    assert estimate["terms_gib"]["moments"] <= 8.0, estimate["table"]
    # On the CPU (the host is the device) every group's moments count.
    with torch.device("meta"):
        model = HookedRecurrentTransformer(bench_config("huginn")).to(torch.bfloat16)
    cpu = estimate_run_memory(
        ModelShape.of(model),
        batch_size=8,
        seq_len=1024,
        n_streams=17,
        calibration_groups=10,
        device_type="cpu",
    )
    assert cpu.terms["moments"] / GIB > 4 * estimate["terms_gib"]["moments"]
