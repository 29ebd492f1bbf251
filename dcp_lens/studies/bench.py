"""`dcp-lens bench`: what the protocol costs, side by side on the same data in one process.

Reported (times: the fastest of the repeats, as `timeit` advises: on a shared machine
interference only slows a run down, so the fastest is the best estimate of what the code costs;
the medians come too, as ``*_median``. Each of the forward, the plain loop, the irreducible work
and the sweep is timed after one warm-up call, and the four alternate, round by round, so that a
machine whose speed drifts or jitters slows them alike and their ratios compare like with like):
- ``sweep_over_forward``: the whole fast sweep (calibration fit + every condition at every k on the
  evaluation batch) against one full-depth forward of the evaluation batch, as the median over
  rounds of each sweep's time over the mean of the two forwards timed just before and just after
  it (`paired_ratio`). The fastest sweep over the fastest forward
  (``sweep_over_forward_fastest``) is biased upwards on a busy machine: a sweep lasts about four
  forwards, so it is less often run through without interference than a forward is;
- ``sweep_over_irreducible``: the sweep against its irreducible work
  (`dcp_lens.studies.bench_floor.irreducible_work`: the calibration and evaluation passes and the
  readouts the conditions need), paired the same way (each sweep between two runs of it);
  ``irreducible_seconds`` (and ``*_median``), ``irreducible_parts_seconds`` (each part's median),
  ``irreducible_readouts`` (the readouts counted) and ``irreducible_over_forward`` beside it;
- ``sweep_floor_over_irreducible``: one plus the seconds of the work beyond the irreducible work
  that the sweep's definition asks of any implementation
  (`dcp_lens.studies.bench_floor.overhead_floor`: the maps and translators applied before their
  readouts, and the metrics of every readout) over the median irreducible work: a floor under
  ``sweep_over_irreducible`` (the solves, refits and moments are not in it); ``floor_parts_seconds``
  and ``floor_calls`` (the calls timed, over all batches) beside it;
- ``naive_over_sweep``: the same sweep done naively (full once, then every condition re-run
  through its hooks at every k) against the fast sweep (both include the same calibration fit);
- ``hooks_off_over_plain``: a `HookedRecurrentTransformer` forward with no hooks attached against
  a plain PyTorch loop over the same weights (below, written without the library's modules);
- ``sweep_tokens_per_second`` / ``forward_tokens_per_second``: calibration + evaluation tokens
  through the sweep, and evaluation tokens through one forward, per second (and the same as
  ``*_seconds_per_million_tokens``);
- ``rounds_seconds``: every timing, by run, in the order taken;
- ``peak_memory_mb``: the process's peak resident memory (CPU) or peak allocated memory (CUDA);
  ``sweep_memory_per_batch_token_mb``: the sweep's peak above what was held before it (weights,
  data), per token of one batch (what the batch size times the sequence length scales).

Two model shapes (``preset``): ``small``, a 1 + n_core x r + 1 pre-norm LayerNorm GELU model
(CPU-sized, with the plain-PyTorch baseline), and ``huginn``, Huginn-0125's shape
(`dcp_lens.zoo.loaders.huginn.HUGINN_0125`: d_model 5280, 2 + 4 x r + 2 sandwich RMSNorm SwiGLU
blocks, vocabulary 65536, r = 32) with random weights, for GPU runs (no plain baseline).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from dcp_lens.model.components.attention import set_fused_attention
from dcp_lens.model.config import RecurrentConfig
from dcp_lens.model.hooked_recurrent_transformer import HookedRecurrentTransformer
from dcp_lens.protocol.conditions import SWEEP
from dcp_lens.protocol.config import COMMAND_DEFAULTS, ProtocolConfig
from dcp_lens.protocol.dcp import DepthControlProtocol, EvaluationSet
from dcp_lens.studies.bench_floor import (
    IRREDUCIBLE_PARTS,
    irreducible_readouts,
    irreducible_work,
    overhead_floor,
    synchronize,
)
from dcp_lens.studies.bench_memory import (
    bench_bytes,
    memory_now,
    peak_memory,
    reset_peak,
    total_device_bytes,
)
from dcp_lens.utils.checks import WEIGHT_DTYPES
from dcp_lens.utils.devices import check_device
from dcp_lens.utils.errors import ConfigError, ResourceLimitError

BENCH_PRESETS = ("small", "huginn")
# Per preset: the defaults of the shape and batch arguments left as None.
# The protocol settings of the benchmark: it times fit, confidence matching and the sweep, so no
# bootstrap and no probe; its batch is the preset's (or ``batch``).
BENCH_CONFIG = ProtocolConfig(**COMMAND_DEFAULTS["bench"])
# A `run`'s 512 + 512 sequences as the small preset's batches of 16, each split: where the
# sweep's fixed costs (solves, the jackknife's refits) weigh what they weigh in use.
RUN_BATCHES = 32
PRESET_DEFAULTS: dict[str, dict[str, int]] = {
    "small": {"d_model": 256, "n_core": 2, "n_iterations": 16, "d_vocab": 512, "batch": 16,
              "seq": 128},
    "huginn": {"d_model": 5280, "n_core": 4, "n_iterations": 32, "d_vocab": 65536, "batch": 4,
               "seq": 1024},
}  # fmt: skip


def bench_config(
    preset: str = "small",
    d_model: int | None = None,
    n_core: int | None = None,
    n_iterations: int | None = None,
    d_vocab: int | None = None,
    seq: int | None = None,
    seed: int = 0,
) -> RecurrentConfig:
    """The benchmark model's config: ``preset``'s shape with each argument given replacing its
    default (``huginn`` with a smaller ``d_model`` keeps heads of 96 and Huginn's MLP ratio)."""
    if preset not in BENCH_PRESETS:
        raise ValueError(f"preset={preset!r} is not one of {BENCH_PRESETS}.")
    given = {
        "d_model": d_model,
        "n_core": n_core,
        "n_iterations": n_iterations,
        "d_vocab": d_vocab,
        "seq": seq,
    }
    size = {**PRESET_DEFAULTS[preset], **{k: v for k, v in given.items() if v is not None}}
    d = size["d_model"]
    if preset == "small" and (d % 2 or (d >= 64 and d % 64)):
        raise ConfigError(
            f"--d-model {d} does not split into the small preset's heads (64 wide from 64 on, "
            "one head below); pass an even width below 64 or a multiple of 64."
        )
    if preset == "small":
        return RecurrentConfig(
            d_model=d,
            n_heads=d // 64 or 1,
            d_head=64 if d >= 64 else d,
            d_mlp=4 * d,
            d_vocab=size["d_vocab"],
            n_ctx=size["seq"],
            n_prelude=1,
            n_core=size["n_core"],
            n_coda=1,
            n_iterations=size["n_iterations"],
            seed=seed,
        )
    from dcp_lens.zoo.loaders.huginn import HUGINN_0125, huginn_config

    heads = max(1, d // HUGINN_0125["head_dim"])
    ratio = HUGINN_0125["intermediate_size"] / HUGINN_0125["n_embd"]
    raven = {
        **HUGINN_0125,
        "n_embd": d,
        "n_heads": heads,
        "num_key_value_heads": heads,
        "head_dim": d // heads,
        "intermediate_size": 64 * math.ceil(ratio * d / 64),
        "vocab_size": size["d_vocab"],
        "padded_vocab_size": size["d_vocab"],
        "n_layers_in_recurrent_block": size["n_core"],
        "mean_recurrence": size["n_iterations"],
        "block_size": max(size["seq"], 16),
    }
    return huginn_config(raven, source="the huginn bench preset", seed=seed)


@dataclass
class FusedLayer:
    """One block's attention weights as `plain_forward` multiplies them: Q, K and V side by side
    [d_model, 3 * heads * d_head], the output [heads * d_head, d_model], and the block's prefix."""

    qkv: Tensor
    out: Tensor
    prefix: str


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

    def fused(prefix: str) -> FusedLayer:
        attn = {k: weights[f"{prefix}.attn.{k}"] for k in ("W_Q", "W_K", "W_V", "W_O")}
        qkv = torch.cat(
            [attn[k].permute(1, 0, 2).reshape(d, h * dh) for k in ("W_Q", "W_K", "W_V")], 1
        )
        return FusedLayer(qkv, attn["W_O"].reshape(h * dh, d), prefix)

    def block(x: Tensor, layer: FusedLayer) -> Tensor:
        p = layer.prefix
        y = F.layer_norm(x, (d,), weights[f"{p}.ln1.w"], weights[f"{p}.ln1.b"], cfg.eps)
        q, k, v = (y @ layer.qkv).view(x.shape[0], n_pos, 3, h, dh).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(dh)
        pattern = scores.masked_fill(causal, float("-inf")).softmax(-1)
        x = x + (pattern @ v).transpose(1, 2).reshape(x.shape[0], n_pos, h * dh) @ layer.out
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


def _timings(
    runs: dict[str, Callable[[], object]], repeats: dict[str, int], device: torch.device
) -> dict[str, list[float]]:
    """Wall times of each run, ``repeats[name]`` of them. The runs alternate (round i times
    every run with more than i repeats), so drifting machine load hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for round_number in range(max(repeats.values())):
        for name, fn in runs.items():
            if round_number >= repeats[name]:
                continue
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return times


def paired_ratio(long: list[float], short: list[float]) -> float:
    """Median over rounds of ``long[i]`` over the mean of ``short[i]`` and ``short[i + 1]``,
    the short runs timed just before and just after each long one (`_timings`' order).

    A ratio of two runs timed side by side cancels what the machine's speed does over a few
    seconds; the median drops a round that a burst of interference hit. Needs
    ``len(short) > len(long)``."""
    if not long or len(short) <= len(long):
        raise ValueError(
            f"a paired ratio needs a short run before and after each long one: got {len(long)} "
            f"long and {len(short)} short timings."
        )
    return statistics.median(
        seconds / ((short[i] + short[i + 1]) / 2) for i, seconds in enumerate(long)
    )


def run_bench(
    d_model: int | None = None,
    n_core: int | None = None,
    n_iterations: int | None = None,
    batch: int | None = None,
    seq: int | None = None,
    d_vocab: int | None = None,
    repeats: int = 5,
    sweep_repeats: int | None = None,
    k_grid: list[int] | None = None,
    device: str = "cpu",
    naive: bool = True,
    seed: int = 0,
    preset: str = "small",
    dtype: str = "float32",
    config: ProtocolConfig | None = None,
    batches: int = 1,
) -> dict[str, Any]:
    """Measure the figures above on a random model of ``preset``'s shape (arguments left None
    take the preset's defaults, `PRESET_DEFAULTS`), computing in ``dtype``, with the protocol
    settings ``config`` (default `BENCH_CONFIG`; its batch size is replaced by ``batch``, its k
    grid by ``k_grid`` when given). ``repeats`` rounds
    each time the forward, the plain loop and the sweep (``sweep_repeats`` sweeps, if given).
    ``batches``: calibration and evaluation batches each (the forward and the plain loop read
    the evaluation batches one by one). The sweep's fixed costs (the maps' and translators'
    solves, the jackknife's refits) do not grow with it; its passes and readouts do, so its
    ratios at a `run`'s 512 + 512 sequences are those of a large ``batches``.

    Raises:
        DeviceError: ``device`` is not available here.
        ResourceLimitError: the weights and the largest tensors of the run would not fit in the
            device's memory (checked before anything is allocated).
    """
    target = check_device(device)
    if isinstance(batches, bool) or not isinstance(batches, int) or batches < 1:
        raise ConfigError(
            f"batches={batches!r} must be an int >= 1 (calibration and evaluation batches each); "
            "pass --batches 1 or more."
        )
    if dtype not in WEIGHT_DTYPES:
        raise ConfigError(
            f"dtype={dtype!r} is not one of {sorted(WEIGHT_DTYPES)}; pass one of them."
        )
    cfg = bench_config(preset, d_model, n_core, n_iterations, d_vocab, seq, seed)
    defaults = PRESET_DEFAULTS[preset]
    batch = defaults["batch"] if batch is None else batch
    seq = defaults["seq"] if seq is None else seq
    r, n_blocks = cfg.n_iterations, cfg.layers_for(cfg.n_iterations)
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    n_weights = parameter_count(cfg)
    needed = bench_bytes(
        batch,
        seq,
        cfg.n_heads,
        cfg.d_model,
        n_blocks,
        element=element,
        d_vocab=cfg.d_vocab,
        n_weights=n_weights,
    )
    available = total_device_bytes(target)
    if available is not None and needed > available:
        raise ResourceLimitError(
            f"batch {batch} x seq {seq} ({preset} preset, d_model {cfg.d_model}, "
            f"{cfg.n_heads} heads, {n_blocks} blocks, {dtype}) needs about "
            f"{needed / 2**30:.1f} GiB for its weights, attention scores, cached states and "
            f"logits, more than the {available / 2**30:.1f} GiB of {target}; lower the sequence "
            "length, the batch or the model size."
        )
    model = HookedRecurrentTransformer(cfg).to(device=target, dtype=getattr(torch, dtype)).eval()
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.d_vocab, (2 * batches * batch, seq), generator=generator).to(
        target
    )
    evaluation = EvaluationSet.from_tokens(tokens[: batches * batch])
    calibration = EvaluationSet.from_tokens(tokens[batches * batch :])
    evaluation_batches = [evaluation.tokens[rows] for rows in evaluation.batches(batch)]
    weights = {k: v.detach() for k, v in model.canonical_state_dict().items()}
    config = (config or BENCH_CONFIG).replace(batch_size=batch)
    if k_grid is not None:
        config = config.replace(k_grid=tuple(k_grid))
    protocol = DepthControlProtocol(model, config, progress=False)
    has_plain = (cfg.norm_placement, cfg.act_fn, cfg.normalization_type) == ("pre", "gelu", "LN")
    with torch.no_grad():

        def sweep() -> None:  # what `run` does before the statistics: fit, match, evaluate
            protocol.fit(calibration)
            protocol.fit_temperatures(calibration)
            protocol.evaluate(evaluation)

        def naive_sweep() -> None:
            protocol.fit(calibration)
            protocol.condition_logits(evaluation.tokens, "full", protocol.r, via="hooks")
            for k in protocol.context.k_grid:
                for condition in SWEEP:
                    protocol.condition_logits(evaluation.tokens, condition, k, via="hooks")

        def materialised() -> list[Tensor]:  # the attention pattern formed, as a hook would
            set_fused_attention(model, False)
            try:
                return [model(tokens) for tokens in evaluation_batches]
            finally:
                set_fused_attention(model, True)

        runs: dict[str, Callable[[], object]] = {
            "forward": lambda: [model(tokens) for tokens in evaluation_batches],
            "forward_materialised": materialised,
        }
        check = math.nan
        if has_plain:
            first = evaluation_batches[0]
            plain_logits = plain_forward(weights, cfg, first, r)
            check = float((plain_logits - model(first)).abs().max())
            runs["plain"] = lambda: [
                plain_forward(weights, cfg, tokens, r) for tokens in evaluation_batches
            ]
        # One warm-up call each (first-call allocations are not what is measured); then the
        # forward, the plain loop, the irreducible work and the sweep alternate, timed under the
        # same load. The memory held before the sweep's first call is the base of its per-token
        # figure; the irreducible work is planned from the fitted maps of the sweep's warm-up.
        for fn in runs.values():
            fn()
        before = memory_now(target)
        sweep()
        parts: list[dict[str, float]] = []
        work = irreducible_work(protocol, calibration, evaluation)
        work()
        runs["irreducible"] = lambda: parts.append(work())
        runs["sweep"] = sweep
        reset_peak(target)
        sweeps = repeats if sweep_repeats is None else sweep_repeats
        counts = {name: sweeps if name == "sweep" else repeats for name in runs}
        # One forward and one irreducible work more than sweeps: each sweep is then timed
        # between two of each.
        counts["forward"] = max(repeats, sweeps + 1)
        counts["irreducible"] = sweeps + 1
        times = _timings(runs, counts, target)
        peak, sweep_peak = peak_memory(target)
        seconds = {name: min(values) for name, values in times.items()}
        medians = {name: statistics.median(values) for name, values in times.items()}
        forward, plain = seconds["forward"], seconds.get("plain", math.nan)
        sweep_seconds = seconds["sweep"]
        floor, floor_calls = overhead_floor(protocol, evaluation)
        naive_seconds = math.nan
        if naive:
            naive_seconds = _timings({"naive": naive_sweep}, {"naive": 1}, target)["naive"][0]
    batch_tokens = batch * seq
    sweep_rate = 2 * batches * batch_tokens / sweep_seconds  # calibration + evaluation tokens
    forward_rate = batches * batch_tokens / forward
    return {
        "preset": preset,
        "model": {
            "d_model": cfg.d_model,
            "n_prelude": cfg.n_prelude,
            "n_core": cfg.n_core,
            "n_iterations": r,
            "n_coda": cfg.n_coda,
            "n_layers": n_blocks,
            "d_vocab": cfg.d_vocab,
            "parameters": n_weights,
        },
        "dtype": dtype,
        "batch": batch,
        "batches": batches,
        "seq": seq,
        "k_grid": list(protocol.context.k_grid),
        "device": str(target),
        "threads": torch.get_num_threads(),
        "forward_seconds": forward,
        "plain_seconds": plain,
        "sweep_seconds": sweep_seconds,
        "naive_seconds": naive_seconds,
        "forward_seconds_median": medians["forward"],
        "plain_seconds_median": medians.get("plain", math.nan),
        "sweep_seconds_median": medians["sweep"],
        "sweep_over_forward": paired_ratio(times["sweep"], times["forward"]),
        # The fused attention's gain: the forward with the pattern materialised over without.
        "materialised_over_fused_forward": paired_ratio(
            times["forward_materialised"], times["forward"]
        ),
        "sweep_over_forward_fastest": sweep_seconds / forward,
        "sweep_over_forward_median": medians["sweep"] / medians["forward"],
        "irreducible_seconds": seconds["irreducible"],
        "irreducible_seconds_median": medians["irreducible"],
        "sweep_over_irreducible": paired_ratio(times["sweep"], times["irreducible"]),
        "irreducible_over_forward": paired_ratio(times["irreducible"][:-1], times["forward"]),
        "irreducible_parts_seconds": {
            part: statistics.median(round_parts[part] for round_parts in parts)
            for part in IRREDUCIBLE_PARTS
        },
        "irreducible_readouts": irreducible_readouts(protocol),
        "floor_parts_seconds": floor,
        "floor_calls": floor_calls,
        "sweep_floor_over_irreducible": 1.0 + sum(floor.values()) / medians["irreducible"],
        "repeats": {name: len(values) for name, values in times.items()},
        "rounds_seconds": times,
        "naive_over_sweep": naive_seconds / sweep_seconds,
        "hooks_off_over_plain": forward / plain,
        "plain_max_abs_logit_diff": check,
        "forward_tokens_per_second": forward_rate,
        "sweep_tokens_per_second": sweep_rate,
        "forward_seconds_per_million_tokens": 1e6 / forward_rate,
        "sweep_seconds_per_million_tokens": 1e6 / sweep_rate,
        "peak_memory_mb": peak,
        "peak_memory_kind": "cuda max allocated" if target.type == "cuda" else "process max RSS",
        "sweep_memory_per_batch_token_mb": (sweep_peak - before) / batch_tokens,
    }


def parameter_count(cfg: RecurrentConfig) -> int:
    """Unique parameters of ``cfg``'s model, counted on the meta device (no memory used)."""
    with torch.device("meta"):
        model = HookedRecurrentTransformer(cfg)
    return sum(p.numel() for p in model.parameters())


def print_bench(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    shape = result["model"]
    allocator = result.get("allocator", "as the process has it")
    print(
        f"{result['preset']} model {shape['n_prelude']} + {shape['n_core']} x "
        f"{shape['n_iterations']} + {shape['n_coda']}, d_model={shape['d_model']}, vocabulary "
        f"{shape['d_vocab']}, {shape['parameters']:,} parameters, {result['dtype']}; batch "
        f"{result['batch']} x {result['seq']} ({result.get('batches', 1)} calibration and "
        f"evaluation batches each), k grid {result['k_grid']}, {result['device']}, "
        f"{result['threads']} threads; allocator: {allocator}"
    )
    rounds = result.get("repeats", {}).get("sweep", "?")
    print(f"  fastest of {rounds} alternated rounds (median in brackets)")
    for key in ("forward_seconds", "plain_seconds", "sweep_seconds"):
        print(f"  {key:<34} {result[key]:.3f}   ({result.get(key + '_median', math.nan):.3f})")
    print(f"  {'naive_seconds':<34} {result['naive_seconds']:.3f}")
    fastest = result.get("sweep_over_forward_fastest", math.nan)
    median_ratio = result.get("sweep_over_forward_median", math.nan)
    print(
        f"  {'sweep_over_forward':<34} {result['sweep_over_forward']:.2f}   (median of each "
        "round's sweep over the forwards around it)"
    )
    print(f"  {'sweep_over_forward_fastest':<34} {fastest:.2f}   (medians: {median_ratio:.2f})")
    if "sweep_over_irreducible" in result:
        print(
            f"  {'irreducible_seconds':<34} {result['irreducible_seconds']:.3f}   "
            f"({result['irreducible_seconds_median']:.3f})"
        )
        for part, seconds in result["irreducible_parts_seconds"].items():
            print(f"    {part:<32} {seconds:.3f}   (median)")
        print(
            f"  {'sweep_over_irreducible':<34} {result['sweep_over_irreducible']:.2f}   "
            "(target <= 1.15; median of each round's sweep over the irreducible work around it)"
        )
        if result.get("batches", 1) < RUN_BATCHES:
            print(
                f"    (on {result.get('batches', 1)} batch(es) the sweep's fixed solves and "
                "refits weigh more than in a run's 512 + 512 sequences: with the small preset's "
                f"batch of 16, --batches {RUN_BATCHES} measures that; the docs' page Benchmarks)"
            )
        print(f"  {'irreducible_over_forward':<34} {result['irreducible_over_forward']:.2f}")
    if "sweep_floor_over_irreducible" in result:
        for part, seconds in result["floor_parts_seconds"].items():
            print(f"    floor: {part:<25} {seconds:.3f}")
        print(
            f"  {'sweep_floor_over_irreducible':<34} {result['sweep_floor_over_irreducible']:.2f}"
            "   (the maps applied and the metrics, over the median irreducible work)"
        )
    for key, target in (("naive_over_sweep", ">= 10"), ("hooks_off_over_plain", "<= 1.10")):
        print(f"  {key:<34} {result[key]:.2f}   (target {target})")
    for key in ("forward_tokens_per_second", "sweep_tokens_per_second"):
        print(f"  {key:<34} {result[key]:,.0f}")
    for key in ("forward_seconds_per_million_tokens", "sweep_seconds_per_million_tokens"):
        print(f"  {key:<34} {result[key]:,.1f}")
    print(f"  {'peak_memory_mb':<34} {result['peak_memory_mb']:.0f} ({result['peak_memory_kind']})")
    per_token = result["sweep_memory_per_batch_token_mb"]
    print(f"  {'sweep_memory_per_batch_token_mb':<34} {per_token:.4f}")
