"""Checks where values enter dcp-lens: config fields against their declared types, JSON and
safetensors files, weight dtypes, file locations and size limits.

One schema serves every config: a dataclass's own annotations (`check_field_types`), so
`RecurrentConfig`, task parameters and `TrainConfig` are checked by the types they declare, and
a loader's source config (Huginn's, Ouro's ``config.json``) by a small table of the same kind
(`check_source_fields`). Errors are `dcp_lens.utils.errors` classes naming the file, the field, the
value and what was expected.
"""

from __future__ import annotations

import collections.abc
import contextlib
import dataclasses
import functools
import json
import math
import numbers
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

import torch

from dcp_lens.utils.errors import (
    ConfigError,
    ConfigTypeError,
    DamagedFileError,
    DCPLensError,
    InputError,
    MissingFileError,
    ResourceLimitError,
    WeightsError,
)

# Sane bounds, checked before anything is built: far above every real model dcp-lens reads
# (Huginn: 4096 positions, 65536 tokens, 32 iterations; Ouro: 65536 positions, 49152 tokens),
# far below a size that would exhaust memory building rotary tables, embeddings or views.
LIMITS: dict[str, int] = {
    "n_ctx": 1 << 20,
    "d_vocab": 1 << 22,
    "d_model": 1 << 16,
    "d_head": 1 << 12,
    "d_mlp": 1 << 20,
    "n_heads": 1 << 12,
    "n_key_value_heads": 1 << 12,
    "n_prelude": 1024,
    "n_core": 1024,
    "n_coda": 1024,
    "n_iterations": 1024,
}

# Floating dtypes dcp-lens computes in; complex, integer, boolean and float8 weights are refused.
WEIGHT_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
# safetensors header dtype names of the same four.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}


# ----------------------------------------------------------------------------- config fields


def check_field_types(cls: type, values: Mapping[str, object], source: str) -> None:
    """Raise `ConfigTypeError` for the first value whose type its dataclass field does not declare.

    Integers are ints (never booleans), floats are finite ints or floats, booleans are booleans,
    ``X | None`` admits None, ``Literal[...]`` its values, sequences their element type.
    Fields ``cls`` does not declare are left to the caller's unknown-key check.
    """
    hints = _type_hints(cls)
    for name, value in values.items():
        if name in hints and not _matches(value, hints[name]):
            raise ConfigTypeError(
                f"{source}: field {name}={value!r} ({type(value).__name__}) is not "
                f"{describe_type(hints[name])}."
            )


def as_declared_floats(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with the ints of ``float`` fields made floats (JSON writes 1.0 as 1), so the
    constructor sees the declared type."""
    hints = _type_hints(cls)

    def declared(name: str, value: object) -> object:
        whole = isinstance(value, int) and not isinstance(value, bool)
        if whole and isinstance(value, int) and _declares_float(hints.get(name)):
            return float(value)
        return value

    return {name: declared(name, value) for name, value in values.items()}


def _declares_float(annotation: object) -> bool:
    if annotation is float:
        return True
    origin = typing.get_origin(annotation)
    return origin in (typing.Union, types.UnionType) and float in typing.get_args(annotation)


def check_source_fields(
    config: Mapping[str, object],
    schema: Mapping[str, object],
    source: str,
    positive: tuple[str, ...],
) -> None:
    """Check a loader's source config against ``schema`` (key -> annotation, e.g. ``int | None``)
    and that the keys in ``positive`` hold numbers > 0 where present."""
    if not isinstance(config, Mapping):
        raise ConfigTypeError(
            f"{source} must hold a JSON object of config fields, got {type(config).__name__}."
        )
    for key, annotation in schema.items():
        if key in config and not _matches(config[key], annotation):
            value = config[key]
            raise ConfigTypeError(
                f"{source}: field {key}={value!r} ({type(value).__name__}) is not "
                f"{describe_type(annotation)}."
            )
    for key in positive:
        value = config.get(key)
        if value is not None and not (isinstance(value, int | float) and value > 0):
            raise ConfigError(f"{source}: field {key}={value!r} must be > 0.")


def check_limit(name: str, value: int, source: str = "config") -> None:
    """Raise `ResourceLimitError` if ``value`` exceeds ``LIMITS[name]``."""
    limit = LIMITS.get(name)
    if limit is not None and value > limit:
        raise ResourceLimitError(
            f"{source}: {name}={value} exceeds dcp-lens's bound of {limit}; a model this size "
            "would exhaust memory before running. Check the config for a typo."
        )


@contextlib.contextmanager
def naming_file(source: str | Path) -> Iterator[None]:
    """Prefix a `DCPLensError` raised inside with ``source`` (the file the values came from),
    keeping its class."""
    try:
        yield
    except DCPLensError as error:
        text = str(error)
        if text.startswith(str(source)):
            raise
        raise type(error)(f"{source}: {text}") from error


def describe_type(annotation: object) -> str:
    """``int | None`` -> "an int or None", in words for error messages."""
    if annotation is type(None) or annotation is None:
        return "None"
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in typing.get_args(annotation))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    words = {
        bool: "a boolean (true or false)",
        int: "an integer",
        float: "a finite number",
        str: "a string",
        Path: "a path",
        torch.dtype: "a torch.dtype",
    }
    if annotation in words:
        return words[annotation]
    if origin in (tuple, list, collections.abc.Sequence):
        args = typing.get_args(annotation)
        inner = describe_type(args[0]) if args else "values"
        inner = inner.removeprefix("a ").removeprefix("an ")
        fixed = origin is tuple and Ellipsis not in args
        return f"a list of {len(args)} {inner}s" if fixed else f"a list of {inner}s"
    if origin in (dict, collections.abc.Mapping) or annotation in (dict, Mapping):
        return "a JSON object"
    return f"a {getattr(annotation, '__name__', str(annotation))}"


@functools.cache
def _type_hints(cls: type) -> dict[str, object]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an unresolvable annotation in a base class: check the fields we can
        hints: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            if not isinstance(f.type, str):
                hints[f.name] = f.type
        return hints


def _matches(value: object, annotation: object) -> bool:
    """Whether ``value`` (read from JSON) is of type ``annotation``: a plain type, a union,
    a Literal, or a tuple, sequence or mapping of them."""
    if annotation is Any:
        return True
    if annotation is type(None) or annotation is None:
        return value is None
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if origin is typing.Literal:
        return isinstance(value, str | int) and not isinstance(value, bool) and value in args
    if isinstance(annotation, type) and annotation in SCALARS:
        return SCALARS[annotation](value)
    if origin is tuple:
        return _matches_tuple(value, args)
    if origin in (list, collections.abc.Sequence):
        if isinstance(value, str | bytes) or not isinstance(value, list | tuple):
            return False
        return not args or all(_matches(v, args[0]) for v in value)
    if origin in (dict, collections.abc.Mapping) or annotation in (dict, Mapping):
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            return False
        return len(args) != 2 or all(_matches(v, args[1]) for v in value.values())
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True


def _matches_tuple(value: object, args: tuple[object, ...]) -> bool:
    """Whether ``value`` is a ``tuple[args]``: fixed length, or ``tuple[T, ...]``."""
    if not isinstance(value, tuple | list):
        return False
    if len(args) == 2 and args[1] is Ellipsis:
        return all(_matches(v, args[0]) for v in value)
    return len(value) == len(args) and all(_matches(v, a) for v, a in zip(value, args, strict=True))


def _is_real(value: object) -> bool:
    """A finite real number, not a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    return math.isfinite(float(value))


# The scalar annotations of a config's fields, and what a JSON value of each must be.
SCALARS: dict[object, Callable[[object], bool]] = {
    bool: lambda value: isinstance(value, bool),
    int: lambda value: isinstance(value, numbers.Integral) and not isinstance(value, bool),
    float: _is_real,
    str: lambda value: isinstance(value, str),
    Path: lambda value: isinstance(value, str | Path),
}


# ----------------------------------------------------------------------------- files


def read_json_file(
    path: str | Path,
    *,
    error: type[DCPLensError] = ConfigError,
    recovery: str = "",
    finite: bool = False,
) -> Any:
    """The JSON value in ``path``; ``error`` (naming the file, with ``recovery`` appended) if it
    is missing, not a regular file (a FIFO, a device), not UTF-8 text or not valid JSON.
    ``finite``: numbers must be finite floats (``1e999``, ``NaN`` and ``Infinity`` refused) and
    integers within int64, as in a file dcp-lens wrote with ``allow_nan=False``."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise error(
            f"{path} is not a regular file (a folder, pipe, device or socket); expected a JSON "
            f"file.{_then(recovery)}"
        )
    if not path.is_file():
        raise MissingFileError(f"{path} does not exist or is not a file.{_then(recovery)}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as cause:
        raise error(
            f"{path} is not UTF-8 text (binary or corrupt at byte {cause.start}); expected a JSON "
            f"file.{_then(recovery)}"
        ) from cause
    try:
        if finite:
            return json.loads(
                text, parse_float=_finite_float, parse_int=_bounded_int, parse_constant=_refused
            )
        return json.loads(text)
    except _NotFinite as cause:
        raise error(
            f"{path} holds the number {cause}, which is not a finite float or a 64-bit integer; "
            f"the file is corrupt or was edited.{_then(recovery)}"
        ) from cause
    except (json.JSONDecodeError, RecursionError) as cause:
        detail = (
            f"{cause.msg} at line {cause.lineno} column {cause.colno}"
            if isinstance(cause, json.JSONDecodeError)
            else "nested too deeply"
        )
        raise error(
            f"{path} is not valid JSON ({detail}); the file is truncated or corrupt."
            f"{_then(recovery)}"
        ) from cause


def read_json_object(
    path: str | Path,
    *,
    error: type[DCPLensError] = ConfigError,
    recovery: str = "",
    finite: bool = False,
) -> dict[str, Any]:
    """`read_json_file`, which must hold a JSON object (a dict)."""
    data = read_json_file(path, error=error, recovery=recovery, finite=finite)
    if not isinstance(data, dict):
        raise error(
            f"{path} must hold a JSON object ({{...}}), got a JSON {_json_kind(data)}."
            f"{_then(recovery)}"
        )
    return data


def read_safetensors_file(path: str | Path, *, recovery: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file; `DamagedFileError` naming it if truncated or corrupt."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise MissingFileError(f"{path} does not exist.{_then(recovery)}")
    try:
        return load_file(str(path))
    except Exception as cause:  # safetensors raises its own SafetensorError, OSError, ...
        raise DamagedFileError(
            f"{path} is not a readable safetensors file ({_one_line(cause)}); it is truncated "
            f"or corrupt.{_then(recovery)}"
        ) from cause


def check_targets(targets: torch.Tensor, d_vocab: int | None, name: str = "targets") -> None:
    """Refuse ``targets`` holding an id other than -100 (not scored) that is negative or, when
    ``d_vocab`` is given, outside the vocabulary 0..d_vocab-1."""
    bad = (targets < 0) & (targets != -100)
    if d_vocab is not None:
        bad |= targets >= d_vocab
    if bool(bad.any()):
        value = int(targets[bad][0])
        where = f"0..{d_vocab - 1}" if d_vocab is not None else ">= 0"
        raise InputError(
            f"{name} hold {value}, outside the vocabulary ({where}); a target is a token id, or "
            "-100 where the position is not scored. Fix the targets."
        )


def check_inside(file: Path, folder: Path) -> None:
    """Refuse ``file`` if it (through a symbolic link) lies outside ``folder``."""
    resolved, root = file.resolve(), folder.resolve()
    if resolved != root and root not in resolved.parents:
        raise WeightsError(
            f"{file} links to {resolved}, outside {folder}; dcp-lens reads weights only from "
            "inside the checkpoint folder. Copy the file into the folder instead of linking it."
        )


# ----------------------------------------------------------------------------- weights


def weight_dtype(name: str, stored: str | torch.dtype, source: str) -> torch.dtype:
    """The torch dtype of a stored tensor, refused unless float16/bfloat16/float32/float64."""
    dtype = SAFETENSORS_DTYPES.get(stored) if isinstance(stored, str) else stored
    if dtype not in WEIGHT_DTYPES.values():
        raise WeightsError(
            f"{source}: tensor {name!r} has dtype {stored}; dcp-lens loads weights in "
            f"{sorted(WEIGHT_DTYPES)} only (complex, integer, boolean and float8 tensors are "
            "refused). Convert the checkpoint to one of those dtypes."
        )
    assert isinstance(dtype, torch.dtype)
    return dtype


def check_finite(name: str, tensor: torch.Tensor, source: str) -> None:
    """Refuse a tensor that must be finite (a stored table) if it holds NaN or infinity."""
    if not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise WeightsError(
            f"{source}: tensor {name!r} holds {bad} non-finite values (NaN or infinity); it must "
            "be finite. The file is corrupt."
        )


class _NotFinite(ValueError):
    """A number of a JSON file that is not finite or not within int64 (its text)."""


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotFinite(text[:40])
    return value


def _bounded_int(text: str) -> int:
    if len(text) > 20 or not -(2**63) <= int(text) < 2**63:
        raise _NotFinite(text[:40] + ("..." if len(text) > 40 else ""))
    return int(text)


def _refused(text: str) -> NoReturn:
    raise _NotFinite(text)


def _then(recovery: str) -> str:
    return f" {recovery}" if recovery else ""


def _json_kind(value: object) -> str:
    kinds = {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


__all__ = [
    "LIMITS",
    "SAFETENSORS_DTYPES",
    "WEIGHT_DTYPES",
    "check_field_types",
    "check_finite",
    "check_inside",
    "check_limit",
    "check_source_fields",
    "describe_type",
    "naming_file",
    "read_json_file",
    "read_json_object",
    "read_safetensors_file",
    "weight_dtype",
]
