"""Every name a module exports resolves: ``from dcp_lens.x import name`` works for each name in
``x.__all__``, the lazy facades' included (a facade's table can name a function that moved)."""

from __future__ import annotations

import importlib
import pkgutil
import sys
import types

import pytest

import dcp_lens


def _modules() -> list[str]:
    names = ["dcp_lens", "dcp_lens.hooks"]
    for info in pkgutil.walk_packages(dcp_lens.__path__, prefix="dcp_lens."):
        if info.name.endswith("__main__"):
            continue
        names.append(info.name)
    return sorted(names)


def _unresolved(module: types.ModuleType) -> list[str]:
    missing = []
    for name in getattr(module, "__all__", ()):
        try:
            getattr(module, name)
        except AttributeError:
            missing.append(name)
    return missing


@pytest.mark.parametrize("name", _modules())
def test_every_exported_name_resolves(name: str) -> None:
    module = importlib.import_module(name)
    assert not _unresolved(module), f"{name}.__all__ names what it does not have"


def test_a_facade_naming_a_moved_function_is_caught(monkeypatch) -> None:
    """The check above fails on a lazy facade whose table names a function that is not there."""
    facade = types.ModuleType("dcp_lens._facade_probe")
    facade.__all__ = ["moved_away"]  # type: ignore[attr-defined]

    def __getattr__(name: str) -> object:
        raise AttributeError(name)

    facade.__getattr__ = __getattr__  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, facade.__name__, facade)
    assert _unresolved(facade) == ["moved_away"]
