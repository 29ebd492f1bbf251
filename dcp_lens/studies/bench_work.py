"""The sweep's work counted, not timed: forwards per token of each stage of a DCP run; and its
memory estimated at a preset's shape (`run_estimate`), without weights.

A counter hooks the model's blocks, its injection and its final norm (the unembedding follows
it) and counts the rows each call applies them to; `model.readout` calls are counted apart. A
stage's work is those rows weighed by each module's multiply-adds per row at a target shape
(Huginn-0125's width and vocabulary on a model scaled down in width: the counts do not depend
on the width, the weights do), over the stage's tokens and one forward's multiply-adds per
token. Counting needs no timer and no accelerator: it reads the same on any device, the meta
device's shapes included.

`StageMeter` meters a run by stage: the work counted, wall seconds and the host-device
synchronisations each stage makes (`dcp_lens.utils.syncs`), per batch for the stages that read
batches; `dcp-lens bench --count` and demos/gpu_check.py report them.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from dcp_lens.protocol.confidence import Temperatures
from dcp_lens.protocol.config import ProtocolConfig
from dcp_lens.protocol.dcp import DepthControlProtocol, EvaluationSet
from dcp_lens.protocol.probe import probe_run
from dcp_lens.protocol.sweep import Sweep
from dcp_lens.utils.syncs import SyncCount, counting_syncs

# The stages of a run whose work is counted, in the order they run.
WORK_STAGES = ("calibration pass", "refits", "confidence matching", "evaluation", "probe")


@dataclass(frozen=True)
class UnitCosts:
    """Multiply-adds per row of each counted unit at a model's shape.

    Attributes:
        blocks: per block module (in ``model.blocks`` order, each shared module once), its
            matrices' multiply-adds per row.
        inject: the injection's per row (0 where there is none).
        unembed: the unembedding's per row (d_model x d_vocab).
        attention: multiply-adds per (query, key) pair of one block (2 x heads x d_head).
    """

    blocks: tuple[int, ...]
    inject: int
    unembed: int
    attention: int

    @classmethod
    def of(cls, model: Any) -> UnitCosts:
        """``model``'s costs (a model on the meta device will do)."""
        cfg = model.cfg
        inject = getattr(model, "inject", None)
        return cls(
            blocks=tuple(_matrix_macs(block) for block in _unique_blocks(model)),
            inject=0 if inject is None else _matrix_macs(inject),
            unembed=int(cfg.d_model) * int(cfg.d_vocab),
            attention=2 * int(cfg.n_heads) * int(cfg.d_head),
        )


@dataclass
class WorkCount:
    """Rows each unit was applied to, per stage.

    Attributes:
        rows: per stage, per unit (``block.i``, ``inject``, ``unembed``, ``attention.i``: query,
            key pairs of block i; ``readout``: rows of `model.readout` calls), the rows counted.
        tokens: per stage, the tokens it reads (calibration or evaluation tokens).
    """

    rows: dict[str, Counter[str]] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    stage: str = WORK_STAGES[0]

    def add(self, unit: str, rows: int) -> None:
        self.rows.setdefault(self.stage, Counter())[unit] += rows

    def macs(self, stage: str, costs: UnitCosts) -> int:
        """The multiply-adds of ``stage`` at ``costs``' shape."""
        total = 0
        for unit, rows in self.rows.get(stage, Counter()).items():
            kind, _, index = unit.partition(".")
            if kind == "block":
                total += rows * costs.blocks[int(index)]
            elif kind == "attention":
                total += rows * costs.attention
            elif kind in ("inject", "unembed"):
                total += rows * getattr(costs, kind)
        return total

    def forwards_per_token(
        self, costs: UnitCosts, forward_macs_per_token: float
    ) -> dict[str, float]:
        """Per stage, its multiply-adds over its tokens and one forward's per token."""
        return {
            stage: self.macs(stage, costs)
            / max(1, self.tokens.get(stage, 0))
            / forward_macs_per_token
            for stage in WORK_STAGES
        }

    def readouts_per_token(self) -> dict[str, float]:
        """Per stage, `model.readout` rows over its tokens."""
        return {
            stage: self.rows.get(stage, Counter())["readout"] / max(1, self.tokens.get(stage, 0))
            for stage in WORK_STAGES
        }


@contextlib.contextmanager
def counting(model: Any, count: WorkCount) -> Iterator[WorkCount]:
    """Count into ``count`` every block, injection and unembedding ``model`` applies, and every
    `model.readout` row, while the context is open (rows under ``count.stage``)."""
    handles = []

    def counter(unit: str, attention: str | None = None) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            x = args[0] if args and isinstance(args[0], Tensor) else output
            rows = x.numel() // x.shape[-1]
            count.add(unit, rows)
            if attention is not None and x.ndim >= 2:
                pos = int(x.shape[-2])
                count.add(attention, rows // pos * pos * (pos + 1) // 2)

        return hook

    for i, block in enumerate(_unique_blocks(model)):
        handles.append(block.register_forward_hook(counter(f"block.{i}", f"attention.{i}")))
    inject = getattr(model, "inject", None)
    if isinstance(inject, nn.Module):
        handles.append(inject.register_forward_hook(counter("inject")))
    handles.append(model.ln_final.register_forward_hook(counter("unembed")))
    readout = model.readout

    def counted_readout(state: Tensor, *args: Any, **kwargs: Any) -> Any:
        count.add("readout", state.numel() // state.shape[-1])
        return readout(state, *args, **kwargs)

    model.readout = counted_readout
    try:
        yield count
    finally:
        del model.readout
        for handle in handles:
            handle.remove()


def forward_macs_per_token(model: Any, tokens: Tensor, costs: UnitCosts) -> float:
    """One plain forward's multiply-adds per token at ``costs``' shape, counted on ``tokens``."""
    count = WorkCount(stage="forward")
    with torch.no_grad(), counting(model, count):
        model(tokens)
    return count.macs("forward", costs) / tokens.numel()


def _unique_blocks(model: Any) -> list[nn.Module]:
    seen: dict[int, nn.Module] = {}
    for block in model.blocks:
        seen.setdefault(id(block), block)
    return list(seen.values())


def _matrix_macs(module: nn.Module) -> int:
    """Multiply-adds per row of ``module``'s matrices (its parameters of two dimensions or
    more, each used once per row; norms' and biases' vectors left out)."""
    return sum(p.numel() for p in module.parameters() if p.ndim >= 2)


# The progress loops that read a stage's batches, by the description `RunContext.each` gets.
BATCH_LOOPS = ("calibration", "evaluation")


class StageMeter:
    """Work, wall seconds, synchronisations and batches by stage of ``protocol``'s run.

    Args:
        protocol: the protocol whose model and context are metered.
        count: where the work is counted (its ``stage`` follows `enter`).
        on_stage: called with `summary` each time a stage ends.
    """

    def __init__(
        self,
        protocol: DepthControlProtocol,
        count: WorkCount,
        on_stage: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.protocol, self.count, self.on_stage = protocol, count, on_stage
        self.device = protocol.context.device()
        self.seconds: dict[str, float] = {}
        self.syncs: dict[str, int] = {}
        self.batches: dict[str, int] = {}
        self.current: str | None = None
        self._syncs: SyncCount | None = None
        self._started = 0.0
        self._synced_at = 0
        self._own = 0  # the meter's own synchronisations, not the stage's

    @contextlib.contextmanager
    def metering(self) -> Iterator[StageMeter]:
        """Count work and synchronisations while open; the last stage ends when it closes."""
        context = self.protocol.context
        each = context.each

        def metered(items: Sequence[Any], description: str) -> Iterator[Any]:
            for item in each(items, description):
                if description in BATCH_LOOPS and self.current is not None:
                    self.batches[self.current] = self.batches.get(self.current, 0) + 1
                yield item
            if description == "calibration":  # the pass is done: the refits follow
                self.enter("refits")

        context.each = metered  # type: ignore[method-assign]
        try:
            with counting(self.protocol.model, self.count), counting_syncs(self.device) as syncs:
                self._syncs = syncs
                yield self
                self.enter(None)
        finally:
            del context.each

    def enter(self, stage: str | None) -> None:
        """End the stage running (its time up to the device's finishing it) and start ``stage``
        (None: none)."""
        assert self._syncs is not None, "enter() is called inside metering()"
        if self.current is not None:
            before = self._syncs.total
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._own += self._syncs.total - before
            name = self.current
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - self._started
            made = self._syncs.total - self._own - self._synced_at
            self.syncs[name] = self.syncs.get(name, 0) + made
            if self.on_stage is not None:
                self.on_stage(self.summary())
        self.current = stage
        self._synced_at = self._syncs.total - self._own
        if stage is not None:
            self.count.stage = stage
            self._started = time.perf_counter()

    def summary(self) -> dict[str, Any]:
        """What is measured so far: seconds, synchronisations and batches by stage, and the
        synchronisations per batch of the stages that read batches."""
        return {
            "seconds": dict(self.seconds),
            "syncs": dict(self.syncs),
            "batches": dict(self.batches),
            "syncs_per_batch": {
                stage: self.syncs.get(stage, 0) / batches
                for stage, batches in self.batches.items()
                if batches
            },
            "sync_counter": "cuda sync debug mode" if self.device.type == "cuda" else "shim",
        }

    def hottest_sites(self, n: int = 5) -> list[tuple[str, int]]:
        """The code lines that made the most synchronisations."""
        return [] if self._syncs is None else self._syncs.sites.most_common(n)


def count_run(
    protocol: DepthControlProtocol,
    calibration: EvaluationSet,
    evaluation: EvaluationSet,
    costs: UnitCosts,
    jackknife_tokens: int | None = None,
    control_tokens: int | None = None,
    on_stage: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run ``protocol``'s stages (fit, confidence matching, one evaluation, the probe) on the
    two sets with the work counted; forwards and readouts per token by stage at ``costs``' shape,
    with each stage's wall seconds and synchronisations (`StageMeter`). ``jackknife_tokens`` and
    ``control_tokens``: the caps of the jackknife's examples and of the subsampled controls'
    (`dcp_lens.protocol.sweep.Sweep`), to read the share of examples a run of longer sequences
    reads. ``on_stage`` gets what is measured so far (the result's keys) after every stage."""
    model, context = protocol.model, protocol.context
    count = WorkCount()
    calibration_tokens, evaluation_tokens = calibration.tokens.numel(), evaluation.tokens.numel()
    count.tokens = {
        "calibration pass": calibration_tokens,
        "refits": calibration_tokens,
        "confidence matching": calibration_tokens,
        "evaluation": evaluation_tokens,
        "probe": evaluation_tokens,
    }
    forward = forward_macs_per_token(model, evaluation.tokens[:1].to(context.device()), costs)

    def measured(meter: dict[str, Any]) -> dict[str, Any]:
        return {
            "forwards_per_token": count.forwards_per_token(costs, forward),
            "readouts_per_token": count.readouts_per_token(),
            "stage_seconds": meter["seconds"],
            "syncs": meter["syncs"],
            "syncs_per_batch": meter["syncs_per_batch"],
            "sync_counter": meter["sync_counter"],
        }

    meter = StageMeter(protocol, count, None if on_stage is None else _then(measured, on_stage))
    with torch.no_grad(), meter.metering():
        meter.enter("calibration pass")
        protocol.fit(calibration)
        maps = protocol.maps
        if maps is None:
            raise RuntimeError("the fit stage left no maps")
        meter.enter("confidence matching")
        temperatures: Temperatures = {}
        if context.matches_confidence():
            temperatures = protocol.fit_temperatures(calibration)
        meter.enter("evaluation")
        sweep = Sweep(context, maps, temperatures, jackknife_tokens, control_tokens)
        swept = sweep.evaluate(evaluation)
        meter.enter("probe")
        if protocol.config.probe != "none":
            probe_run(
                maps.probe_reference,
                swept.probe_samples,
                n_iterations=protocol.r,
                points=protocol.config.probe_points,
                seed=protocol.config.seed,
            )
    # Every subsampled control is read on the same examples.
    controls = int(next(iter(swept.read.values())).sum()) if swept.read else len(evaluation)
    return {
        **measured(meter.summary()),
        "sync_sites": dict(meter.hottest_sites()),
        "rows": {stage: dict(rows) for stage, rows in count.rows.items()},
        "tokens": count.tokens,
        "jackknife_examples": 0 if swept.jackknife_rows is None else len(swept.jackknife_rows),
        "control_examples": controls,
        "forward_macs_per_token": forward,
    }


def _then(
    first: Callable[[dict[str, Any]], dict[str, Any]], then: Callable[[dict[str, Any]], None]
) -> Callable[[dict[str, Any]], None]:
    return lambda value: then(first(value))


def run_count(
    preset: str = "huginn",
    *,
    d_model: int | None = None,
    n_core: int | None = None,
    n_iterations: int | None = None,
    d_vocab: int | None = None,
    batch: int | None = None,
    batches: int = 32,
    seq: int | None = None,
    config: ProtocolConfig | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Forwards per token by stage of a run of ``batches`` calibration and evaluation batches
    on a random model of ``preset``'s layout (its r, blocks and k grid; the width, vocabulary
    and sequence length given scale it down), weighed at the preset's own width and vocabulary.
    The jackknife and the subsampled controls read the share of examples that sequences of
    the preset's length would give them (`jackknife_examples`' and `control_examples`' caps
    scaled by ``seq`` over the preset's length)."""
    from dcp_lens.model.hooked_recurrent_transformer import HookedRecurrentTransformer
    from dcp_lens.protocol.sweep import CONTROL_TOKENS, JACKKNIFE_TOKENS
    from dcp_lens.studies.bench import BENCH_CONFIG, PRESET_DEFAULTS, bench_config

    defaults = PRESET_DEFAULTS[preset]
    batch = defaults["batch"] if batch is None else batch
    seq = defaults["seq"] if seq is None else seq
    cfg = bench_config(preset, d_model, n_core, n_iterations, d_vocab, seq, seed)
    full = bench_config(preset, None, n_core, n_iterations, None, seq, seed)
    with torch.device("meta"):
        costs = UnitCosts.of(HookedRecurrentTransformer(full))
    model = HookedRecurrentTransformer(cfg).eval()
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.d_vocab, (2 * batches * batch, seq), generator=generator)
    evaluation = EvaluationSet.from_tokens(tokens[: batches * batch])
    calibration = EvaluationSet.from_tokens(tokens[batches * batch :])
    config = (config or BENCH_CONFIG).replace(batch_size=batch)
    protocol = DepthControlProtocol(model, config, progress=False)
    # The caps scaled to the preset's sequence length (a cap given in the config stays as is).
    controls = config.control_tokens
    counted = count_run(
        protocol,
        calibration,
        evaluation,
        costs,
        JACKKNIFE_TOKENS * seq // defaults["seq"],
        CONTROL_TOKENS * seq // defaults["seq"] if controls is None else int(controls),
    )
    return {
        "preset": preset,
        "counted_on": {"d_model": cfg.d_model, "d_vocab": cfg.d_vocab, "seq": seq},
        "weighed_at": {"d_model": full.d_model, "d_vocab": full.d_vocab, "seq": defaults["seq"]},
        "n_iterations": protocol.r,
        "k_grid": list(protocol.context.k_grid),
        "batch": batch,
        "batches": batches,
        "calibration_groups": config.calibration_groups,
        "probe": config.probe,
        **counted,
    }


def print_count(result: dict[str, Any], as_json: bool) -> None:
    """`run_count`'s result as JSON or as a table of forwards and readouts per token."""
    if as_json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    on, at = result["counted_on"], result["weighed_at"]
    print(
        f"{result['preset']} layout, r = {result['n_iterations']}, k grid {result['k_grid']}; "
        f"{result['batches']} batches of {result['batch']} x {on['seq']} tokens each side, "
        f"counted at d_model {on['d_model']}, vocabulary {on['d_vocab']}, weighed at d_model "
        f"{at['d_model']}, vocabulary {at['d_vocab']}; jackknife on "
        f"{result['jackknife_examples']} evaluation examples, shift and the translators on "
        f"{result['control_examples']}"
    )
    print(
        f"  {'stage':<22} {'forwards/token':>14} {'readouts/token':>15} {'seconds':>8} "
        f"{'syncs':>6} {'syncs/batch':>11}"
    )
    for stage, forwards in result["forwards_per_token"].items():
        readouts = result["readouts_per_token"][stage]
        per_batch = result["syncs_per_batch"].get(stage)
        print(
            f"  {stage:<22} {forwards:14.3f} {readouts:15.2f} "
            f"{result['stage_seconds'].get(stage, 0.0):8.2f} {result['syncs'].get(stage, 0):6d} "
            f"{'' if per_batch is None else f'{per_batch:.1f}':>11}"
        )
    print(
        f"  synchronisations counted by the {result['sync_counter']} (on the CPU an upper bound: "
        "every tensor read by the host counts)"
    )


def run_estimate(
    preset: str = "huginn",
    *,
    batch: int | None = None,
    seq: int | None = None,
    d_model: int | None = None,
    n_core: int | None = None,
    n_iterations: int | None = None,
    d_vocab: int | None = None,
    dtype: str = "bfloat16",
    config: ProtocolConfig | None = None,
    budget_gib: float | None = None,
) -> dict[str, Any]:
    """The estimated peak memory of a DCP run (`estimate_run_memory`) on ``preset``'s model shape,
    built on the meta device (no weights are allocated): what `dcp-lens run --dry-run` would
    print for such a model, without one. Returns the estimate's terms and stages in GiB."""
    from dcp_lens.protocol.budget import (
        GIB,
        ModelShape,
        estimate_with,
        largest_fitting_batch,
    )

    config = config or ProtocolConfig()
    from dcp_lens.model.hooked_recurrent_transformer import HookedRecurrentTransformer
    from dcp_lens.studies.bench import PRESET_DEFAULTS, bench_config

    cfg = bench_config(preset, d_model, n_core, n_iterations, d_vocab, seq)
    with torch.device("meta"):
        model = HookedRecurrentTransformer(cfg).to(getattr(torch, dtype))
    size = {**PRESET_DEFAULTS[preset], **({"seq": seq} if seq else {})}
    r = int(model.n_iterations)
    grid = config.grid(r)
    n_streams = 1 + 2 * sum(1 for k in grid if k < r)
    budget = None if budget_gib is None else int(budget_gib * GIB)

    def at(size_: int) -> Any:
        return estimate_with(
            ModelShape.of(model),
            config,
            n_streams,
            batch_size=size_,
            seq_len=size["seq"],
            budget=budget,
            device_type="cuda",
        )

    chosen = batch is None and budget is not None  # as `run` chooses with no --batch-size
    if chosen:
        batch = largest_fitting_batch(lambda b: at(b).peak_bytes <= budget, config.batch_size)
    batch = batch or config.batch_size
    estimate = at(batch)
    return {
        "preset": preset,
        "dtype": dtype,
        "batch": batch,
        "batch_from_budget": chosen,
        "seq": size["seq"],
        "k_grid": list(grid),
        "calibration_groups": config.calibration_groups,
        "parameters": ModelShape.of(model).n_parameters,
        "budget_gib": budget_gib,
        **estimate.to_dict(),
        "table": estimate.table(),
    }
