"""Checks of a training config (`TrainConfig` calls them), kept apart from the training loop.

`check_train_dict` runs on a ``train_config.json`` before anything is converted;
`check_train_values` on a constructed config before its ranges are checked. Both name the
source, the field and the value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from dcp_lens.utils.checks import check_field_types
from dcp_lens.utils.errors import ConfigError, ConfigTypeError

# Keys a train_config.json must hold: the others have defaults.
REQUIRED_KEYS = ("model", "task")


def check_train_dict(config_class: type, data: object, source: str) -> None:
    """``data`` (a ``TrainConfig.to_dict()``, e.g. read from JSON) holds an object per nested
    config and a value of the declared type per field."""
    if not isinstance(data, Mapping):
        raise ConfigTypeError(
            f"{source} must hold a JSON object of TrainConfig fields, got {type(data).__name__}."
        )
    missing = [key for key in REQUIRED_KEYS if key not in data]
    if missing:
        raise ConfigError(f"{source}: missing fields {missing}; write it with TrainConfig.to_json.")
    for key in ("model", "task", "regime"):
        if key in data and not isinstance(data[key], Mapping):
            raise ConfigTypeError(
                f"{source}: field {key}={data[key]!r} must be a JSON object of its fields."
            )
    nested = {"model", "regime"}
    plain = {key: value for key, value in data.items() if key not in nested}
    check_field_types(config_class, plain, source)


def check_train_values(config: Any) -> None:
    """Every field of a `TrainConfig` has its declared type, and its device is a device name
    (whether it exists here is checked when training starts: a run may resume elsewhere)."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    check_field_types(type(config), values, "TrainConfig")
    try:
        torch.device(config.device)
    except (RuntimeError, ValueError) as error:
        raise ConfigError(
            f"TrainConfig: field device={config.device!r} is not a device name (e.g. 'cpu', "
            "'cuda:0')."
        ) from error


__all__ = ["check_train_dict", "check_train_values"]
