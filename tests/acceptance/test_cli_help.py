"""What the command line tells a user to type: help names the registered metrics and tasks, and
the command `dcp-lens train` suggests at its end runs as printed."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from dcp_lens.cli import build_parser, main
from dcp_lens.protocol.metrics import METRICS
from dcp_lens.tasks import TASKS


def help_text(capsys: pytest.CaptureFixture[str], *command: str) -> str:
    with pytest.raises(SystemExit) as exit:
        main([*command, "--help"])
    assert exit.value.code == 0
    return capsys.readouterr().out


def test_help_lists_the_registered_metric_and_task_names(capsys) -> None:
    for command in ((), ("run",)):
        text = help_text(capsys, *command)
        metrics = next(line for line in text.splitlines() if line.startswith("metrics (--metrics)"))
        tasks = next(line for line in text.splitlines() if line.startswith("tasks (--task)"))
        assert all(name in metrics for name in METRICS), metrics
        assert all(name in tasks for name in TASKS), tasks
    assert all(name in help_text(capsys, "validate") for name in METRICS)


def test_train_suggests_a_run_command_that_runs(tmp_path: Path, capsys) -> None:
    """The suggested command parses as printed, and runs (here with small sizes appended)."""
    run_folder = tmp_path / "runs tiny"  # a space: the suggestion must quote it
    assert main(["train", "--preset", "tiny", "--steps", "2", "--out", str(run_folder)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    suggested = shlex.split(last.split("diagnose it with: ", 1)[1])
    assert suggested[:2] == ["dcp-lens", "run"]
    args = build_parser().parse_args(suggested[1:])
    assert (args.model, args.out) == (str(run_folder / "model"), run_folder / "dcp")
    small = ["--n-eval", "32", "--n-calibration", "32", "--bootstrap", "10", "--probe", "none"]
    assert main([*suggested[1:], *small, "--quiet"]) == 0
    runs = json.loads((run_folder / "dcp" / "results.json").read_text())["runs"]
    assert [run["model"] for run in runs] == [str(run_folder / "model")]
