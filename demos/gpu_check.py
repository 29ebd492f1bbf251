"""The real-scale acceptance run behind demos/gpu_check.sh: on one device, the chip's matrix
rate, the Huginn-shaped forward's tokens per second and its share of that rate, and a default
DCP run (`DepthControlProtocol` with its defaults: probe, 1000 draws, 10 calibration groups) of
N + N sequences metered by stage (calibration pass, refits, confidence matching, evaluation,
probe, decomposition and bootstrap): forwards per token as `dcp-lens bench --count` counts them,
wall seconds, synchronisations per batch, peak device and host memory beside the estimate, and
seconds per million tokens. Writes OUT/gpu_check.json after every step and every stage, so that
a run cut short keeps what it measured.

    python demos/gpu_check.py OUT [--device cuda] [--n 128] [--seq 1024] [--batch-size 8] [--tf32]

The default N is sized to finish within 8 minutes on one H100 or H200 (docs/bench.md). TF32 is
off unless ``--tf32`` is given, as `dcp-lens run` leaves it. Toy sizes (``--d-model 96
--iterations 2 --vocab 128 --seq 8 --n 8 --matmul 128``) run the same steps on a CPU
(tests/acceptance/test_demos.py does).
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import dcp_lens.protocol.dcp as dcp
from dcp_lens import DepthControlProtocol, EvaluationSet, HookedRecurrentTransformer
from dcp_lens.studies.bench import bench_config
from dcp_lens.studies.bench_work import (
    WORK_STAGES,
    StageMeter,
    UnitCosts,
    WorkCount,
    forward_macs_per_token,
)


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


def metered_run(
    protocol: DepthControlProtocol,
    evaluation: EvaluationSet,
    calibration: EvaluationSet,
    on_stage: Callable[[dict[str, Any]], None],
) -> tuple[Any, dict[str, Any]]:
    """``protocol.run`` with each stage metered (`StageMeter`: the work counted as
    ``dcp-lens bench --count`` counts it, wall time, synchronisations); ``on_stage`` gets what
    is measured so far after every stage. The results and the last measurement come back."""
    model = protocol.model
    count = WorkCount()
    count.tokens = {
        stage: (evaluation if stage in ("evaluation", "probe") else calibration).tokens.numel()
        for stage in WORK_STAGES
    }
    costs = UnitCosts.of(model)
    forward = forward_macs_per_token(
        model, evaluation.tokens[:1].to(protocol.context.device()), costs
    )

    def measured(summary: dict[str, Any]) -> None:
        on_stage({**summary, "forwards_per_token": count.forwards_per_token(costs, forward)})

    meter = StageMeter(protocol, count, measured)

    def entering(stage: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def entered(*args: Any, **kwargs: Any) -> Any:
            meter.enter(stage)
            return call(*args, **kwargs)

        return entered

    evaluate = dcp.evaluate_with_noise
    protocol._fit = entering("calibration pass", protocol._fit)  # type: ignore[method-assign]
    protocol.fit_temperatures = entering(  # type: ignore[method-assign]
        "confidence matching", protocol.fit_temperatures
    )
    protocol._probe = entering("probe", protocol._probe)  # type: ignore[method-assign]
    protocol._decompose = entering(  # type: ignore[method-assign]
        "decomposition and bootstrap", protocol._decompose
    )
    dcp.evaluate_with_noise = entering("evaluation", evaluate)  # type: ignore[assignment]
    try:
        with meter.metering():
            results = protocol.run(evaluation, calibration)
    finally:
        dcp.evaluate_with_noise = evaluate  # type: ignore[assignment]
        for name in ("_fit", "fit_temperatures", "_probe", "_decompose"):
            delattr(protocol, name)
    return results, {
        **meter.summary(),
        "forwards_per_token": count.forwards_per_token(costs, forward),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--n",
        type=int,
        default=128,
        help="evaluation and calibration sequences (default sized to finish in 8 minutes on one "
        "H100 or H200: docs/bench.md)",
    )
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--d-model", type=int)
    parser.add_argument("--iterations", type=int, default=32)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--matmul", type=int, default=8192, help="n of the n^3 rate product")
    parser.add_argument("--forward-repeats", type=int, default=3)
    parser.add_argument("--n-bootstrap", type=int, help="bootstrap draws (default: the protocol's)")
    parser.add_argument("--probe", help="the probe (default: the protocol's, trajectory)")
    parser.add_argument(
        "--tf32",
        action="store_true",
        help="allow TF32 in float32 matrix products (default off, as `dcp-lens run` leaves it)",
    )
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    # TF32 off unless asked for, as `dcp-lens run` has it (PyTorch's default): the run measured
    # is the one used.
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
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
    n_tokens = 2 * args.n * args.seq
    out["run"] = {
        "sequences": [args.n, args.n],
        "seq": args.seq,
        "batch_size": args.batch_size,
        "k_grid": list(protocol.context.k_grid),
        "settings": protocol.config.to_dict(),
        "estimated_peak_gib": estimate.peak_bytes / 2**30,
        "estimated_peak_stage": estimate.peak_stage,
        "estimated_host_gib": estimate.host_bytes / 2**30,
        "estimate": estimate.to_dict(),
    }
    start = time.perf_counter()

    def stage_done(measured: dict[str, Any]) -> None:  # the JSON after every stage
        out["run"].update(
            stages_done=list(measured["seconds"]),
            stage_seconds=measured["seconds"],
            forwards_per_token=measured["forwards_per_token"],
            syncs_per_batch=measured["syncs_per_batch"],
            sync_counter=measured["sync_counter"],
            seconds_so_far=time.perf_counter() - start,
            peak_memory_gib=peak_memory(device) / 2**30,
            peak_host_memory_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        )
        save()

    results, measured = metered_run(protocol, evaluation, calibration, stage_done)
    total = time.perf_counter() - start
    seconds = measured["seconds"]
    stage_done(measured)
    out["run"].update(
        seconds=total,
        seconds_per_million_tokens=total * 1e6 / n_tokens,
        verdicts={
            m: (d.bracket_shares or {}).get("verdict") for m, d in results.decompositions.items()
        },
    )
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
        forwards = run["forwards_per_token"].get(stage)
        per_token = "" if forwards is None else f", {forwards:.3f} forwards per token"
        print(f"  {stage}: {value:.1f} s{per_token}")


if __name__ == "__main__":
    main()
