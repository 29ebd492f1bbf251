"""The training loop: AdamW, linear warmup + cosine decay, gradient clipping, a hop-count
curriculum, periodic held-out evaluation per hop count h and iteration count k, resumable
safetensors checkpoints, and bit-reproducible runs on CPU for a given seed.

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
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dcp_lens.model.folder import TASK_FILE
from dcp_lens.model.hooked_recurrent_transformer import HookedRecurrentTransformer
from dcp_lens.tasks import Task
from dcp_lens.training.config import (
    DATA_STRIDE,
    HISTORY_FILE,
    MODEL_DIR,
    TABLE_FILE,
    TRAIN_CONFIG_FILE,
    TrainConfig,
)
from dcp_lens.training.evaluation import AccuracyTable, evaluate_accuracy
from dcp_lens.training.regimes import build_regime_model, regime_loss
from dcp_lens.training.state import (
    History,
    RunState,
    StepRecord,
    latest_checkpoint,
    load_checkpoint,
    prepare_run_folder,
    save_checkpoint,
    write_json,
)
from dcp_lens.utils.devices import check_device
from dcp_lens.utils.files import check_output_folder, naming_full_disk
from dcp_lens.utils.folders import OutputFolder
from dcp_lens.utils.progress import progress as progress_display


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
    history: History
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
    check_output_folder(out_dir, "out_dir")
    check_device(config.device)
    # A new folder or a training run's (resumed, or with resume=False replaced: its own files
    # go, files added to it stay); locked while training writes it.
    folder = OutputFolder(
        Path(out_dir), "train", resume=resume, overwrite=not resume, on_finished="continue"
    )
    folder.open()
    try:
        out = folder.prepare()
        prepare_run_folder(config, out, resume)
        config.to_json(out / TRAIN_CONFIG_FILE)
        result = _train(config, out, resume, stop_at_step, progress)
    except BaseException:  # a new folder with no checkpoint to resume from goes
        fresh = folder.action == "new" and latest_checkpoint(Path(folder.real)) is None
        folder.close(abandon=fresh)
        raise
    if result.completed:
        folder.finish()
    else:
        folder.close()
    return result


def _train(
    config: TrainConfig, out: Path, resume: bool, stop_at_step: int | None, progress: bool
) -> TrainResult:
    end = config.steps if stop_at_step is None else min(config.steps, stop_at_step)

    with deterministic_torch(config.threads, config.device):
        torch.manual_seed(config.seed)
        task = config.build_task()
        model = build_regime_model(config.model, config.regime).to(config.device)
        model.train()
        optimizer, names = make_optimizer(model, config)
        sampler = torch.Generator().manual_seed(config.seed)
        state = RunState(
            step=0,
            max_hops=None if config.curriculum == "none" else config.curriculum_start,
            history={"steps": [], "evaluations": [], "curriculum": []},
        )
        if state.max_hops is not None:
            state.history["curriculum"].append({"step": 0, "max_hops": state.max_hops})
        checkpoint = latest_checkpoint(out)
        if resume and checkpoint is not None:
            state = load_checkpoint(checkpoint, model, optimizer, names, sampler)

        started, first_step = time.perf_counter(), state.step
        bar = progress_display(
            total=config.steps,
            initial=state.step,
            enabled=progress,
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
                save_checkpoint(out, model, optimizer, names, sampler, state, config)
            if state.step % config.eval_interval == 0 or state.step == end:
                write_json(out / HISTORY_FILE, state.history)  # for watching a run
        bar.close()
        elapsed = time.perf_counter() - started
        done = state.step - first_step
        seconds_per_step = elapsed / done if done else math.nan

        table = None
        timing = seconds_per_step if done else None  # JSON has no NaN
        if state.step == config.steps:
            with naming_full_disk(out / MODEL_DIR):
                model.save_pretrained(out / MODEL_DIR)
            write_json(out / MODEL_DIR / TASK_FILE, config.task)  # `dcp-lens run` reads it
            extra = 0 if model.is_dense else config.table_extra_iterations
            table = evaluate_accuracy(
                model,
                task,
                config.table_programs,
                range(1, config.full_depth + extra + 1),
            )
            write_json(out / TABLE_FILE, table.to_dict())
            write_json(
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
    state: RunState,
) -> StepRecord:
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
    config: TrainConfig, task: Task, model: HookedRecurrentTransformer, state: RunState
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
