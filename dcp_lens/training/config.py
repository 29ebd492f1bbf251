"""What determines a training run: `TrainConfig` (round-trips through JSON), the names of the
files a run folder holds, and the constants the trainer's loop and checkpoints share."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dcp_lens.model.config import RecurrentConfig
from dcp_lens.tasks import Task, get_task
from dcp_lens.training.checks import check_train_dict, check_train_values
from dcp_lens.training.regimes import RegimeConfig, check_known_keys
from dcp_lens.utils.checks import naming_file, read_json_object

TRAIN_CONFIG_FILE = "train_config.json"
HISTORY_FILE = "history.json"
TABLE_FILE = "accuracy_table.json"
MODEL_DIR = "model"
CHECKPOINT_DIR = "checkpoint"
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
        curriculum: ``"mastery"``, ``"schedule"`` or ``"none"`` (see `dcp_lens.training.loop`).
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
        from dcp_lens.utils.files import write_text_atomically

        write_text_atomically(path, json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> TrainConfig:
        """Read `to_json` output; errors name the file, the field and the value."""
        data = read_json_object(path)
        with naming_file(path):
            return cls.from_dict(data)


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}.")
