"""No committed file carries a path of the machine it was made on: a developer's checkout, home
or temporary folder in a notebook's output, a log or a page would show it to every reader (the
demo notebooks once carried `/work/<checkout>/.venv/...` in a tqdm warning)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# A path under a machine's own folders, not part of a URL or a longer path (`x.org/home/...`).
LOCAL_PATH = re.compile(rb"(?<![\w./])/(?:work|root|home|tmp|Users)/[^\s'\"`)\]<>,;]*")
# Legitimate occurrences, each a file and how the path starts, with the reason it is there.
ALLOWED = {
    ("docs/intervention.md", b"/tmp/figure.html"): "an example output file in a command the "
    "reader types",
    ("docs/intervention_figure.py", b"/tmp/figure.html"): "the same example, in its usage",
    ("demos/gpu_check.sh", b"/tmp/site"): "the scratch folder the script installs wheels into "
    "on the GPU machine it runs on",
}
# This file names the patterns and the allowed paths.
SKIPPED = {"tests/acceptance/test_no_local_paths.py"}


def committed_files() -> list[str]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: no list of committed files")
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout
    return [name for name in listed.decode().split("\0") if name and name not in SKIPPED]


def local_paths(name: str, data: bytes) -> list[bytes]:
    """The local paths in one file's bytes that the allow-list does not name."""
    return [
        match.group()
        for match in LOCAL_PATH.finditer(data)
        if not any(file == name and match.group().startswith(start) for file, start in ALLOWED)
    ]


def test_no_committed_file_holds_a_local_path() -> None:
    found: dict[str, list[bytes]] = {}
    allowed_seen = set()
    for name in committed_files():
        path = REPO / name
        if not path.is_file():  # deleted in the working tree, not yet committed
            continue
        data = path.read_bytes()
        if paths := local_paths(name, data):
            found[name] = paths[:3]
        allowed_seen |= {(file, start) for file, start in ALLOWED if file == name and start in data}
    assert not found, f"local paths in committed files (strip them or allow-list them): {found}"
    assert allowed_seen == set(ALLOWED), f"stale allow-list entries: {set(ALLOWED) - allowed_seen}"


def test_the_pattern_finds_the_paths_it_is_for() -> None:
    warning = b"/work/wt-x/.venv/lib/python3.11/site-packages/tqdm/auto.py:21: TqdmWarning"
    assert local_paths("demos/x.ipynb", warning) == [warning.split(b" ")[0]]
    for path in (b"/root/.cache/x", b"/home/me/run", b"/tmp/pytest-1/out", b"/Users/me/a"):
        assert local_paths("a.md", b"see " + path + b".") == [path + b"."], path
    for text in (b"https://x.org/home/page", b"docs/work/a", b"a//tmp/", b"/tmpfile"):
        assert local_paths("a.md", text) == [], text
    assert local_paths("docs/intervention.md", b"open /tmp/figure.html") == []  # allowed there only
    assert local_paths("other.md", b"open /tmp/figure.html") == [b"/tmp/figure.html"]
