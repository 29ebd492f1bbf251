"""The trainer: AdamW, linear warmup + cosine decay, gradient clipping, a hop-count curriculum,
periodic held-out evaluation per hop count h and iteration count k, resumable safetensors
checkpoints, and bit-reproducible runs on CPU for a given seed.

``train(config, out_dir)`` writes::

    out_dir/train_config.json     the TrainConfig (JSON)
    out_dir/checkpoint/           state.safetensors (model, optimizer, RNG) + trainer_state.json
    out_dir/history.json          per-step loss, lr, iterations, max_hops; periodic evaluations
    out_dir/model/                the trained model (save_pretrained)
    out_dir/accuracy_table.json   held-out accuracy per h and per k (k = 1..r + a few beyond)

Curriculum: training batches draw chains of at most ``max_hops`` hops (the task's per-batch
override). ``"mastery"`` raises it by one when the latest evaluation's full-depth accuracy on
queries of exactly that many hops reaches ``curriculum_threshold``; ``"schedule"`` raises it in
equal steps so that it reaches the task's ``max_hops`` at ``curriculum_end_fraction`` of training.
Evaluations (and so mastery decisions) use the first ``eval_programs`` programs of the evaluation
split; the final table uses the first ``table_programs``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from dcp_lens.config import RecurrentConfig
from dcp_lens.devices import check_device
from dcp_lens.errors import DamagedFileError
from dcp_lens.hooked_recurrent_transformer import HookedRecurrentTransformer
from dcp_lens.tasks import SPLITS, Split, Task, get_task
from dcp_lens.training.regimes import (
    RegimeConfig,
    build_model,
    check_known_keys,
    readout_logits,
    regime_loss,
)
from dcp_lens.training.validation import check_train_dict, check_train_values
from dcp_lens.validation import (
    check_output_folder,
    naming_file,
    read_json_object,
    read_safetensors_file,
)

CONFIG_FILE = "train_config.json"
HISTORY_FILE = "history.json"
TABLE_FILE = "accuracy_table.json"
TASK_FILE = "task.json"
MODEL_DIR = "model"
CHECKPOINT_DIR = "checkpoint"
CHECKPOINT_TENSORS = "state.safetensors"
CHECKPOINT_STATE = "trainer_state.json"
CHECKPOINT_FORMAT = "dcp-lens-checkpoint/1"
CURRICULA = ("mastery", "schedule", "none")
# Fields that change how a run executes, not what it computes; a resumed run may change them.
RUN_FIELDS = ("threads", "device", "checkpoint_interval")
# Training example i of step s is example DATA_STRIDE * seed + s * batch_size of the train split.
DATA_STRIDE = 2**32


@dataclass
class TrainConfig:
    """Everything that determines a training run (round-trips through `to_dict` / JSON).

    Args:
        model: the recurrent architecture (``n_core > 0``); its ``n_iterations`` is r. The
            ``dense`` regime trains its matched dense model. ``model.seed`` is set to ``seed``.
        task: ``task.to_dict()`` of the task (``{"name": ..., **parameters}``).
        regime: the training regime; its None defaults are resolved against r when the
            config is built (so ``dataclasses.replace`` of ``model`` should pass an unresolved
            regime again, as `dcp_lens.training.preset` does).
        steps, batch_size: optimiser steps and programs per step.
        lr, min_lr_ratio, warmup_steps: linear warmup to ``lr`` over ``warmup_steps``, then
            cosine decay to ``lr * min_lr_ratio`` at ``steps``.
        weight_decay: AdamW decay of matrices (ndim >= 2); norms and biases are not decayed.
        betas: AdamW betas.
        grad_clip: maximum global gradient norm.
        eval_interval, eval_programs: evaluate every so many steps on so many programs.
        table_programs, table_extra_iterations: the final accuracy table's programs and how
            many k beyond r it reports (recurrent models only).
        checkpoint_interval: steps between checkpoints (one is also written at the end).
        curriculum: ``"mastery"``, ``"schedule"`` or ``"none"`` (see the module docstring).
        curriculum_start: the first max_hops of the curriculum.
        curriculum_threshold: accuracy at the current max_hops that counts as mastered.
        curriculum_end_fraction: ``"schedule"`` reaches the task's max_hops at this fraction.
        seed: model initialisation, training-data stream and iteration sampling.
        threads: torch CPU threads during training (bit-reproducibility needs the same count).
        device: where to train; bit-reproducibility is promised on CPU only.
    """

    model: RecurrentConfig
    task: dict[str, Any]
    regime: RegimeConfig = field(default_factory=RegimeConfig)
    steps: int = 2000
    batch_size: int = 64
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    eval_interval: int = 100
    eval_programs: int = 256
    table_programs: int = 1024
    table_extra_iterations: int = 4
    checkpoint_interval: int = 500
    curriculum: str = "mastery"
    curriculum_start: int = 1
    curriculum_threshold: float = 0.9
    curriculum_end_fraction: float = 0.5
    seed: int = 0
    threads: int = 1
    device: str = "cpu"

    def __post_init__(self) -> None:
        check_train_values(self)
        if self.model.is_dense:
            raise ValueError(
                "TrainConfig.model must be recurrent (n_core > 0); for a dense model use "
                "regime=RegimeConfig('dense'), which trains the matched dense model."
            )
        for name in ("steps", "batch_size", "eval_interval", "eval_programs", "table_programs"):
            _check_int(name, getattr(self, name), 1)
        for name in ("warmup_steps", "table_extra_iterations", "seed"):
            _check_int(name, getattr(self, name), 0)
        _check_int("checkpoint_interval", self.checkpoint_interval, 1)
        _check_int("threads", self.threads, 1)
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1):
            raise ValueError(
                f"need lr > 0 and 0 <= min_lr_ratio <= 1, got {self.lr}, {self.min_lr_ratio}."
            )
        if self.weight_decay < 0 or self.grad_clip <= 0:
            raise ValueError(
                f"need weight_decay >= 0 and grad_clip > 0, got "
                f"{self.weight_decay}, {self.grad_clip}."
            )
        if self.curriculum not in CURRICULA:
            raise ValueError(f"curriculum={self.curriculum!r} is not one of {CURRICULA}.")
        if not 0 < self.curriculum_end_fraction <= 1:
            raise ValueError(
                f"curriculum_end_fraction={self.curriculum_end_fraction} must be in (0, 1]."
            )
        self.model = RecurrentConfig.from_dict({**self.model.to_dict(), "seed": self.seed})
        self.regime = self.regime.resolved(self.model.n_iterations)
        task = self.build_task()  # raises on bad task parameters
        if task.d_vocab != self.model.d_vocab or task.n_ctx > self.model.n_ctx:
            raise ValueError(
                f"the model (d_vocab={self.model.d_vocab}, n_ctx={self.model.n_ctx}) does not "
                f"fit the task (d_vocab={task.d_vocab}, n_ctx={task.n_ctx}); build the model "
                "config with dcp_lens.training.model_config(task, ...)."
            )
        if self.curriculum != "none":
            task_max = getattr(task, "max_hops", None)
            if task_max is None:
                raise ValueError(
                    f"task {task.name!r} has no max_hops to schedule; use curriculum='none'."
                )
            if not 1 <= self.curriculum_start <= task_max:
                raise ValueError(
                    f"curriculum_start={self.curriculum_start} must be in 1..{task_max} "
                    "(the task's max_hops)."
                )

    def build_task(self) -> Task:
        """The task this config names."""
        if "name" not in self.task:
            raise ValueError(f"task={self.task!r} needs a 'name' key (use task.to_dict()).")
        return get_task(**self.task)

    @property
    def full_depth(self) -> int:
        """r for a recurrent regime; the number of layers for ``dense``."""
        if self.regime.name == "dense":
            return self.model.layers_for(self.model.n_iterations)
        return self.model.n_iterations

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values: the model and regime as their own dicts, betas as a list."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (RecurrentConfig, RegimeConfig)):
                value = value.to_dict()
            elif isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, dict):
                value = json.loads(json.dumps(value))
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Inverse of `to_dict`; unknown keys and values of the wrong type are an error."""
        check_train_dict(cls, data, "TrainConfig")
        check_known_keys(cls, data)
        values = dict(data)
        values["model"] = RecurrentConfig.from_dict(values["model"])
        if "regime" in values:
            values["regime"] = RegimeConfig.from_dict(values["regime"])
        if "betas" in values:
            values["betas"] = tuple(float(b) for b in values["betas"])
        for f in dataclasses.fields(cls):
            if f.type == "float" and f.name in values:
                values[f.name] = float(values[f.name])
        return cls(**values)

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> TrainConfig:
        """Read `to_json` output; errors name the file, the field and the value."""
        data = read_json_object(path)
        with naming_file(path):
            return cls.from_dict(data)


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}.")


# ------------------------------------------------------------------------------ evaluation


@dataclass
class AccuracyTable:
    """Held-out top-1 accuracy per hop count h and per iteration count k.

    Attributes:
        k_values: the iteration counts read out (layer counts for a dense model).
        overall: k -> accuracy over every query.
        by_hops: h -> k -> accuracy over queries of h hops (empty for tasks without hops).
        queries_per_hop: h -> number of queries of h hops.
        n_programs: programs evaluated (first ``n_programs`` of ``split``).
        split: the split evaluated.
        full_depth: r (or the number of layers of a dense model).
    """

    k_values: list[int]
    overall: dict[int, float]
    by_hops: dict[int, dict[int, float]]
    queries_per_hop: dict[int, int]
    n_programs: int
    split: str
    full_depth: int

    def at(self, hops: int, k: int) -> float:
        """Accuracy at h = ``hops`` and k (NaN when no query has that many hops)."""
        return self.by_hops.get(hops, {}).get(k, math.nan)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: long-format rows ``{"hops", "k", "accuracy", "queries"}``."""
        return {
            "split": self.split,
            "n_programs": self.n_programs,
            "full_depth": self.full_depth,
            "k_values": list(self.k_values),
            "overall": [{"k": k, "accuracy": self.overall[k]} for k in self.k_values],
            "rows": [
                {"hops": h, "k": k, "accuracy": acc, "queries": self.queries_per_hop[h]}
                for h, per_k in sorted(self.by_hops.items())
                for k, acc in per_k.items()
            ],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AccuracyTable:
        by_hops: dict[int, dict[int, float]] = {}
        queries: dict[int, int] = {}
        for row in data["rows"]:
            by_hops.setdefault(int(row["hops"]), {})[int(row["k"])] = float(row["accuracy"])
            queries[int(row["hops"])] = int(row["queries"])
        return cls(
            k_values=[int(k) for k in data["k_values"]],
            overall={int(r["k"]): float(r["accuracy"]) for r in data["overall"]},
            by_hops=by_hops,
            queries_per_hop=queries,
            n_programs=int(data["n_programs"]),
            split=str(data["split"]),
            full_depth=int(data["full_depth"]),
        )

    def format(self) -> str:
        """A text table: one row per h (and "all"), one column per k."""
        head = "h \\ k " + " ".join(f"{k:>5}" for k in self.k_values)
        lines = [head]
        for h, per_k in sorted(self.by_hops.items()):
            cells = " ".join(f"{per_k[k]:5.2f}" for k in self.k_values)
            lines.append(f"{h:>6} {cells}   ({self.queries_per_hop[h]} queries)")
        lines.append(f"{'all':>6} " + " ".join(f"{self.overall[k]:5.2f}" for k in self.k_values))
        return "\n".join(lines)


@torch.no_grad()
def evaluate_accuracy(
    model: HookedRecurrentTransformer,
    task: Task,
    n: int,
    k_values: Sequence[int] | None = None,
    *,
    split: Split = "evaluation",
    batch_size: int = 128,
    max_hops: int | None = None,
) -> AccuracyTable:
    """Accuracy of ``truncate(k)`` per hop count and per k on the first ``n`` programs of
    ``split``, with one forward pass per chunk of programs (k may exceed r on a recurrent model;
    on a dense model k counts layers). ``k_values`` defaults to 1..full depth; ``max_hops``
    overrides the task's chain length (tasks that have one)."""
    full_depth = model.cfg.n_layers if model.is_dense else model.cfg.n_iterations
    ks = list(range(1, full_depth + 1)) if k_values is None else [int(k) for k in k_values]
    if not ks or min(ks) < 1 or (model.is_dense and max(ks) > full_depth):
        raise ValueError(
            f"k_values={ks} must be non-empty, >= 1, and <= {full_depth} on a dense model."
        )
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {SPLITS}.")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct_total = torch.zeros(len(ks), dtype=torch.long)
    n_total = 0
    correct_by_hops: dict[int, torch.Tensor] = {}
    queries_by_hops: dict[int, int] = {}
    extra = {} if max_hops is None else {"max_hops": max_hops}
    try:
        for start in range(0, n, batch_size):
            batch = task.batch(split, min(batch_size, n - start), offset=start, **extra)
            logits = readout_logits(model, batch.tokens.to(device), ks)
            correct = torch.stack([batch.correct(each).cpu() for each in logits])  # [k, b, a]
            correct_total += correct.flatten(1).sum(1)
            n_total += correct[0].numel()
            hops = batch.metadata.get("hops")
            if hops is None:
                continue
            for h in hops.unique().tolist():
                mask = hops == h
                correct_by_hops[h] = correct_by_hops.get(h, 0) + correct[:, mask].sum(1)
                queries_by_hops[h] = queries_by_hops.get(h, 0) + int(mask.sum())
    finally:
        model.train(was_training)
    return AccuracyTable(
        k_values=ks,
        overall={k: float(c) / n_total for k, c in zip(ks, correct_total.tolist(), strict=True)},
        by_hops={
            h: {
                k: float(c) / queries_by_hops[h]
                for k, c in zip(ks, correct_by_hops[h].tolist(), strict=True)
            }
            for h in sorted(correct_by_hops)
        },
        queries_per_hop=dict(sorted(queries_by_hops.items())),
        n_programs=n,
        split=split,
        full_depth=full_depth,
    )


# ------------------------------------------------------------------------------- training


@dataclass
class TrainResult:
    """What `train` returns.

    Attributes:
        model: the trained model (eval mode).
        config: the resolved config.
        out_dir: the run folder.
        step: optimiser steps done.
        completed: True when ``step == config.steps`` (then the model, table and history were
            written); False after ``stop_at_step``.
        history: per-step records and evaluations (as in ``history.json``).
        accuracy_table: the final held-out table (None unless completed).
        seconds_per_step: wall time per step in this process (NaN when no step ran).
    """

    model: HookedRecurrentTransformer
    config: TrainConfig
    out_dir: Path
    step: int
    completed: bool
    history: dict[str, Any]
    accuracy_table: AccuracyTable | None
    seconds_per_step: float


def warmup_cosine(step: int, steps: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate at optimiser step ``step`` (0-based): linear warmup
    over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``steps``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def learning_rate(config: TrainConfig, step: int) -> float:
    """The learning rate of optimiser step ``step`` (0-based): warmup, then cosine decay."""
    return config.lr * warmup_cosine(step, config.steps, config.warmup_steps, config.min_lr_ratio)


def decay_groups(named: dict[str, torch.Tensor], weight_decay: float) -> list[dict[str, Any]]:
    """AdamW parameter groups: matrices decay, vectors (norms, biases) do not."""
    return [
        {"params": [p for p in named.values() if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in named.values() if p.ndim < 2], "weight_decay": 0.0},
    ]


def scheduled_max_hops(config: TrainConfig, task_max_hops: int, step: int) -> int:
    """The ``"schedule"`` curriculum's max_hops after ``step`` steps."""
    levels = task_max_hops - config.curriculum_start + 1
    end = config.curriculum_end_fraction * config.steps
    return min(task_max_hops, config.curriculum_start + int(levels * step / end))


@contextlib.contextmanager
def deterministic_torch(threads: int, device: str = "cpu") -> Iterator[None]:
    """Deterministic algorithms and a fixed CPU thread count, restored on exit. Off the CPU an
    op without a deterministic version warns instead of failing (no bit-reproducibility there)."""
    previous_threads = torch.get_num_threads()
    previous_deterministic = torch.are_deterministic_algorithms_enabled()
    previous_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    on_cpu = torch.device(device).type == "cpu"
    if not on_cpu:
        # cuBLAS is deterministic only with a fixed workspace, read when its handle is created.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=not on_cpu)
    try:
        yield
    finally:
        torch.set_num_threads(previous_threads)
        torch.use_deterministic_algorithms(previous_deterministic, warn_only=previous_warn)


def make_optimizer(
    model: HookedRecurrentTransformer, config: TrainConfig
) -> tuple[torch.optim.AdamW, list[str]]:
    """AdamW over every parameter once (shared core weights once), decaying matrices only;
    returns the optimizer and the canonical names of its parameters, in its order."""
    named = model.canonical_state_dict()
    if {id(p) for p in model.parameters()} != {id(p) for p in named.values()}:
        raise RuntimeError(
            "canonical_state_dict() does not hold exactly the model's parameters, so the "
            "optimizer state cannot be checkpointed by name; fix canonical_state_dict."
        )
    order = [n for n, p in named.items() if p.ndim >= 2] + [
        n for n, p in named.items() if p.ndim < 2
    ]
    groups = decay_groups(named, config.weight_decay)
    optimizer = torch.optim.AdamW(groups, lr=config.lr, betas=config.betas)
    return optimizer, order


@dataclass
class _RunState:
    """The trainer's plain (JSON) state besides tensors."""

    step: int
    max_hops: int | None
    history: dict[str, Any]


def train(
    config: TrainConfig,
    out_dir: str | Path,
    resume: bool = True,
    *,
    stop_at_step: int | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train ``config`` into ``out_dir`` (see the module docstring for what is written).

    With ``resume`` a checkpoint in ``out_dir`` is continued (its config must match, apart
    from `RUN_FIELDS`); without, any previous run there is replaced. ``stop_at_step`` stops
    after that many steps with a checkpoint, as an interruption would; calling `train` again
    continues bit-identically (on CPU) to an uninterrupted run."""
    out = check_output_folder(out_dir, "out_dir")
    check_device(config.device)
    out.mkdir(parents=True, exist_ok=True)
    _prepare_run_folder(config, out, resume)
    config.to_json(out / CONFIG_FILE)
    end = config.steps if stop_at_step is None else min(config.steps, stop_at_step)

    with deterministic_torch(config.threads, config.device):
        torch.manual_seed(config.seed)
        task = config.build_task()
        model = build_model(config.model, config.regime).to(config.device)
        model.train()
        optimizer, names = make_optimizer(model, config)
        sampler = torch.Generator().manual_seed(config.seed)
        state = _RunState(
            step=0,
            max_hops=None if config.curriculum == "none" else config.curriculum_start,
            history={"steps": [], "evaluations": [], "curriculum": []},
        )
        if state.max_hops is not None:
            state.history["curriculum"].append({"step": 0, "max_hops": state.max_hops})
        checkpoint = _checkpoint_dir(out)
        if resume and checkpoint is not None:
            state = _load_checkpoint(checkpoint, model, optimizer, names, sampler)

        started, first_step = time.perf_counter(), state.step
        bar = tqdm(
            total=config.steps,
            initial=state.step,
            disable=not progress,
            desc=f"train {config.regime.name}",
        )
        while state.step < end:
            record = _train_step(config, task, model, optimizer, sampler, state)
            state.history["steps"].append(record)
            state.step += 1
            bar.update(1)
            if state.step % 10 == 0 or state.step == end:
                bar.set_postfix(loss=f"{record['loss']:.3f}", h=record["max_hops"])
            _advance_curriculum(config, task, model, state)
            if state.step % config.checkpoint_interval == 0 or state.step == end:
                _save_checkpoint(out, model, optimizer, names, sampler, state, config)
            if state.step % config.eval_interval == 0 or state.step == end:
                _write_json(out / HISTORY_FILE, state.history)  # for watching a run
        bar.close()
        elapsed = time.perf_counter() - started
        done = state.step - first_step
        seconds_per_step = elapsed / done if done else math.nan

        table = None
        timing = seconds_per_step if done else None  # JSON has no NaN
        if state.step == config.steps:
            model.save_pretrained(out / MODEL_DIR)
            _write_json(out / MODEL_DIR / TASK_FILE, config.task)  # `dcp-lens run` reads it
            extra = 0 if model.is_dense else config.table_extra_iterations
            table = evaluate_accuracy(
                model,
                task,
                config.table_programs,
                range(1, config.full_depth + extra + 1),
            )
            _write_json(out / TABLE_FILE, table.to_dict())
            _write_json(
                out / HISTORY_FILE,
                {**state.history, "timing": {"seconds_per_step": timing}},
            )
    return TrainResult(
        model=model.eval(),
        config=config,
        out_dir=out,
        step=state.step,
        completed=table is not None,
        history=state.history,
        accuracy_table=table,
        seconds_per_step=seconds_per_step,
    )


def _train_step(
    config: TrainConfig,
    task: Task,
    model: HookedRecurrentTransformer,
    optimizer: torch.optim.Optimizer,
    sampler: torch.Generator,
    state: _RunState,
) -> dict[str, Any]:
    """One optimiser step; returns its history record."""
    offset = DATA_STRIDE * config.seed + state.step * config.batch_size
    extra = {} if state.max_hops is None else {"max_hops": state.max_hops}
    batch = task.batch("train", config.batch_size, offset=offset, **extra)
    lr = learning_rate(config, state.step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    tokens, targets = batch.tokens.to(config.device), batch.targets.to(config.device)
    loss, iterations = regime_loss(model, config.regime, tokens, targets, sampler)
    if not torch.isfinite(loss):
        raise FloatingPointError(
            f"the loss is {loss.item()} at step {state.step}; lower lr (now {config.lr}) or "
            "raise warmup_steps."
        )
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    optimizer.step()
    return {
        "step": state.step + 1,
        "loss": loss.item(),
        "lr": lr,
        "grad_norm": grad_norm.item(),
        "iterations": iterations,
        "max_hops": state.max_hops,
    }


def _advance_curriculum(
    config: TrainConfig, task: Task, model: HookedRecurrentTransformer, state: _RunState
) -> None:
    """Evaluate when due, then move the curriculum's max_hops on if its rule says so."""
    task_max = getattr(task, "max_hops", None)
    before = state.max_hops
    if config.curriculum == "schedule" and task_max is not None:
        state.max_hops = scheduled_max_hops(config, task_max, state.step)
    if state.step % config.eval_interval == 0 or state.step == config.steps:
        table = evaluate_accuracy(model, task, config.eval_programs)
        state.history["evaluations"].append(
            {"step": state.step, "max_hops": before, "accuracy": table.to_dict()}
        )
        if (
            config.curriculum == "mastery"
            and state.max_hops is not None
            and task_max is not None
            and state.max_hops < task_max
            and table.at(state.max_hops, table.full_depth) >= config.curriculum_threshold
        ):
            state.max_hops += 1
    if state.max_hops != before:
        state.history["curriculum"].append({"step": state.step, "max_hops": state.max_hops})


# ---------------------------------------------------------------------------- checkpoints


def config_differences(saved_path: Path, config: TrainConfig) -> list[str]:
    """The fields, other than `RUN_FIELDS`, in which the config saved at ``saved_path``
    differs from ``config`` (sorted; empty when the run is a run of ``config``)."""
    saved = TrainConfig.from_json(saved_path).to_dict()
    current = config.to_dict()
    return sorted(k for k in current if k not in RUN_FIELDS and saved.get(k) != current[k])


def _prepare_run_folder(config: TrainConfig, out: Path, resume: bool) -> None:
    """Check a previous run in ``out`` matches (resume) or clear it (no resume)."""
    saved_path = out / CONFIG_FILE
    if not resume:
        for name in (CHECKPOINT_DIR, CHECKPOINT_DIR + ".old", CHECKPOINT_DIR + ".tmp"):
            shutil.rmtree(out / name, ignore_errors=True)
        return
    if _checkpoint_dir(out) is None or not saved_path.is_file():
        return
    differ = config_differences(saved_path, config)
    if differ:
        raise ValueError(
            f"{out} holds a run with a different config (fields {differ} differ); resume it "
            "with the same config, pick another out_dir, or pass resume=False to replace it."
        )


def _checkpoint_dir(out: Path) -> Path | None:
    """The latest complete checkpoint folder in ``out``, if any."""
    for name in (CHECKPOINT_DIR, CHECKPOINT_DIR + ".old"):
        folder = out / name
        if (folder / CHECKPOINT_TENSORS).is_file() and (folder / CHECKPOINT_STATE).is_file():
            return folder
    return None


def _save_checkpoint(
    out: Path,
    model: HookedRecurrentTransformer,
    optimizer: torch.optim.Optimizer,
    names: list[str],
    sampler: torch.Generator,
    state: _RunState,
    config: TrainConfig,
) -> None:
    """Write the checkpoint to a temporary folder, then swap it in (never a half-written one)."""
    tensors = {
        f"model.{k}": v.detach().cpu().contiguous() for k, v in model.canonical_state_dict().items()
    }
    optimizer_state = optimizer.state_dict()
    for index, per_parameter in optimizer_state["state"].items():
        for key, value in per_parameter.items():
            tensors[f"optimizer.{names[index]}.{key}"] = value.detach().cpu().contiguous()
    tensors["rng.sampler"] = sampler.get_state()
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        for i, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = cuda_state
    plain = {
        "format": CHECKPOINT_FORMAT,
        "step": state.step,
        "max_hops": state.max_hops,
        "history": state.history,
        "parameter_names": names,
        "param_groups": optimizer_state["param_groups"],
        "config": config.to_dict(),
    }
    tmp, final, old = (out / (CHECKPOINT_DIR + s) for s in (".tmp", "", ".old"))
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(tensors, str(tmp / CHECKPOINT_TENSORS), metadata={"format": CHECKPOINT_FORMAT})
    _write_json(tmp / CHECKPOINT_STATE, plain)
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _load_checkpoint(
    folder: Path,
    model: HookedRecurrentTransformer,
    optimizer: torch.optim.Optimizer,
    names: list[str],
    sampler: torch.Generator,
) -> _RunState:
    """Restore model, optimizer and RNG from ``folder``; return the trainer state."""
    recovery = (
        f"Delete {folder} to resume from the previous checkpoint (if {CHECKPOINT_DIR}.old "
        "exists) or from scratch, or pass resume=False (--no-resume) to start over."
    )
    plain = read_json_object(folder / CHECKPOINT_STATE, error=DamagedFileError, recovery=recovery)
    if plain.get("format") != CHECKPOINT_FORMAT or plain["parameter_names"] != names:
        raise ValueError(
            f"{folder} is not a checkpoint of this model (format {plain.get('format')!r}); "
            "pass resume=False to start over."
        )
    tensors = read_safetensors_file(folder / CHECKPOINT_TENSORS, recovery=recovery)
    model.load_canonical_state_dict(
        {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")},
        source=str(folder),
    )
    per_parameter: dict[int, dict[str, torch.Tensor]] = {}
    for index, name in enumerate(names):
        prefix = f"optimizer.{name}."
        entries = {k.removeprefix(prefix): v for k, v in tensors.items() if k.startswith(prefix)}
        if entries:
            per_parameter[index] = entries
    groups = [{**g, "betas": tuple(g["betas"])} for g in plain["param_groups"]]
    optimizer.load_state_dict({"state": per_parameter, "param_groups": groups})
    sampler.set_state(tensors["rng.sampler"])
    torch.set_rng_state(tensors["rng.torch"])
    if torch.cuda.is_available():
        cuda_keys = [f"rng.cuda.{i}" for i in range(torch.cuda.device_count())]
        if all(key in tensors for key in cuda_keys):
            torch.cuda.set_rng_state_all([tensors[key] for key in cuda_keys])
    return _RunState(step=plain["step"], max_hops=plain["max_hops"], history=plain["history"])


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
