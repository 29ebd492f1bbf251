"""What pip installs is the package tree: the wheel built from the checkout holds every file of
``dcp_lens/`` (modules, bundled models, shipped data, ``py.typed``) and ``hooks/`` as
``dcp_lens/hooks/``, and nothing else. `.ci/run` installs that wheel into a fresh virtual
environment and runs the README's example from outside the checkout; this test is the fast half
that runs with the suite."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What the build reads: the packages and the metadata files.
SOURCES = ("dcp_lens", "hooks", "setup.py", "pyproject.toml", "README.md")


def _tree() -> list[str]:
    """The files of the package tree as the wheel must hold them: ``git ls-files`` where the
    checkout is a git repository (so that a stray untracked file does not count), else every
    file but caches."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        listed = subprocess.run(
            ["git", "ls-files", "dcp_lens", "hooks"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    else:
        listed = [
            str(p.relative_to(ROOT))
            for folder in ("dcp_lens", "hooks")
            for p in (ROOT / folder).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        ]
    return sorted(
        "dcp_lens/hooks/" + name.removeprefix("hooks/") if name.startswith("hooks/") else name
        for name in listed
        if (ROOT / name).is_file()
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built, as ``pip wheel --no-deps .`` builds it, from a copy of the sources (a
    build folder left in the checkout cannot leak stale files into it)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"
    source.mkdir()
    for name in _tree():
        original = ROOT / (
            "hooks/" + name.removeprefix("dcp_lens/hooks/")
            if name.startswith("dcp_lens/hooks/")
            else name
        )
        target = source / original.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(original, target)
    for name in SOURCES[2:]:
        shutil.copy2(ROOT / name, source / name)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--quiet",
            "--wheel-dir",
            str(work / "dist"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (built,) = (work / "dist").glob("dcp_lens-*.whl")
    return built


def test_the_wheel_holds_the_package_tree_and_nothing_else(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    package = sorted(n for n in names if ".dist-info/" not in n)
    tree = _tree()
    assert sorted(set(tree) - set(package)) == [], "in the tree, not in the wheel"
    assert sorted(set(package) - set(tree)) == [], "in the wheel, not in the tree"
    # What the README's examples read, and what `dcp-lens --help` needs.
    assert {
        "dcp_lens/data/fixtures/huginn_tiny/model.safetensors",
        "dcp_lens/data/tinyshakespeare.txt",
        "dcp_lens/utils/errors.py",
        "dcp_lens/hooks/__init__.py",
        "dcp_lens/py.typed",
    } <= set(package)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "dcp-lens = dcp_lens.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_check_catches_a_file_the_wheel_leaves_out(wheel: Path) -> None:
    """The tree's list is independent of the wheel's: a file that the packaging does not pick up
    (a data file outside the package-data patterns) shows as missing."""
    package = {n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in n}
    tree = set(_tree()) | {"dcp_lens/data/fixtures/huginn_tiny/notes.md"}
    assert tree - package == {"dcp_lens/data/fixtures/huginn_tiny/notes.md"}


def test_the_shipped_data_is_found_by_name() -> None:
    from dcp_lens import data
    from dcp_lens.utils.errors import ConfigError

    for name in data.SHIPPED:
        assert data.path(name).exists(), name
    assert data.path("huginn_tiny").joinpath("config.json").is_file()
    with pytest.raises(ConfigError, match="expected one of huginn_tiny, ouro_tiny"):
        data.path("huginn")
