"""Every name a module exports resolves: ``from dcp_lens.x import name`` works for each name in
``x.__all__``, the lazy facades' included (a facade's table can name a function that moved); and
every public name is defined in one module only."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import sys
import types
from pathlib import Path

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


ROOT = Path(dcp_lens.__file__).resolve().parent


def _defined_names(source: str) -> set[str]:
    """The public names a module's source defines at its top level: functions, classes and
    assigned constants (imports are not definitions)."""
    names: set[str] = set()
    for node in ast.parse(source).body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        for target in targets:
            for item in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(item, ast.Name):
                    names.add(item.id)
    return {name for name in names if not name.startswith("_")}


def names_defined_twice(sources: dict[str, str]) -> dict[str, list[str]]:
    """Each public name defined in more than one of ``sources`` (module -> source), with the
    modules that define it."""
    where: dict[str, list[str]] = {}
    for module, source in sorted(sources.items()):
        for name in _defined_names(source):
            where.setdefault(name, []).append(module)
    return {name: modules for name, modules in sorted(where.items()) if len(modules) > 1}


# `python -m` entry points: each package's runnable module names its entry point `main`.
ENTRY_POINT = "main"


def test_every_public_name_is_defined_in_one_module() -> None:
    """One name, one meaning: a constant, function or class is defined once, and two things
    that differ have two names."""
    sources = {
        str(path.relative_to(ROOT.parent)): path.read_text()
        for path in sorted(ROOT.rglob("*.py"))
        if path.name != "__main__.py"
    }
    twice = {n: m for n, m in names_defined_twice(sources).items() if n != ENTRY_POINT}
    assert not twice, f"names defined in two modules: {twice}"


def test_a_name_defined_in_two_modules_is_caught() -> None:
    sources = {
        "a.py": "LIMIT = 1\ndef helper(): ...\n_private = 1\n",
        "b.py": "from a import helper\nLIMIT, OTHER = 2, 3\nclass Helper: ...\n_private = 2\n",
    }
    assert names_defined_twice(sources) == {"LIMIT": ["a.py", "b.py"]}
