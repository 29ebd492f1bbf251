"""Files a run wrote and reads back, tampered with (truncated, emptied, of the wrong type, a
string where a number belongs): each is refused with one clear error that names the file and
how to recover.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from helpers import (
    one_line_error,
    run_argv,
)
from safetensors.torch import load_file, save_file

from dcp_lens.cli import main
from dcp_lens.protocol.results import ProtocolResults
from dcp_lens.utils.errors import (
    DamagedFileError,
)


def test_resume_over_a_truncated_checkpoint_names_it_and_how_to_recover(tmp_path):
    from dcp_lens.training import preset, train

    config = preset("tiny", steps=4, checkpoint_interval=2, eval_interval=2)
    train(config, tmp_path, stop_at_step=2, progress=False)
    tensors = tmp_path / "checkpoint" / "state.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:100])
    with pytest.raises(
        DamagedFileError, match=r"state\.safetensors is not a readable .*--no-resume"
    ):
        train(config, tmp_path, progress=False)
    (tmp_path / "checkpoint" / "trainer_state.json").write_text('{"step": ')
    with pytest.raises(DamagedFileError, match=r"trainer_state\.json is not valid JSON"):
        train(config, tmp_path, progress=False)


def test_results_json_truncated_names_the_file_and_how_to_recover(tmp_path):
    (tmp_path / "results.json").write_text('{"runs": [{"model": "default", ')
    with pytest.raises(DamagedFileError, match=r"results\.json is not valid JSON .*Delete it"):
        ProtocolResults.load(tmp_path)


@pytest.fixture
def interrupted_run(tmp_path, monkeypatch) -> Path:
    """A run stopped after its first calibration snapshot (snapshots on disk)."""
    import dcp_lens.utils.snapshots as snapshots

    def stop(point: str) -> None:
        if point == "calibration:1":
            raise KeyboardInterrupt

    out = tmp_path / "out"
    with monkeypatch.context() as patch:
        patch.setattr(snapshots, "die_if_asked", stop)
        assert main(run_argv(out, "--checkpoint-every", "1", "--batch-size", "8")) == 130
    assert list((out / ".checkpoints").rglob("calibration*.pt"))
    return out


@pytest.mark.parametrize("damage", ["empty", "random", "foreign", "pickled", "state"])
def test_damaged_snapshots_name_the_file_and_say_start_again(capsys, interrupted_run, damage):
    snapshot = next((interrupted_run / ".checkpoints").rglob("calibration*.pt"))
    if damage == "empty":
        snapshot.write_bytes(b"")
    elif damage == "random":
        snapshot.write_bytes(bytes(range(256)) * 7)
    elif damage == "foreign":
        torch.save(torch.zeros(3, 3), snapshot)
    elif damage == "pickled":
        torch.save({"done": 1, "state": math.sqrt}, snapshot)  # not loadable with weights_only
    else:
        torch.save({"done": 1, "state": {"unexpected": torch.zeros(2)}}, snapshot)
    capsys.readouterr()
    argv = run_argv(interrupted_run, "--checkpoint-every", "1", "--batch-size", "8", "--resume")
    err = one_line_error(capsys, argv)
    assert "without --resume" in err and str(snapshot.parent) in err, err


def test_a_command_json_that_is_a_list_is_refused_on_resume(capsys, interrupted_run):
    (interrupted_run / ".checkpoints" / "command.json").write_text("[1, 2]")
    capsys.readouterr()
    argv = run_argv(interrupted_run, "--checkpoint-every", "1", "--batch-size", "8", "--resume")
    err = one_line_error(capsys, argv)
    assert "command.json must hold a JSON object" in err and "without --resume" in err


@pytest.fixture(scope="module")
def training_checkpoint(tmp_path_factory) -> Path:
    from dcp_lens.training import preset, train

    out = tmp_path_factory.mktemp("train") / "run"
    train(preset("tiny", steps=4), out, stop_at_step=2, progress=False)
    return out


@pytest.mark.parametrize(
    "field", ["parameter_names", "param_groups", "step", "history", "format", "rng"]
)
def test_a_training_state_missing_a_field_is_refused(tmp_path, training_checkpoint, field):

    from dcp_lens.training import preset, train

    out = shutil.copytree(training_checkpoint, tmp_path / "run")
    if field == "rng":
        tensors = load_file(out / "checkpoint" / "state.safetensors")
        del tensors["rng.sampler"]
        save_file(tensors, out / "checkpoint" / "state.safetensors")
    else:
        state = json.loads((out / "checkpoint" / "trainer_state.json").read_text())
        del state[field]
        (out / "checkpoint" / "trainer_state.json").write_text(json.dumps(state))
    expected = "rng.sampler" if field == "rng" else field
    with pytest.raises(DamagedFileError, match=rf"{expected}.*--no-resume"):
        train(preset("tiny", steps=4), out, progress=False)


def test_report_on_a_report_data_that_is_a_list_is_one_line(capsys, tmp_path, finished_run):
    run = shutil.copytree(finished_run, tmp_path / "run")
    (run / "report_data.json").write_text("[]")
    err = one_line_error(capsys, ["report", str(run)])
    assert "report_data.json must hold a JSON object" in err


def test_numbers_in_results_json_are_checked_on_load(tmp_path, finished_run):
    from dcp_lens.protocol.results import read_results_json

    folder = shutil.copytree(finished_run / "planted_readout_shift", tmp_path / "r")
    text = (folder / "results.json").read_text()
    for bad in ("1e999", "NaN", "-Infinity", "1" + "0" * 30):
        first_number = text.index('"n_iterations": ') + len('"n_iterations": ')
        end = text.index(",", first_number)
        (folder / "results.json").write_text(text[:first_number] + bad + text[end:])
        with pytest.raises(DamagedFileError, match="not a finite float"):
            read_results_json(folder / "results.json")


BAD_NUMBERS = [
    ("n_iterations", '"8"'),
    ("n_iterations", "8.5"),
    ("n_iterations", "true"),
    ("k", '"1"'),
]


@pytest.mark.parametrize("field, bad", BAD_NUMBERS)
def test_a_string_where_results_json_holds_a_number_is_refused(tmp_path, finished_run, field, bad):
    from dcp_lens.protocol.results import read_results_json

    folder = shutil.copytree(finished_run / "planted_readout_shift", tmp_path / "r")
    text = (folder / "results.json").read_text()
    start = text.index(f'"{field}": ') + len(f'"{field}": ')
    end = min(i for i in (text.find(",", start), text.find("\n", start)) if i > 0)
    (folder / "results.json").write_text(text[:start] + bad + text[end:])
    with pytest.raises(DamagedFileError, match=rf"results\.json: {field} holds .*expected an"):
        read_results_json(folder / "results.json")
