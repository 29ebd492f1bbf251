"""The checks that keep the code's shape, each shown to fail when its rule is broken: no module
over 800 lines, ``# fmt: skip`` only on literal tables of data (so that the formatter, not
packing, decides the length), ruff's complexity limit and vulture's dead-code check with the
project's settings."""

from __future__ import annotations

import ast
import io
import shutil
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 800
FMT_SKIP = "# fmt: skip"
# Modules whose packed lines have not been unpacked yet; each leaves this set when it is.
PACKED_MODULES: set[str] = set()


def _tool(name: str) -> str:
    return shutil.which(name) or str(Path(sys.executable).parent / name)


def _sources(*folders: str) -> list[Path]:
    return sorted(path for folder in folders for path in (ROOT / folder).rglob("*.py"))


# ----------------------------------------------------------------------------- file length


def too_long(paths: list[Path]) -> dict[str, int]:
    """The files of ``paths`` over `MAX_LINES` lines, with their line counts."""
    counts = {str(path): len(path.read_text().splitlines()) for path in paths}
    return {path: n for path, n in counts.items() if n > MAX_LINES}


def test_no_module_is_over_the_line_cap() -> None:
    sources = _sources("dcp_lens", "hooks")
    assert len(sources) > 100
    assert not too_long(sources), f"split these by subject: {too_long(sources)}"


def test_the_line_cap_catches_an_801_line_file(tmp_path: Path) -> None:
    at_cap, over = tmp_path / "at_cap.py", tmp_path / "over.py"
    at_cap.write_text("x = 1\n" * MAX_LINES)
    over.write_text("x = 1\n" * (MAX_LINES + 1))
    assert too_long([at_cap, over]) == {str(over): MAX_LINES + 1}


# ----------------------------------------------------------------------------- fmt: skip


def packed_lines(source: str) -> list[int]:
    """The lines of ``source`` whose ``# fmt: skip`` does not end a literal table of data: an
    assignment whose value is a literal (numbers, strings, and tuples, lists, sets and dicts of
    them)."""
    comments = [
        token.start[0]
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT and token.string.strip() == FMT_SKIP
    ]
    ending = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.stmt) and node.end_lineno is not None:
            if node.end_lineno not in ending or node.lineno > ending[node.end_lineno].lineno:
                ending[node.end_lineno] = node
    return [line for line in comments if not _is_data(ending.get(line))]


def _is_data(statement: ast.stmt | None) -> bool:
    if not isinstance(statement, ast.Assign | ast.AnnAssign) or statement.value is None:
        return False
    try:
        ast.literal_eval(statement.value)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        return False
    return True


def test_fmt_skip_marks_only_tables_of_data() -> None:
    packed = {}
    for path in _sources("dcp_lens", "hooks", "tests", "demos"):
        name = path.relative_to(ROOT).as_posix()
        if name not in PACKED_MODULES and (lines := packed_lines(path.read_text())):
            packed[name] = lines
    assert not packed, f"remove fmt: skip and let ruff format write these lines: {packed}"


def test_fmt_skip_on_code_is_caught() -> None:
    source = textwrap.dedent(
        """\
        SIZES = {"small": 1, "large": 2,
                 "huge": 3}  # fmt: skip
        total = sum([1, 2,
                     3])  # fmt: skip
        def f(a, b,
              c): return a  # fmt: skip
        text = "# fmt: skip"
        """
    )
    assert packed_lines(source) == [4, 6]


# ----------------------------------------------------------------------------- complexity


def _ruff_complexity(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_tool("ruff"), "check", "--config", str(ROOT / "pyproject.toml"), "--select", "C901"]
        + ["--no-cache", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _branches(n: int) -> str:
    """A function of complexity ``n`` (one path, then ``n - 1`` ifs)."""
    body = "".join(f"    if x == {i}:\n        return {i}\n" for i in range(n - 1))
    return f"def branchy(x):\n{body}    return -1\n"


def test_the_complexity_limit_is_15(tmp_path: Path) -> None:
    at_limit, over = tmp_path / "at_limit.py", tmp_path / "over.py"
    at_limit.write_text(_branches(15))
    over.write_text(_branches(16))
    assert _ruff_complexity(at_limit).returncode == 0, _ruff_complexity(at_limit).stdout
    result = _ruff_complexity(over)
    assert result.returncode == 1
    assert "`branchy` is too complex (16 > 15)" in result.stdout, result.stdout


# ----------------------------------------------------------------------------- dead code


def test_vulture_with_the_project_settings_finds_dead_code(tmp_path: Path) -> None:
    """vulture run with pyproject.toml's settings reports a function nothing calls and an
    unused import, and not a function that is called."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "module.py").write_text(
        textwrap.dedent(
            """\
            import json


            def never_called(x):
                return x


            def called(x):
                return x + 1


            print(called(1))
            """
        )
    )
    result = subprocess.run(
        [_tool("vulture"), "module.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 3, result.stdout + result.stderr
    assert "unused function 'never_called'" in result.stdout
    assert "unused import 'json'" in result.stdout
    assert "'called'" not in result.stdout


@pytest.mark.parametrize("check", ["ruff", "vulture"])
def test_the_checks_are_in_the_test_command(check: str) -> None:
    readme = (ROOT / "README.md").read_text()
    (command,) = [line for line in readme.splitlines() if "pytest -q" in line and "&&" in line]
    assert f"&& {check} " in command
