"""The real-scale acceptance run behind demos/gpu_check.sh: on one device, the chip's matrix
rate, the Huginn-shaped forward's tokens per second and its share of that rate, and a default
DCP run (`DepthControlProtocol` with its defaults: probe, 1000 draws, 10 calibration groups) of
N + N sequences with per-stage times, peak memory beside the estimate, and seconds per million
tokens. Writes one JSON object to OUT/gpu_check.json.

    python demos/gpu_check.py OUT [--device cuda] [--n 512] [--seq 1024] [--batch-size 8]

Toy sizes (``--d-model 96 --iterations 2 --vocab 128 --seq 8 --n 8 --matmul 128``) run the
same steps on a CPU (tests/acceptance/test_demos.py does).
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path
from typing import Any

import torch

import dcp_lens.protocol.dcp as dcp
from dcp_lens import DepthControlProtocol, EvaluationSet, HookedRecurrentTransformer
from dcp_lens.studies.bench import bench_config


def synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matrix_rate(n: int, dtype: torch.dtype, device: torch.device, repeats: int = 5) -> float:
    """FLOP/s of an n x n x n product in ``dtype``: the best of ``repeats``."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        synchronise(device)
        start = time.perf_counter()
        a @ b
        synchronise(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def forward_flops_per_token(model: HookedRecurrentTransformer, seq: int) -> float:
    """Matrix-product FLOPs of one token's forward: twice the weights each block application
    and the unembedding multiply, plus causal attention's scores and mixing."""
    cfg = model.cfg
    applied = cfg.n_prelude + cfg.n_core * int(model.n_iterations) + cfg.n_coda
    block = sum(p.numel() for p in model.blocks[0].parameters() if p.ndim > 1)
    attention = 2 * 2 * cfg.n_heads * cfg.d_head * seq / 2  # scores and mixing, causal half
    return 2.0 * (applied * block + cfg.d_model * cfg.d_vocab) + applied * attention


def peak_memory(device: torch.device) -> float:
    """Peak bytes: allocated on a GPU, the process's peak resident size on a CPU."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM"):
            return float(line.split()[1]) * 1024
    return float("nan")


def timed_stages() -> dict[str, float]:
    """Wrap the protocol's stages so that each records its seconds (device-synchronised)."""
    seconds: dict[str, float] = {}

    def wrap(owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = original(*args, **kwargs)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            seconds[label] = seconds.get(label, 0.0) + time.perf_counter() - start
            return out

        setattr(owner, name, timed)

    wrap(dcp, "fit_maps", "calibration (maps, translators, jackknife refits)")
    wrap(dcp.DepthControlProtocol, "fit_temperatures", "confidence matching")
    wrap(dcp, "evaluate_with_noise", "evaluation (every condition at every k)")
    wrap(dcp.DepthControlProtocol, "_probe", "probe")
    wrap(dcp.DepthControlProtocol, "_decompose", "decomposition and bootstrap")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--n", type=int, default=512, help="evaluation and calibration sequences")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--d-model", type=int)
    parser.add_argument("--iterations", type=int, default=32)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--matmul", type=int, default=8192, help="n of the n^3 rate product")
    parser.add_argument("--forward-repeats", type=int, default=3)
    parser.add_argument("--n-bootstrap", type=int, help="bootstrap draws (default: the protocol's)")
    parser.add_argument("--probe", help="the probe (default: the protocol's, trajectory)")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    # TF32 as `dcp-lens run` has it (PyTorch's default, off): the run measured is the one used.
    out: dict[str, Any] = {
        "device": str(device),
        "dtype": args.dtype,
        "torch": torch.__version__,
        "tf32": bool(torch.backends.cuda.matmul.allow_tf32),
    }
    if device.type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(device)
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every stage: a run cut short keeps what it measured
        (args.out / "gpu_check.json").write_text(json.dumps(out, indent=2, default=str) + "\n")

    rate = matrix_rate(args.matmul, dtype, device)
    out["matmul"] = {"n": args.matmul, "tflops": rate / 1e12}
    save()

    cfg = bench_config(
        "huginn",
        d_model=args.d_model,
        n_iterations=args.iterations,
        d_vocab=args.vocab,
        seq=args.seq,
    )
    model = HookedRecurrentTransformer(cfg).to(device=device, dtype=dtype).eval()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.d_vocab, (2 * args.n, args.seq), generator=generator)
    batch = tokens[: args.batch_size].to(device)
    with torch.no_grad():
        model(batch)
        best = float("inf")
        for _ in range(args.forward_repeats):
            synchronise(device)
            start = time.perf_counter()
            model(batch)
            synchronise(device)
            best = min(best, time.perf_counter() - start)
    per_second = batch.numel() / best
    flops = forward_flops_per_token(model, args.seq)
    out["forward"] = {
        "batch": args.batch_size,
        "seq": args.seq,
        "n_iterations": int(model.n_iterations),
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokens_per_second": per_second,
        "gflop_per_token": flops / 1e9,
        "share_of_matmul_rate": per_second * flops / rate,
    }
    save()

    evaluation = EvaluationSet.from_tokens(tokens[: args.n])
    calibration = EvaluationSet.from_tokens(tokens[args.n :])
    overrides = {
        name: value
        for name, value in (("n_bootstrap", args.n_bootstrap), ("probe", args.probe))
        if value is not None
    }
    protocol = DepthControlProtocol(model, batch_size=args.batch_size, progress=False, **overrides)
    estimate = protocol.estimate(evaluation, calibration)
    out["estimate"] = estimate.to_dict()
    save()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = timed_stages()
    start = time.perf_counter()
    results = protocol.run(evaluation, calibration)
    total = time.perf_counter() - start
    n_tokens = 2 * args.n * args.seq
    out["run"] = {
        "sequences": [args.n, args.n],
        "seq": args.seq,
        "batch_size": args.batch_size,
        "k_grid": list(protocol.context.k_grid),
        "settings": protocol.config.to_dict(),
        "seconds": total,
        "stage_seconds": seconds,
        "seconds_per_million_tokens": total * 1e6 / n_tokens,
        "peak_memory_gib": peak_memory(device) / 2**30,
        "estimated_peak_gib": estimate.peak_bytes / 2**30,
        "estimated_peak_stage": estimate.peak_stage,
        "peak_host_memory_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "estimated_host_gib": estimate.host_bytes / 2**30,
        "estimate": estimate.to_dict(),
        "verdicts": {
            m: (d.bracket_shares or {}).get("verdict") for m, d in results.decompositions.items()
        },
    }
    save()
    run = out["run"]
    print(f"matrix rate ({args.dtype}, {args.matmul}^3): {rate / 1e12:.1f} TFLOP/s")
    print(
        f"forward: {per_second:,.0f} tokens/s, {out['forward']['share_of_matmul_rate']:.0%} of "
        "that rate"
    )
    print(
        f"DCP run {args.n} + {args.n} x {args.seq}: {total:.1f} s "
        f"({run['seconds_per_million_tokens']:.1f} s per 1M tokens), peak "
        f"{run['peak_memory_gib']:.2f} GiB (estimated {run['estimated_peak_gib']:.2f} GiB), "
        f"host {run['peak_host_memory_gib']:.2f} GiB (estimated beside it: "
        f"{run['estimated_host_gib']:.2f} GiB)"
    )
    for stage, value in seconds.items():
        print(f"  {stage}: {value:.1f} s")


if __name__ == "__main__":
    main()
