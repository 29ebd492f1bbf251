"""`load(spec)`: one entry point for every model dcp-lens can diagnose.

A spec is ``"KIND:ARGUMENT"`` for a registered kind (``planted:readout_shift``, ``huginn:PATH``, …),
a bundled name (``default``, ``default-dense``, …), or the path of a `save_pretrained` folder.
Keyword arguments override fields of the model's `RecurrentConfig`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dcp_lens.errors import ConfigError, ConfigTypeError
from dcp_lens.hooked_recurrent_transformer import HookedRecurrentTransformer

Loader = Callable[..., Any]
LOADERS: dict[str, Loader] = {}
NAMED: dict[str, Loader] = {}


def register_loader(kind: str) -> Callable[[Loader], Loader]:
    """Register ``loader(argument, **overrides)`` for specs ``"kind:argument"``."""

    def decorator(loader: Loader) -> Loader:
        LOADERS[kind] = loader
        return loader

    return decorator


def register_named(name: str) -> Callable[[Loader], Loader]:
    """Register ``loader(**overrides)`` for the bare spec ``name``."""

    def decorator(loader: Loader) -> Loader:
        NAMED[name] = loader
        return loader

    return decorator


def load(spec: str, **overrides: Any) -> Any:
    """Load the model a spec names; ``overrides`` replace `RecurrentConfig` fields.

    >>> model = load("planted:readout_shift")            # doctest: +SKIP
    >>> model = load("huginn:/models/huginn-0125", state_init="zeros")  # doctest: +SKIP
    """
    if not isinstance(spec, str):
        raise ConfigTypeError(f"a model spec must be a non-empty string, got {spec!r}.")
    if not spec.strip():
        raise ConfigError(f"a model spec must be a non-empty string, got {spec!r}.")
    _import_builtin_kinds()
    kind, _, argument = spec.partition(":")
    if argument and kind in LOADERS:
        return LOADERS[kind](argument, **overrides)
    if spec in NAMED:
        return NAMED[spec](**overrides)
    if Path(spec).is_dir():
        return HookedRecurrentTransformer.from_pretrained(spec, **overrides)
    raise ConfigError(
        f"unknown model spec {spec!r}: expected one of the kinds "
        f"{sorted(k + ':…' for k in LOADERS)}, a bundled name {sorted(NAMED)}, or a folder "
        "written by save_pretrained."
    )


def _import_builtin_kinds() -> None:
    """Modules that register kinds on import (kept lazy so `import dcp_lens` stays light)."""
    import importlib

    for module in _BUILTIN_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name != module:
                raise


_BUILTIN_MODULES: list[str] = [
    "dcp_lens.planted",
    "dcp_lens.bundled",
    "dcp_lens.loading.huginn",
    "dcp_lens.loading.ouro",
    "dcp_lens.loading.llama2c",
    "dcp_lens.loading.bridge",
]
