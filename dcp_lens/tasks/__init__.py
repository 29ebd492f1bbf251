"""Evaluation and training tasks, one file per task behind a registry.

>>> from dcp_lens.tasks import get_task
>>> task = get_task("variable_binding", n_lines=6, max_hops=4, seed=0)
>>> batch = task.batch("train", 64, offset=0)     # next step: offset=64, ...
>>> held_out = task.evaluation(256)               # fixed for the seed, disjoint from train

Every task returns a `TaskBatch`; ``get_task(**task.to_dict())`` rebuilds a task.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from dcp_lens.model.loss import IGNORE_INDEX
from dcp_lens.tasks.base import SPLITS, Split, Task, TaskBatch, check_task_tokens
from dcp_lens.tasks.char_lm import CharLM
from dcp_lens.tasks.text import TextLM
from dcp_lens.tasks.variable_binding import Program, VariableBinding
from dcp_lens.utils.checks import LIMITS, check_field_types, check_limit
from dcp_lens.utils.errors import ConfigError, ConfigTypeError, DCPLensError
from dcp_lens.utils.registry import add_entry

TASKS: dict[str, type[Task]] = {
    VariableBinding.name: VariableBinding,
    CharLM.name: CharLM,
    TextLM.name: TextLM,
}


def register_task(task_class: type[Task]) -> type[Task]:
    """Add a task class to `TASKS` under its ``name`` (usable as a class decorator)."""
    return add_entry(TASKS, task_class.name, task_class, "task")


def get_task(name: str, **kwargs: object) -> Task:
    """The task registered as ``name``, built with ``kwargs`` (its parameters).

    Raises:
        ConfigError: an unknown task, an unknown parameter, or a parameter of the wrong type or
            out of range (named, with its value).
    """
    check_task_config({"name": name, **kwargs}, f"task {name!r}")
    try:
        return TASKS[name](**kwargs)
    except DCPLensError:
        raise
    except (ValueError, TypeError) as error:
        raise ConfigError(f"task {name!r}: {error}") from error


def task_of(model: object) -> Any:
    """The task a model was trained on, built from its ``task_config`` (the ``task.json`` beside
    its weights), or the task it was built with (``model.task_object``, planted models):
    ``task_of(model).evaluation(256)`` feeds `DepthControlProtocol.run`.

    Raises:
        ConfigError: the model records no task (it was not trained by dcp-lens), or its task
            config names an unknown task or a bad parameter.
    """
    built = getattr(model, "task_object", None)  # a model built with its task (planted models)
    if built is not None:
        return built
    config = getattr(model, "task_config", None)
    if not config:
        raise ConfigError(
            "this model records no task (no task.json beside its weights); build one with "
            "dcp_lens.tasks.get_task(name, ...) or pass evaluation sets directly."
        )
    check_task_config(config, f"{getattr(model, 'spec', None) or 'the model'}'s task.json")
    return get_task(**config)


def check_task_config(config: object, source: str) -> None:
    """Check a task's ``to_dict()`` (as ``task.json`` holds it): an object with a registered
    ``name`` and that task's parameters, each of its declared type.

    Raises:
        ConfigError: naming ``source``, the field, its value and what was expected.
    """
    if not isinstance(config, Mapping):
        raise ConfigTypeError(
            f'{source} must be a JSON object {{"name": ..., parameters}}, got '
            f"{type(config).__name__}."
        )
    name = config.get("name")
    if not isinstance(name, str) or name not in TASKS:
        raise ConfigError(
            f"{source}: unknown task {name!r} (field name); registered tasks: {sorted(TASKS)}."
        )
    task_class = TASKS[name]
    parameters = {key: value for key, value in config.items() if key != "name"}
    known = {f.name for f in dataclasses.fields(task_class) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(parameters) - known)
    if unknown:
        raise ConfigError(
            f"{source}: unknown {name} parameters {unknown}; known parameters: {sorted(known)}."
        )
    check_field_types(task_class, parameters, source)
    for key, value in parameters.items():  # sizes bounded before anything is built
        if key in LIMITS and isinstance(value, int):
            check_limit(key, value, source)


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
    "check_task_config",
    "check_task_tokens",
    "get_task",
    "register_task",
    "task_of",
]
