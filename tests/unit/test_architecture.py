"""The layout's rule, checked: stages import only the stages below them (the layers contract in
pyproject.toml, run by `lint-imports`), the report never reaches the model or the sweep, and no
module imports itself back through others (function-level imports included)."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")


def _lint_imports(cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)} if pythonpath else dict(os.environ)
    return subprocess.run(
        [LINT_IMPORTS, "--config", str(cwd / "pyproject.toml"), "--no-cache"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_stage_contracts_hold() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("importer", "statement", "message"),
    [
        ("model/config.py", "from dcp_lens.zoo import registry", "dcp_lens.model is not allowed"),
        ("utils/errors.py", "from dcp_lens.tasks import get_task", "dcp_lens.utils is not allowed"),
        ("studies/run.py", "from dcp_lens.cli import main", "dcp_lens.studies is not allowed"),
        (
            "cli/help.py",
            "from dcp_lens.cli.parser import build_parser",
            "dcp_lens.cli.help is not allowed to import dcp_lens.cli.parser",
        ),
        (
            "report/figures.py",
            "    from dcp_lens.protocol.dcp import DepthControlProtocol",
            "dcp_lens.report.figures -> dcp_lens.protocol.dcp",
        ),
    ],
)
def test_an_upward_import_breaks_the_contract(tmp_path, importer, statement, message) -> None:
    """A copy of the package with one import that points up (a function-level one for the report)
    fails `lint-imports` and names the broken rule."""
    shutil.copytree(
        ROOT / "dcp_lens",
        tmp_path / "dcp_lens",
        ignore=shutil.ignore_patterns("__pycache__", "*.safetensors"),
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "dcp_lens" / importer
    if statement.startswith(" "):
        body = f"\n\ndef _upward() -> None:\n{statement}\n"
    else:
        body = f"\n{statement}  # an upward import\n"
    target.write_text(target.read_text() + body)
    result = _lint_imports(tmp_path, pythonpath=tmp_path)
    assert result.returncode != 0, result.stdout
    assert message in result.stdout, result.stdout


def _cycles(graph: grimp.ImportGraph, modules: set[str]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[set[str]] = []
    counter = 0
    for start in sorted(modules):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start) & modules)))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    imported = graph.find_modules_directly_imported_by(child) & modules
                    work.append((child, iter(sorted(imported))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


@pytest.mark.parametrize("type_only", [False, True], ids=["run-time", "with-type-only"])
def test_no_module_imports_itself_back(type_only: bool) -> None:
    """No import cycle among dcp_lens's modules, function-level imports included, and none either
    when the annotations' ``if TYPE_CHECKING:`` imports count (a circle of types is a circle of
    ideas). The package root (the composition root: a lazy facade whose names load on first
    access) is left out."""
    graph = grimp.build_graph(
        "dcp_lens", exclude_type_checking_imports=not type_only, cache_dir=None
    )
    modules = {m for m in graph.modules if m != "dcp_lens"}
    cycles = _cycles(graph, modules)
    assert not cycles, cycles


COMPOSITION_ROOT = ROOT / "dcp_lens" / "__init__.py"


def _imports_importlib(source: Path) -> bool:
    """Whether ``source`` imports `importlib` itself or its ``import_module`` (its ``metadata``,
    which reads installed packages' versions, imports no project module)."""
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import) and any(a.name == "importlib" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "importlib":
            if any(alias.name != "metadata" for alias in node.names):
                return True
    return False


def test_only_the_composition_root_imports_through_importlib() -> None:
    """An `importlib` import is an edge the contracts cannot see: only the package root, named
    the composition root in pyproject.toml's contracts, may make one."""
    sources = [*(ROOT / "dcp_lens").rglob("*.py"), *(ROOT / "hooks").rglob("*.py")]
    offenders = [
        str(source.relative_to(ROOT))
        for source in sources
        if source != COMPOSITION_ROOT and _imports_importlib(source)
    ]
    assert not offenders, offenders
    assert "composition root" in (ROOT / "pyproject.toml").read_text()


ARCHITECTURE = ROOT / "docs" / "architecture.md"
PACKAGE = ROOT / "dcp_lens"


def _named_paths() -> set[str]:
    """The package paths docs/architecture.md names: backticked ``x.py``, ``x/`` or ``x/y.py``."""
    quoted = re.findall(r"`([A-Za-z_][\w/]*(?:\.py|/))`", ARCHITECTURE.read_text())
    return {path for path in quoted if not path.startswith(("tests/", "docs/"))}


def _exists(path: str) -> bool:
    """A module ``x.py`` may also be the package ``x/`` it was split into; a folder ``x/`` may hold
    data (``zoo/bundled_models/``); ``hooks/`` and ``dcp_lens/`` are at the repository root."""
    target = ROOT / path if path.startswith(("hooks/", "dcp_lens/")) else PACKAGE / path
    if path.endswith("/"):
        return target.is_dir()
    return target.is_file() or (target.with_suffix("") / "__init__.py").is_file()


def test_the_architecture_page_names_only_paths_that_exist() -> None:
    named = _named_paths()
    assert len(named) > 40, sorted(named)
    missing = sorted(path for path in named if not _exists(path))
    assert not missing, f"docs/architecture.md names paths that do not exist: {missing}"


def test_the_architecture_page_names_every_subpackage() -> None:
    subpackages = {
        f"{init.parent.relative_to(PACKAGE).as_posix()}/"
        for init in PACKAGE.rglob("__init__.py")
        if init.parent != PACKAGE
    }
    unnamed = sorted(subpackages - _named_paths())
    assert not unnamed, f"docs/architecture.md does not name these subpackages: {unnamed}"
