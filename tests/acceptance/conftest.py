"""Fixtures the acceptance tests share."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import run_argv

from dcp_lens.cli import main


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished planted run (copied by tests that change it)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main(run_argv(out)) == 0
    return out
