"""mypy checks the conditions: a wrongly typed call through the package or the hooks face is
rejected (the interventions are not ``Any``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]

SNIPPET = """
from dcp_lens.protocol.conditions import truncate
from hooks import Truncate, replay

reveal_type(truncate(1))
truncate("x")
replay(1, 2)
good: Truncate = truncate(3)
"""


def test_mypy_rejects_wrongly_typed_condition_calls(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    snippet = tmp_path / "snippet.py"
    snippet.write_text(SNIPPET)
    # The package is followed; the large third-party libraries under it are not (their types
    # read as Any), which takes a cold mypy from about 75 s to a few seconds: the signatures
    # checked here are dcp_lens's own.
    config = tmp_path / "mypy.ini"
    config.write_text(
        "[mypy]\nfollow_imports = silent\n"
        "[mypy-torch.*,transformer_lens.*,transformers.*,numpy.*,pandas.*,scipy.*,sklearn.*]\n"
        "follow_imports = skip\n"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--no-error-summary",
            "--cache-dir",
            str(tmp_path / "c"),
            "--config-file",
            str(config),
            str(snippet),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"MYPYPATH": str(ROOT), "PATH": ""},
    )
    lines = result.stdout.splitlines()
    assert any(
        'Revealed type is "dcp_lens.protocol.conditions.Truncate"' in line for line in lines
    ), lines
    assert any(
        ':6: error: Argument 1 to "truncate" has incompatible type "str"' in line for line in lines
    ), lines
    assert any(":7: error: Too many arguments" in line for line in lines), lines
    assert not any(":8:" in line for line in lines), lines
