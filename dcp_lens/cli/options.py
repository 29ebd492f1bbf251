"""The command line's option tables, and `ProtocolConfig` on the command line: every setting
declared as an option of a command from the field's metadata (one spelling, one help), and the
config built back from parsed options. Reads no registry when declaring, so the parser builds
without importing torch."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

from dcp_lens.cli.arguments import ints, names
from dcp_lens.protocol.config import COMMAND_DEFAULTS, ProtocolConfig

TASK_FILES = ("char_lm", "text")  # tasks read from a local file: NAME:PATH
# Model specs KIND:PATH of local files.
PATH_KINDS = ("huginn", "ouro", "llama2c", "bridge", "raven-retrofit")
# The compute dtypes `run` and `bench` take (statistics stay float64): the names of
# `dcp_lens.utils.checks.WEIGHT_DTYPES`, written here so that the parser does not import torch.
DTYPES = ("float64", "float32", "bfloat16", "float16")
EXPERIMENTS = ("training-intervention",)
# One thread: OpenMP threads spin-wait for a core another process holds (docs/cli.md).
DEFAULT_THREADS = 1


def add_protocol_options(
    parser: argparse.ArgumentParser,
    command: str,
    *,
    skip: Sequence[str] = (),
    unset: Sequence[str] = (),
) -> None:
    """Declare every `ProtocolConfig` setting as an option of ``command``: the one spelling and
    help each field's metadata gives, with ``command``'s default (`COMMAND_DEFAULTS`); ``skip``
    leaves settings out, ``unset`` defaults them to None (the command decides). An old spelling
    (``--batch``) is a hidden alias that warns."""
    defaults = COMMAND_DEFAULTS.get(command, {})
    for setting in dataclasses.fields(ProtocolConfig):
        if setting.name in skip:
            continue
        meta = setting.metadata
        default = None if setting.name in unset else defaults.get(setting.name, setting.default)
        options: dict[str, Any] = {"help": meta["help"]}
        if isinstance(setting.default, bool):
            options.update(action=argparse.BooleanOptionalAction, default=default)
        elif meta.get("kind") in ("ints", "names"):
            options["default"] = None if default is None else ",".join(map(str, default))
        elif isinstance(setting.default, int):
            options.update(type=int, default=default)
        else:
            options.update(default=default, choices=meta.get("choices"))
        parser.add_argument(meta["flag"], **options)


def protocol_config(args: argparse.Namespace, command: str) -> ProtocolConfig:
    """The `ProtocolConfig` of ``command``'s parsed options (`add_protocol_options`): its
    defaults, then every setting given. A setting the command does not declare, or leaves to
    itself (None), keeps the command's default."""
    values = dict(COMMAND_DEFAULTS.get(command, {}))
    for setting in dataclasses.fields(ProtocolConfig):
        flag = setting.metadata["flag"]
        value = getattr(args, flag.lstrip("-").replace("-", "_"), None)
        if value is None:
            continue
        kind = setting.metadata.get("kind")
        if kind == "ints":
            value = tuple(ints(value, flag) or ())
        elif kind == "names":
            value = names(value)
        values[setting.name] = value
    return ProtocolConfig.from_dict(values)


def registered_names(kinds: Sequence[str]) -> str:
    """Lines of help naming what the metric, calibration map and task registries hold
    (``kinds``: "metrics", "maps", "tasks"). Imports them, and torch, only when help is shown:
    argument errors stay instant."""
    from dcp_lens.protocol.calibration import CALIBRATION_MAPS
    from dcp_lens.protocol.metrics import METRICS
    from dcp_lens.tasks import TASKS

    tasks = [f"{name}:PATH" if name in TASK_FILES else name for name in TASKS]
    lines = {
        "metrics": f"metrics (--metrics): {', '.join(METRICS)}",
        "maps": f"calibration maps (--calibration-mode): {', '.join(CALIBRATION_MAPS)}",
        "tasks": f"tasks (--task): {', '.join(tasks)} (PATH: a local corpus file)",
    }
    return "\n".join(lines[kind] for kind in kinds)


__all__ = [
    "DEFAULT_THREADS",
    "DTYPES",
    "EXPERIMENTS",
    "PATH_KINDS",
    "TASK_FILES",
    "add_protocol_options",
    "protocol_config",
    "registered_names",
]
