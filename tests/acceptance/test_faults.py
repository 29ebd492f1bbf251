"""A SIGKILL before and after every write of each command that writes a folder.

A command's writes are its journal's appends and its renames (every file it writes whole lands
by one). The command runs in a child process that kills itself at the Nth of them, just before
or just after it; then the folder must be resumed or replaced by the command run again, the
user's files in it must be byte for byte as they were, and nothing may be left beside it.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dcp_lens.cli import main
from dcp_lens.utils.folders import OutputFolder

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--n-eval", "16", "--n-calibration", "16", "--bootstrap", "5", "--probe", "none"]

# The child: counts the writes (journal appends and renames) and SIGKILLs itself at one.
CHILD = """
import atexit, os, signal, sys
from dcp_lens.utils import ownership
target, when, count_file = int(sys.argv[1]), sys.argv[2], sys.argv[3]
seen = [0]
def event(write, *args, **kwargs):
    seen[0] += 1
    if seen[0] == target and when == "before":
        os.kill(os.getpid(), signal.SIGKILL)
    result = write(*args, **kwargs)
    if seen[0] == target and when == "after":
        os.kill(os.getpid(), signal.SIGKILL)
    return result
replace, append = os.replace, ownership.Journal.append
os.replace = lambda *a, **k: event(replace, *a, **k)
ownership.Journal.append = lambda self, e: event(append, self, e)
atexit.register(lambda: open(count_file, "w").write(str(seen[0])))
from dcp_lens.cli import main
raise SystemExit(main(sys.argv[4:]))
"""


FIRST_WRITES = [(1, "after"), (2, "before"), (2, "after"), (3, "before"), (3, "after")]


def command(name: str, out: Path, source: Path | None) -> list[str]:
    return {
        "run": ["run", "--model", "planted:readout_shift", *SMALL, "--quiet", "--out", str(out)],
        "report": ["report", str(source), "--out", str(out)],
        "report file": ["report", str(source), "--out", str(out) + ".html"],
        "validate": [
            "validate",
            "--models",
            "readout_shift",
            "--n-eval",
            "16",
            "--n-calibration",
            "16",
            "--bootstrap",
            "5",
            "--quiet",
            "--out",
            str(out),
        ],
        "train": ["train", "--preset", "tiny", "--steps", "3", "--out", str(out)],
        "experiment": [
            "experiment",
            "training-intervention",
            "--preset",
            "tiny",
            "--seeds",
            "0",
            "--regimes",
            "fixed",
            "--out",
            str(out),
        ],
    }[name]


def child(argv: list[str], target: int, when: str, cwd: Path) -> int:
    """Run ``argv`` in a child killed at write ``target`` (``when``: before or after it; 0:
    never); returns how many writes it made."""
    count = cwd / "count"
    count.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    process = subprocess.run(
        [sys.executable, "-c", CHILD, str(target), when, str(count), *argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        timeout=600,
    )
    if target == 0:
        assert process.returncode == 0, process.stderr.decode()
        return int(count.read_text())
    return -1


def user_files(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in folder.rglob("user*")
        if p.is_file()
    }


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("source") / "run"
    assert main(command("run", out, None)) == 0
    return out


def check_kill(name: str, target: int, when: str, box: Path, source: Path) -> None:
    """Kill ``name`` at write ``target`` ``when``; a user file beside the folder and one added
    to it after the kill; then the command again (a run: resumed after a kill before, replaced
    after)."""
    box.mkdir()
    out = box / "out"
    argv = command(name, out, source)
    folder = box if name == "report file" else out  # where the command writes
    (box / "user_beside.txt").write_text("mine, beside --out")
    before_source = {p: p.read_bytes() for p in source.rglob("*") if p.is_file()}
    child(argv, target, when, box)
    if folder.is_dir():
        (folder / "user_after.txt").write_text("mine, added to the interrupted folder")
    expected = {**user_files(box), **user_files(folder)}
    if name == "run":
        argv = [*argv, "--resume" if when == "before" else "--overwrite"]
    assert main(argv) == 0, (name, target, when)
    assert {**user_files(box), **user_files(folder)} == expected, (name, target, when)
    assert {p: p.read_bytes() for p in source.rglob("*") if p.is_file()} == before_source
    beside = sorted(
        p.name for p in box.iterdir() if p.name not in ("count", "out") and "user" not in p.name
    )
    allowed = {"report file": ["out.html", "out_files"]}.get(name, [])
    assert beside == allowed, (name, target, when, beside)


@pytest.mark.parametrize(
    "target, when",
    [(1, "before"), *(pytest.param(t, w, marks=pytest.mark.slow) for t, w in FIRST_WRITES)],
)
def test_a_run_killed_at_its_first_writes_resumes_and_keeps_user_files(
    tmp_path, capsys, source, target, when
):
    """The journal's first line, the lock's record, the manifest's first write: a folder
    killed there is resumed (or replaced) like any other."""
    check_kill("run", target, when, tmp_path / "box", source)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["run", "report", "report file", "validate", "train", "experiment"]
)
def test_every_write_of_every_command_can_be_killed(tmp_path, capsys, source, name):
    counting = tmp_path / "counting"
    counting.mkdir()
    total = child(command(name, counting / "out", source), 0, "never", counting)
    assert total > 2
    for target in range(1, total + 1):
        for when in ("before", "after"):
            check_kill(name, target, when, tmp_path / f"{target}-{when}", source)


# The parallel experiment's child: with "before recording", it SIGKILLs itself (and its
# process group) where it would first record a worker's folder as its own.
PARALLEL_CHILD = """
import os, signal, sys
from dcp_lens.utils.folders import OutputFolder
if sys.argv[1] == "before recording":
    OutputFolder.adopt = lambda self, folder: os.killpg(0, signal.SIGKILL)
from dcp_lens.cli import main
raise SystemExit(main(sys.argv[2:]))
"""


def killed_experiment(argv: list[str], runs: list[Path], kill: str, cwd: Path) -> None:
    """Run ``argv`` in a child of its own process group, SIGKILLed with its workers ``kill``:
    "while training" (once every run of ``runs`` has a checkpoint) or "before recording"."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-c", PARALLEL_CHILD, kill, *argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 600
        while kill == "while training" and not all((r / "checkpoint").exists() for r in runs):
            assert process.poll() is None, "the experiment ended before the kill"
            assert time.monotonic() < deadline, "the trainings wrote no checkpoint in 600 s"
            time.sleep(0.2)
    finally:
        if kill == "while training":
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=600)
    assert process.returncode == -signal.SIGKILL


@pytest.mark.slow
@pytest.mark.parametrize("kill", ["while training", "before recording"])
def test_a_parallel_experiment_killed_is_adopted_by_a_rerun(tmp_path, kill):
    """``experiment --jobs 2`` SIGKILLed with its worker processes, while both trainings are
    under way or once they finished but before it recorded their folders as its own: the rerun
    finishes it, every file but the user's is the experiment's own by proof, the user's files
    (in the folder, in ``runs/``, in a run's folder) are kept, nothing is written beside it."""
    box = tmp_path / "box"
    box.mkdir()
    out = box / "out"
    argv = [*command("experiment", out, None)[:-2], "--seeds", "0,1", "--jobs", "2", *SMALL]
    argv += ["--quiet", "--out", str(out)]
    (box / "user_beside.txt").write_text("mine, beside --out")
    runs = [out / "runs" / f"fixed-seed{seed}" for seed in (0, 1)]
    killed_experiment(argv, runs, kill, box)
    trained = [(run / "model" / "model.safetensors").is_file() for run in runs]
    assert trained == ([False, False] if kill == "while training" else [True, True])
    users = {
        out / "user_top.txt": b"added after the kill",
        out / "runs" / "user_runs.txt": b"beside the training runs",
        runs[0] / "user_in_run.txt": b"inside a training run",
    }
    for path, data in users.items():
        path.write_bytes(data)

    assert main(argv) == 0
    assert {path: path.read_bytes() for path in users} == users
    assert sorted(p.name for p in box.iterdir()) == ["out", "user_beside.txt"]
    contents = OutputFolder(out, "experiment").inspect()
    assert contents is not None and contents.finished
    assert sorted(contents.foreign) == sorted(str(p.relative_to(out)) for p in users)
    for run in runs:
        assert f"{run.relative_to(out)}/model/model.safetensors" in contents.own
