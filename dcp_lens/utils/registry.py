"""`add_entry`: how every registry of dcp-lens (models, tasks, conditions, calibration maps,
metrics) adds an entry, refusing a second entry under a taken name."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from types import ModuleType
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


# The renderer of results (the ``dcp_lens.report`` package and the names it exports). The report
# stage sits above the protocol whose results it draws, so `ProtocolResults.report`, ``.figures``,
# ``.summary`` and ``._repr_html_`` cannot import it; the package root (``dcp_lens/__init__.py``,
# the one place that wires stages together) hands in a loader here instead. Nothing below the
# report names the report.
_renderer_loader: Callable[[], ModuleType] | None = None


def set_renderer(loader: Callable[[], ModuleType]) -> None:
    """Install the loader of the report stage's renderer (called by ``dcp_lens/__init__.py``)."""
    global _renderer_loader
    _renderer_loader = loader


def renderer() -> ModuleType:
    """The report stage's renderer module, as the package root installed it.

    Raises:
        RuntimeError: no renderer installed (``dcp_lens`` was not imported as a package).
    """
    if _renderer_loader is None:
        raise RuntimeError(
            "no report renderer is installed: import dcp_lens (its __init__ installs "
            "dcp_lens.report) or call dcp_lens.report.html.write_report directly."
        )
    return _renderer_loader()
