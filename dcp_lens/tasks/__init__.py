"""Evaluation and training tasks, one file per task behind a registry.

>>> from dcp_lens.tasks import get_task
>>> task = get_task("variable_binding", n_lines=6, max_hops=4, seed=0)
>>> batch = task.batch("train", 64, offset=0)     # next step: offset=64, ...
>>> held_out = task.evaluation(256)               # fixed for the seed, disjoint from train

Every task returns a `TaskBatch`; ``get_task(**task.to_dict())`` rebuilds a task.
"""

from __future__ import annotations

from typing import Any

from dcp_lens.metrics import IGNORE_INDEX
from dcp_lens.registry import add_entry
from dcp_lens.tasks.base import SPLITS, Split, Task, TaskBatch, check_task_tokens
from dcp_lens.tasks.char_lm import CharLM
from dcp_lens.tasks.text import TextLM
from dcp_lens.tasks.variable_binding import Program, VariableBinding

TASKS: dict[str, type[Task]] = {
    VariableBinding.name: VariableBinding,
    CharLM.name: CharLM,
    TextLM.name: TextLM,
}


def register_task(task_class: type[Task]) -> type[Task]:
    """Add a task class to `TASKS` under its ``name`` (usable as a class decorator)."""
    return add_entry(TASKS, task_class.name, task_class, "task")


def get_task(name: str, **kwargs: Any) -> Task:
    """The task registered as ``name``, built with ``kwargs`` (its parameters)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; registered tasks: {sorted(TASKS)}.")
    return TASKS[name](**kwargs)


__all__ = [
    "IGNORE_INDEX",
    "SPLITS",
    "TASKS",
    "CharLM",
    "Program",
    "Split",
    "Task",
    "TaskBatch",
    "TextLM",
    "VariableBinding",
    "check_task_tokens",
    "get_task",
    "register_task",
]
