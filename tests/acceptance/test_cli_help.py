"""What the command line tells a user to type: help names the registered metrics and tasks, and
the command `dcp-lens train` suggests at its end runs as printed."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest

from dcp_lens.cli import build_parser, main, protocol_config
from dcp_lens.protocol.config import COMMAND_DEFAULTS, ProtocolConfig
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


def test_every_command_declares_every_protocol_setting_with_one_spelling(capsys) -> None:
    """run, validate, bench and experiment take every `ProtocolConfig` setting (experiment seeds
    each model by --seeds) under the field's one flag, and build the config from it."""
    flags = {f.metadata["flag"] for f in dataclasses.fields(ProtocolConfig)}
    for command in ("run", "validate", "bench", "experiment"):
        text = help_text(capsys, command)
        missing = {flag for flag in flags if f"{flag} " not in text and f"{flag}," not in text}
        assert missing == ({"--seed"} if command == "experiment" else set()), (command, missing)
        assert "--batch " not in text and "--bootstrap BOOTSTRAP" in text  # one spelling each
    parser = build_parser()
    args = parser.parse_args(
        ["validate", "--calibration-mode", "diag", "--k", "1,3", "--no-match-confidence"]
    )
    config = protocol_config(args, "validate")
    assert (config.calibration_mode, config.k_grid, config.match_confidence) == (
        "diag",
        (1, 3),
        False,
    )
    assert config.n_bootstrap == COMMAND_DEFAULTS["validate"]["n_bootstrap"]
    assert protocol_config(parser.parse_args(["run", "--out", "x"]), "run").batch_size == 64
    assert parser.parse_args(["train", "--no-resume", "--out", "x"]).resume is False
    assert parser.parse_args(["run", "--resume", "--out", "x"]).resume is True


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
