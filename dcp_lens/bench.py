"""`dcp-lens bench`: what the protocol costs, side by side on the same data in one process.

Reported (medians over repeats):
- ``sweep_over_forward``: the whole fast sweep (calibration fit + every condition at every k on the
  evaluation batch) against one full-depth forward of the evaluation batch;
- ``naive_over_sweep``: the same sweep done naively (full once, then every condition re-run
  through its hooks at every k) against the fast sweep (both include the same calibration fit);
- ``hooks_off_over_plain``: a `HookedRecurrentTransformer` forward with no hooks attached against
  a plain PyTorch loop over the same weights (below, written without the library's modules);
- ``peak_memory_mb``: the process's peak resident memory (CPU) or peak allocated memory (CUDA).
"""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from dcp_lens.conditions import SWEEP
from dcp_lens.config import RecurrentConfig
from dcp_lens.devices import check_device
from dcp_lens.errors import ResourceLimitError
from dcp_lens.hooked_recurrent_transformer import HookedRecurrentTransformer
from dcp_lens.protocol import DepthControlProtocol, EvaluationSet


def plain_forward(
    weights: dict[str, Tensor], cfg: RecurrentConfig, tokens: Tensor, n_iterations: int
) -> Tensor:
    """Logits of a pre-norm LayerNorm/GELU recurrent transformer with learned positions and
    additive injection, as one would write it by hand: fused QKV, `F.layer_norm`, SDPA-free
    softmax attention (the hooked model also materialises the pattern)."""
    if cfg.norm_placement != "pre" or cfg.act_fn != "gelu" or cfg.normalization_type != "LN":
        raise ValueError("the plain baseline covers pre-norm LayerNorm GELU models only.")
    n_pos, d, h, dh = tokens.shape[1], cfg.d_model, cfg.n_heads, cfg.d_head
    causal = torch.ones(n_pos, n_pos, dtype=torch.bool, device=tokens.device).triu(1)

    def fused(prefix: str) -> dict[str, Tensor]:
        attn = {k: weights[f"{prefix}.attn.{k}"] for k in ("W_Q", "W_K", "W_V", "W_O")}
        qkv = torch.cat(
            [attn[k].permute(1, 0, 2).reshape(d, h * dh) for k in ("W_Q", "W_K", "W_V")], 1
        )
        return {"qkv": qkv, "out": attn["W_O"].reshape(h * dh, d), "prefix": prefix}  # type: ignore[dict-item]

    def block(x: Tensor, layer: dict[str, Any]) -> Tensor:
        p = layer["prefix"]
        y = F.layer_norm(x, (d,), weights[f"{p}.ln1.w"], weights[f"{p}.ln1.b"], cfg.eps)
        q, k, v = (y @ layer["qkv"]).view(x.shape[0], n_pos, 3, h, dh).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(dh)
        pattern = scores.masked_fill(causal, float("-inf")).softmax(-1)
        x = x + (pattern @ v).transpose(1, 2).reshape(x.shape[0], n_pos, h * dh) @ layer["out"]
        y = F.layer_norm(x, (d,), weights[f"{p}.ln2.w"], weights[f"{p}.ln2.b"], cfg.eps)
        hidden = F.gelu(y @ weights[f"{p}.mlp.W_in"] + weights[f"{p}.mlp.b_in"])
        return x + hidden @ weights[f"{p}.mlp.W_out"] + weights[f"{p}.mlp.b_out"]

    prelude = [fused(f"prelude.{i}") for i in range(cfg.n_prelude)]
    core = [fused(f"core.{i}") for i in range(cfg.n_core)]
    coda = [fused(f"coda.{i}") for i in range(cfg.n_coda)]
    x = weights["embed.W_E"][tokens] + weights["pos_embed.W_pos"][:n_pos]
    for layer in prelude:
        x = block(x, layer)
    e, s = x, torch.zeros_like(x)
    for _ in range(n_iterations):
        s = s + e
        for layer in core:
            s = block(s, layer)
    x = s
    for layer in coda:
        x = block(x, layer)
    x = F.layer_norm(x, (d,), weights["ln_final.w"], weights["ln_final.b"], cfg.eps)
    return x @ weights["unembed.W_U"]


def _median_seconds(
    runs: dict[str, Callable[[], Any]], repeats: int, device: torch.device
) -> dict[str, float]:
    """Median wall time of each run; the runs alternate, so drifting machine load hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            _synchronize(device)
            start = time.perf_counter()
            fn()
            _synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_bench(
    d_model: int = 256,
    n_core: int = 2,
    n_iterations: int = 16,
    batch: int = 16,
    seq: int = 128,
    d_vocab: int = 512,
    repeats: int = 5,
    sweep_repeats: int = 3,
    k_grid: list[int] | None = None,
    device: str = "cpu",
    naive: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """Measure the figures above on a random 1 + n_core x n_iterations + 1 model.

    Raises:
        DeviceError: ``device`` is not available here.
        ResourceLimitError: the largest tensors of the run would not fit in the device's memory
            (checked before anything is allocated).
    """
    target = check_device(device)
    n_heads = d_model // 64 or 1
    needed = bench_bytes(batch, seq, n_heads, d_model, 2 + n_core * n_iterations)
    available = device_memory_bytes(target)
    if available is not None and needed > available:
        raise ResourceLimitError(
            f"batch {batch} x seq {seq} (d_model {d_model}, {n_heads} heads, "
            f"{2 + n_core * n_iterations} blocks) needs about {needed / 2**30:.1f} GiB for its "
            f"attention scores and cached states, more than the {available / 2**30:.1f} GiB of "
            f"{target}; lower the sequence length or the batch."
        )
    cfg = RecurrentConfig(
        d_model=d_model, n_heads=n_heads, d_head=64 if d_model >= 64 else d_model,
        d_mlp=4 * d_model, d_vocab=d_vocab, n_ctx=seq, n_prelude=1, n_core=n_core, n_coda=1,
        n_iterations=n_iterations, seed=seed,
    )  # fmt: skip
    model = HookedRecurrentTransformer(cfg).to(target).eval()
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, d_vocab, (2 * batch, seq), generator=generator).to(target)
    evaluation = EvaluationSet.from_tokens(tokens[:batch])
    calibration = EvaluationSet.from_tokens(tokens[batch:])
    weights = {k: v.detach() for k, v in model.canonical_state_dict().items()}
    protocol = DepthControlProtocol(
        model, k_grid=k_grid, batch_size=batch, n_bootstrap=0, probe="none", progress=False
    )
    with torch.no_grad():
        model(evaluation.tokens)  # warm up
        check = (
            (
                plain_forward(weights, cfg, evaluation.tokens, n_iterations)
                - model(evaluation.tokens)
            )
            .abs()
            .max()
        )
        forwards = _median_seconds(
            {
                "forward": lambda: model(evaluation.tokens),
                "plain": lambda: plain_forward(weights, cfg, evaluation.tokens, n_iterations),
            },
            repeats,
            target,
        )
        forward, plain = forwards["forward"], forwards["plain"]
        if target.type == "cuda":
            torch.cuda.reset_peak_memory_stats(target)

        def sweep() -> None:  # what `run` does before the statistics: fit, match, evaluate
            protocol.fit(calibration)
            protocol._fit_temperatures(calibration)
            protocol._evaluate(evaluation)

        def naive_sweep() -> None:
            protocol.fit(calibration)
            protocol.condition_logits(evaluation.tokens, "full", protocol.r, via="hooks")
            for k in protocol.k_grid:
                for condition in SWEEP:
                    protocol.condition_logits(evaluation.tokens, condition, k, via="hooks")

        sweep_seconds = _median_seconds({"sweep": sweep}, sweep_repeats, target)["sweep"]
        peak = (
            torch.cuda.max_memory_allocated(target) / 2**20
            if target.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        )
        naive_seconds = math.nan
        if naive:
            naive_seconds = _median_seconds({"naive": naive_sweep}, 1, target)["naive"]
    return {
        "model": {
            "d_model": d_model, "n_prelude": 1, "n_core": n_core, "n_iterations": n_iterations,
            "n_coda": 1, "n_layers": cfg.n_layers, "d_vocab": d_vocab,
        },
        "batch": batch, "seq": seq, "k_grid": list(protocol.k_grid), "device": str(target),
        "threads": torch.get_num_threads(),
        "forward_seconds": forward, "plain_seconds": plain, "sweep_seconds": sweep_seconds,
        "naive_seconds": naive_seconds,
        "sweep_over_forward": sweep_seconds / forward,
        "naive_over_sweep": naive_seconds / sweep_seconds,
        "hooks_off_over_plain": forward / plain,
        "plain_max_abs_logit_diff": float(check),
        "peak_memory_mb": peak,
        "peak_memory_kind": "cuda max allocated" if target.type == "cuda" else "process max RSS",
    }  # fmt: skip


def bench_bytes(batch: int, seq: int, n_heads: int, d_model: int, n_blocks: int) -> int:
    """A lower bound on the peak memory of `run_bench`, in bytes (float32): one attention score
    tensor and its softmax [batch, heads, seq, seq] and the cached states of every block
    [blocks + 1, batch, seq, d_model], for the evaluation and calibration halves."""
    scores = 2 * batch * n_heads * seq * seq
    states = (n_blocks + 1) * batch * seq * d_model
    return 4 * 2 * (scores + states)


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of ``device`` (physical memory for the CPU), or None when unknown."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    return None


def print_bench(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    shape = result["model"]
    print(
        f"model 1 + {shape['n_core']} x {shape['n_iterations']} + 1, d_model={shape['d_model']}, "
        f"batch {result['batch']} x {result['seq']}, k grid {result['k_grid']}, "
        f"{result['device']}, {result['threads']} threads"
    )
    for key in ("forward_seconds", "plain_seconds", "sweep_seconds", "naive_seconds"):
        print(f"  {key:<22} {result[key]:.3f}")
    for key, target in (
        ("sweep_over_forward", "<= 4.0"), ("naive_over_sweep", ">= 10"),
        ("hooks_off_over_plain", "<= 1.10"),
    ):  # fmt: skip
        print(f"  {key:<22} {result[key]:.2f}   (target {target})")
    print(f"  peak_memory_mb         {result['peak_memory_mb']:.0f} ({result['peak_memory_kind']})")
