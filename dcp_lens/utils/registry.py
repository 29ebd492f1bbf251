"""`add_entry`: how every registry of dcp-lens (models, tasks, conditions, calibration maps,
metrics) adds an entry, refusing a second entry under a taken name."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import TypeVar

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


def _describe(entry: object) -> str:
    module = getattr(entry, "__module__", None)
    name = getattr(entry, "__qualname__", None) or repr(entry)
    return f"{module}.{name}" if module else name
