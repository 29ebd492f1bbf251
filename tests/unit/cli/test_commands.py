"""What the commands print for the next step: the run command that diagnoses a trained model
parses back to its folders, a path with a space included."""

from __future__ import annotations

import shlex
from pathlib import Path

from dcp_lens.cli.commands import diagnose_command
from dcp_lens.cli.parser import build_parser


def test_the_diagnose_command_parses_back_to_the_run_folders(tmp_path: Path) -> None:
    run_folder = tmp_path / "runs tiny"
    argv = shlex.split(diagnose_command(run_folder))
    assert argv[:2] == ["dcp-lens", "run"]
    args = build_parser().parse_args(argv[1:])
    assert (args.model, args.out) == (str(run_folder / "model"), run_folder / "dcp")
