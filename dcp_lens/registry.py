"""`load(spec)`: one entry point for every model dcp-lens can diagnose; `add_entry`, how every
registry of dcp-lens adds an entry. Imports no model code until a model is loaded.

A spec is ``"KIND:ARGUMENT"`` for a registered kind (``planted:readout_shift``, ``huginn:PATH``, …),
a bundled name (``default``, ``default-dense``, …), or the path of a `save_pretrained` folder.
Keyword arguments override fields of the model's `RecurrentConfig`.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any, TypeVar

from dcp_lens.errors import ConfigError, ConfigTypeError

Loader = Callable[..., Any]
LOADERS: dict[str, Loader] = {}
NAMED: dict[str, Loader] = {}
Entry = TypeVar("Entry")


def add_entry(table: MutableMapping[str, Entry], name: str, entry: Entry, kind: str) -> Entry:
    """Add ``entry`` to a registry under ``name``; every registry of dcp-lens adds this way.

    Registering the same object again is a no-op (a module imported twice).

    Raises:
        ValueError: ``name`` is taken by another entry; the message names that entry.
    """
    existing = table.get(name)
    if existing is not None and existing is not entry:
        raise ValueError(
            f"a {kind} named {name!r} is already registered ({_describe(existing)}); pick "
            "another name, or remove the existing entry from the registry first."
        )
    table[name] = entry
    return entry


def register_loader(kind: str) -> Callable[[Loader], Loader]:
    """Register ``loader(argument, **overrides)`` for specs ``"kind:argument"``."""

    def decorator(loader: Loader) -> Loader:
        _import_builtin_kinds()  # a built-in kind's name is taken before it is first loaded
        return add_entry(LOADERS, kind, loader, "loader kind")

    return decorator


def register_named(name: str) -> Callable[[Loader], Loader]:
    """Register ``loader(**overrides)`` for the bare spec ``name``."""

    def decorator(loader: Loader) -> Loader:
        _import_builtin_kinds()
        return add_entry(NAMED, name, loader, "named model")

    return decorator


def _describe(entry: object) -> str:
    module = getattr(entry, "__module__", None)
    name = getattr(entry, "__qualname__", None) or repr(entry)
    return f"{module}.{name}" if module else name


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
        return _named(LOADERS[kind](argument, **overrides), spec)
    if spec in NAMED:
        return _named(NAMED[spec](**overrides), spec)
    if Path(spec).is_dir():
        from dcp_lens.hooked_recurrent_transformer import HookedRecurrentTransformer

        return _named(HookedRecurrentTransformer.from_pretrained(spec, **overrides), spec)
    raise ConfigError(
        f"unknown model spec {spec!r}: expected one of the kinds "
        f"{sorted(k + ':…' for k in LOADERS)}, a bundled name {sorted(NAMED)}, or a folder "
        "written by save_pretrained."
    )


def _named(model: Any, spec: str) -> Any:
    """``model`` with ``model.spec = spec``: results name it by default (`DepthControlProtocol`)."""
    model.spec = spec
    return model


def _import_builtin_kinds() -> None:
    """Modules that register kinds on import (kept lazy so `import dcp_lens` stays light)."""
    import importlib

    global _builtins_imported
    if _builtins_imported:
        return
    _builtins_imported = True  # set before importing: those modules register in turn
    for module in _BUILTIN_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            if error.name != module:
                raise


_builtins_imported = False
_BUILTIN_MODULES: list[str] = [
    "dcp_lens.planted",
    "dcp_lens.bundled",
    "dcp_lens.loading.huginn",
    "dcp_lens.loading.ouro",
    "dcp_lens.loading.llama2c",
    "dcp_lens.loading.bridge",
]
