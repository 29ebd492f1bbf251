"""CPU proxies of the real-scale memory bounds. Two Huginn-shaped models scaled down, one heavy
in the vocabulary (d_model 256, vocabulary 32768) and one in the width (d_model 960, vocabulary
4096), r = 8, the trajectory probe on: at every stage of a run the estimate is at or above the
tensors alive at the stage's peak, and within 25% of them; and a run over four times the
evaluation batches peaks, stage by stage, where a run of one batch does (both end on a batch
made of the jackknife's examples, its heaviest).

What is measured is the bytes of tensor storage alive (`RUN`'s `Live`, a dispatch mode that
follows every storage an operation makes until it is freed), less the model's own: what a
device's allocator holds, the quantity the estimate models. The CPU allocator's retention of
freed heap is a term of its own (``allocator_kept``) and is not what these proxies check.

Each run is a process of its own, a few minutes long: ``pytest -m slow
tests/integration/utils/test_memory.py``. ``python tests/integration/utils/test_memory.py``
writes ``docs/data/memory_proxy_probe.json``, which docs/bench.md's table is generated from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
OUTPUT = ROOT / "docs" / "data" / "memory_proxy_probe.json"
# name: (d_model, vocabulary, calibration sequences). The calibration split is long enough that
# every calibration group folds its waiting rows in more than once, as in a real run.
PROXIES = {"vocabulary-heavy": (256, 32768, 640), "width-heavy": (960, 4096, 160)}
SEQ, BATCH, PROBE_POINTS = 32, 4, 96
SIZES = (4, 16)  # evaluation sequences: one batch, four batches
STAGES = (
    "calibration",
    "translator fits",
    "jackknife fits",
    "confidence matching",
    "evaluation",
    "probe",
)
RUN = r"""
import json, sys, weakref
import torch
torch.set_num_threads(1)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
import dcp_lens.protocol.dcp as dcp
import dcp_lens.protocol.fit as fit
from dcp_lens import DepthControlProtocol, EvaluationSet, HookedRecurrentTransformer
from dcp_lens.studies.bench import bench_config

d_model, vocab, n_calibration, n_eval, seq, batch, points = map(int, sys.argv[1:8])
cfg = bench_config("huginn", d_model=d_model, n_iterations=8, d_vocab=vocab, seq=seq)
model = HookedRecurrentTransformer(cfg).eval()
generator = torch.Generator().manual_seed(0)
size = n_calibration * 10 // 9 + 100
pool = EvaluationSet.from_tokens(torch.randint(0, vocab, (size, seq), generator=generator))
keys = pool.example_keys()
chosen = (keys % 10 == 0).nonzero().squeeze(1)[:4]  # the jackknife's examples
others = (keys % 10 != 0).nonzero().squeeze(1)
# The last batch is made of four of the jackknife's examples, the earlier ones of others.
evaluation = EvaluationSet.from_tokens(pool.tokens[torch.cat([others[: n_eval - 4], chosen])])
calibration = EvaluationSet.from_tokens(pool.tokens[others[-n_calibration:]])
protocol = DepthControlProtocol(
    model, batch_size=batch, n_bootstrap=10, probe="trajectory", probe_points=points,
    progress=False,
)
estimate = protocol.estimate(evaluation, calibration)


class Live(TorchDispatchMode):
    # Bytes of the storages alive, each counted once from the operation that made it until
    # its last tensor is freed; the peak since `reset`.
    def __init__(self, known):
        super().__init__()
        self.sizes = {ptr: 0 for ptr in known}
        self.current = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                ptr = storage.data_ptr()
                if ptr and ptr not in self.sizes:
                    self.sizes[ptr] = storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self.free, ptr)
        return out

    def free(self, ptr):
        self.current -= self.sizes.pop(ptr, 0)

    def reset(self):
        self.peak = self.current


model_storages = [t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())]
live = Live(model_storages)
peaks, current = {}, [None]

def enter(stage):
    if current[0] is not None:
        peaks[current[0]] = max(peaks.get(current[0], 0), live.peak)
    live.reset()
    current[0] = stage

def entering(stage, call):
    def entered(*args, **kwargs):
        enter(stage)
        return call(*args, **kwargs)
    return entered

each = protocol.context.each
def staged(items, description):
    yield from each(items, description)
    if description == "calibration":  # the pass is over: its moments are merged, then fitted
        enter("translator fits")
protocol.context.each = staged
protocol._fit = entering("calibration", protocol._fit)
fit._fit_whole = entering("jackknife fits", fit._fit_whole)
protocol.fit_temperatures = entering("confidence matching", protocol.fit_temperatures)
dcp.evaluate_with_noise = entering("evaluation", dcp.evaluate_with_noise)
protocol._probe = entering("probe", protocol._probe)
protocol._decompose = entering("decomposition", protocol._decompose)
with live:
    protocol.run(evaluation, calibration)
enter(None)
print(json.dumps({
    "measured": peaks,
    "weights": sum(p.numel() * p.element_size() for p in model.parameters()),
    "estimates": {stage: estimate.stage_bytes(stage) for stage in estimate.stages},
    "peak_stage": estimate.peak_stage,
}))
"""


def measure(proxy: str, n_eval: int) -> dict[str, object]:
    """One run of ``proxy`` over ``n_eval`` evaluation sequences, in a process of its own."""
    d_model, vocab, n_calibration = PROXIES[proxy]
    # A fixed mmap threshold: no CPU allocator term in the estimate (`release_keep`).
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "DCP_LENS_MMAP_THRESHOLD": "131072",
    }
    argv = [d_model, vocab, n_calibration, n_eval, SEQ, BATCH, PROBE_POINTS]
    done = subprocess.run(
        [sys.executable, "-c", RUN, *map(str, argv)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=1800,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def ratios(run: dict) -> dict[str, float]:
    """Per stage: the estimate less the weights over the tensors alive at the stage's peak."""
    return {
        stage: (run["estimates"][stage] - run["weights"]) / run["measured"][stage]
        for stage in STAGES
    }


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[int, dict]]:
    return {proxy: {n: measure(proxy, n) for n in SIZES} for proxy in PROXIES}


@pytest.mark.slow
@pytest.mark.parametrize("proxy", PROXIES)
def test_every_stage_estimate_is_at_or_above_its_peak_and_within_a_quarter(runs, proxy) -> None:
    for n, run in runs[proxy].items():
        for stage, ratio in ratios(run).items():
            assert 1.0 <= ratio <= 1.25, (proxy, n, stage, ratio)


@pytest.mark.slow
@pytest.mark.parametrize("proxy", PROXIES)
def test_four_times_the_evaluation_batches_peak_where_one_batch_does(runs, proxy) -> None:
    small, large = runs[proxy][SIZES[0]]["measured"], runs[proxy][SIZES[1]]["measured"]
    for stage in STAGES:
        assert large[stage] <= 1.10 * small[stage], (proxy, stage, large[stage], small[stage])


def committed_estimates(proxy: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Each stage's estimate of ``proxy``'s run from today's memory model, as `RUN` asks it
    (the model built on the CPU, where the run was: the device decides what is held where)."""
    import torch

    from dcp_lens import DepthControlProtocol, EvaluationSet, HookedRecurrentTransformer
    from dcp_lens.studies.bench import bench_config

    monkeypatch.setenv("DCP_LENS_MMAP_THRESHOLD", "131072")
    d_model, vocab, _ = PROXIES[proxy]
    cfg = bench_config("huginn", d_model=d_model, n_iterations=8, d_vocab=vocab, seq=SEQ)
    model = HookedRecurrentTransformer(cfg)
    protocol = DepthControlProtocol(
        model, batch_size=BATCH, n_bootstrap=10, probe="trajectory", probe_points=PROBE_POINTS
    )
    data = EvaluationSet.from_tokens(torch.zeros(BATCH, SEQ, dtype=torch.long))
    estimate = protocol.context.estimate_at(BATCH, SEQ, None)
    assert estimate.plan == protocol.context.readout_plan(data)
    return {stage: estimate.stage_bytes(stage) for stage in estimate.stages}


@pytest.mark.parametrize("proxy", PROXIES)
def test_the_committed_measurements_hold_against_todays_estimate(proxy, monkeypatch) -> None:
    """``docs/data/memory_proxy_probe.json`` (what `main` measured) against today's memory
    model: the estimates it recorded are today's, every stage's within [1, 1.25] of the tensors
    alive at its peak, and four batches peak where one does."""
    record = json.loads(OUTPUT.read_text())
    today = committed_estimates(proxy, monkeypatch)
    runs = record["runs"][proxy]
    for n, run in runs.items():
        assert run["estimates"] == today, (proxy, n)
        for stage, ratio in ratios(run).items():
            assert 1.0 <= ratio <= 1.25, (proxy, n, stage, ratio)
    small, large = (runs[str(n)]["measured"] for n in SIZES)
    for stage in STAGES:
        assert large[stage] <= 1.10 * small[stage], (proxy, stage)


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


def main() -> None:
    """Measure every proxy at both sizes and write `OUTPUT`."""
    from concurrent.futures import ThreadPoolExecutor

    cases = [(proxy, n) for proxy in PROXIES for n in SIZES]
    with ThreadPoolExecutor(2) as pool:  # each run is a process of its own
        done = dict(zip(cases, pool.map(lambda case: measure(*case), cases), strict=True))
    measured = {proxy: {str(n): done[proxy, n] for n in SIZES} for proxy in PROXIES}
    record = {
        "command": "python tests/integration/utils/test_memory.py (its RUN script, one process "
        "per proxy and size, OMP_NUM_THREADS=1, DCP_LENS_MMAP_THRESHOLD=131072)",
        "measure": "bytes of tensor storage alive at the stage's peak, less the model's own",
        "proxies": {
            proxy: {"d_model": d, "d_vocab": v, "calibration_sequences": c}
            for proxy, (d, v, c) in PROXIES.items()
        },
        "settings": {
            "n_iterations": 8,
            "seq": SEQ,
            "batch_size": BATCH,
            "probe": "trajectory",
            "probe_points": PROBE_POINTS,
            "n_bootstrap": 10,
        },
        "stages": list(STAGES),
        "runs": measured,
    }
    OUTPUT.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
