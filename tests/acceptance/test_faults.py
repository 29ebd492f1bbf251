"""A SIGKILL before and after every write of each command that writes a folder.

A command's writes are its journal's appends and its renames (every file it writes whole lands
by one). The command runs in a child process that kills itself at the Nth of them, just before
or just after it; then the folder must be resumed or replaced by the command run again (in this
process), the user's files in it must be byte for byte as they were, and nothing may be left
beside it.

The children are forked from one process that imported the commands' modules once, so a kill
point pays for the command's work, not for starting Python and importing torch. The experiment
is walked with its training shortened to two steps, one checkpoint each, and DCP on a few
sequences: every kind of write the default tiny experiment makes, in the same code, at fewer
repeats (a test compares the two).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dcp_lens.cli import main
from dcp_lens.training import presets
from dcp_lens.utils.folders import OutputFolder

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--n-eval", "16", "--n-calibration", "16", "--bootstrap", "5", "--probe", "none"]
# The walked experiment's training: the tiny preset cut to a first checkpoint and one that
# replaces it, then its model, table and history (a test compares it with the tiny one).
FEWER_STEPS = {"steps": 2, "checkpoint_interval": 1}

# The forking process: imports every command's modules, then for each request (one JSON line on
# stdin) forks a child that runs the command, counting its writes (journal appends and renames)
# and SIGKILLing itself at one; answers with the child's exit code (-9: killed). A child records
# where each write came from (the write, the file and the dcp_lens frames that made it).
FORKER = """
import dataclasses, json, os, re, signal, sys, traceback
import dcp_lens.cli.commands, dcp_lens.studies.intervention, dcp_lens.studies.validate
import dcp_lens.report.html, dcp_lens.training
from dcp_lens.cli import main
from dcp_lens.training import presets
from dcp_lens.utils import ownership

TEMPORARY = re.compile(r"[.][0-9a-f]{16}[.][a-z0-9_]+[.]tmp")

def site(kind, path, cwd):
    relative = os.path.relpath(os.path.realpath(path), os.path.realpath(cwd))
    name = TEMPORARY.sub(".TOKEN.tmp", relative)
    frames = traceback.extract_stack()[:-3]
    ours = [f for f in frames if "/dcp_lens/" in f.filename]
    return [kind, name, [f"{os.path.basename(f.filename)}:{f.lineno}" for f in ours]]

def run(request):
    os.chdir(request["cwd"])
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    signal.alarm(600)
    ownership._PROCESS_TOKEN = ownership.new_token()  # a fresh process's own
    if request["preset"]:
        tiny = presets.PRESETS["tiny"]
        presets.PRESETS["tiny"] = lambda regime, seed: dataclasses.replace(
            tiny(regime, seed), **request["preset"]
        )
    target, when, sites = request["target"], request["when"], []
    def event(write, site_of, *args, **kwargs):
        sites.append(site_of(*args))
        if len(sites) == target and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        result = write(*args, **kwargs)
        if len(sites) == target and when == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return result
    replace, append = os.replace, ownership.Journal.append
    def journal_site(journal, entry):
        name = entry.get("file", "journal header " + str(entry.get("kind")))
        return site("append", os.path.join(journal.folder, name), request["cwd"])
    def rename_site(source, destination):
        return site("rename", destination, request["cwd"])
    os.replace = lambda *a, **k: event(replace, rename_site, *a, **k)
    ownership.Journal.append = lambda self, e: event(append, journal_site, self, e)
    code = 1
    try:
        code = main(request["argv"])
    except BaseException:
        traceback.print_exc()
    finally:
        with open(request["sites"], "w") as file:
            json.dump(sites, file)
        sys.stderr.flush()
    os._exit(code)

for line in iter(sys.stdin.readline, ""):
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            run(request)
        finally:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    print(os.waitstatus_to_exitcode(status), flush=True)
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
        "experiment": [*TINY_EXPERIMENT, *SMALL, "--quiet", "--out", str(out)],
    }[name]


TINY_EXPERIMENT = [
    "experiment",
    "training-intervention",
    "--preset",
    "tiny",
    "--seeds",
    "0",
    "--regimes",
    "fixed",
]
# The tiny preset's changes in each walked command's child and rerun.
PRESET_CHANGES = {"experiment": FEWER_STEPS}


@pytest.fixture(scope="module")
def forker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen[str]]:
    """The process the children are forked from (`FORKER`)."""
    log = tmp_path_factory.mktemp("forker") / "stderr"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with open(log, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-c", FORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
            text=True,
        )
    yield process
    process.kill()  # between requests: no child of its is left
    process.communicate()


def child(
    forker: subprocess.Popen[str],
    argv: list[str],
    target: int,
    when: str,
    cwd: Path,
    changes: dict[str, int] | None = None,
) -> list[Any]:
    """Run ``argv`` in a child forked by ``forker``, in ``cwd``, with the tiny preset's fields
    ``changes``; killed at write ``target`` (``when``: before or after it; 0: never, and then
    it must succeed). Returns the child's writes, each ``[write, file, code]``: ``append`` (to
    a journal) or ``rename``, the file relative to ``cwd`` (a temporary file's token as
    ``TOKEN``), the ``file:line`` of each dcp_lens frame that made it."""
    assert forker.stdin is not None and forker.stdout is not None
    report, stderr = cwd.parent / f"{cwd.name}.sites", cwd.parent / f"{cwd.name}.stderr"
    request = {"argv": argv, "target": target, "when": when, "cwd": str(cwd)}
    request |= {"preset": changes or {}, "sites": str(report), "stderr": str(stderr)}
    forker.stdin.write(json.dumps(request) + "\n")
    forker.stdin.flush()
    code = int(forker.stdout.readline())
    expected = 0 if target == 0 else -signal.SIGKILL
    assert code == expected, (argv, target, when, code, stderr.read_text())
    sites: list[Any] = json.loads(report.read_text()) if report.is_file() else []
    return sites


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


def shorten_tiny(monkeypatch: pytest.MonkeyPatch, changes: dict[str, int] | None) -> None:
    """The tiny training preset with the fields ``changes`` (as the children have it)."""
    if changes:
        tiny = presets.PRESETS["tiny"]
        monkeypatch.setitem(
            presets.PRESETS,
            "tiny",
            lambda regime, seed: dataclasses.replace(tiny(regime, seed), **changes),
        )


def check_kill(
    forker: subprocess.Popen[str], name: str, target: int, when: str, box: Path, source: Path
) -> None:
    """Kill ``name`` at write ``target`` ``when``; a user file beside the folder and one added
    to it after the kill; then the command again, in this process (a run: resumed after a kill
    before, replaced after)."""
    box.mkdir()
    out = box / "out"
    argv = command(name, out, source)
    folder = box if name == "report file" else out  # where the command writes
    (box / "user_beside.txt").write_text("mine, beside --out")
    before_source = {p: p.read_bytes() for p in source.rglob("*") if p.is_file()}
    child(forker, argv, target, when, box, PRESET_CHANGES.get(name))
    if folder.is_dir():
        (folder / "user_after.txt").write_text("mine, added to the interrupted folder")
    expected = {**user_files(box), **user_files(folder)}
    if name == "run":
        argv = [*argv, "--resume" if when == "before" else "--overwrite"]
    assert main(argv) == 0, (name, target, when)
    assert {**user_files(box), **user_files(folder)} == expected, (name, target, when)
    assert {p: p.read_bytes() for p in source.rglob("*") if p.is_file()} == before_source
    beside = sorted(p.name for p in box.iterdir() if p.name != "out" and "user" not in p.name)
    allowed = {"report file": ["out.html", "out_files"]}.get(name, [])
    assert beside == allowed, (name, target, when, beside)


@pytest.mark.parametrize(
    "target, when",
    [(1, "before"), *(pytest.param(t, w, marks=pytest.mark.slow) for t, w in FIRST_WRITES)],
)
def test_a_run_killed_at_its_first_writes_resumes_and_keeps_user_files(
    tmp_path, capsys, forker, source, target, when
):
    """The journal's first line, the lock's record, the manifest's first write: a folder
    killed there is resumed (or replaced) like any other."""
    check_kill(forker, "run", target, when, tmp_path / "box", source)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["run", "report", "report file", "validate", "train", "experiment"]
)
def test_every_write_of_every_command_can_be_killed(
    tmp_path, capsys, monkeypatch, forker, source, name
):
    shorten_tiny(monkeypatch, PRESET_CHANGES.get(name))
    counting = tmp_path / "counting"
    counting.mkdir()
    argv = command(name, counting / "out", source)
    total = len(child(forker, argv, 0, "never", counting, PRESET_CHANGES.get(name)))
    assert total > 2
    for target in range(1, total + 1):
        for when in ("before", "after"):
            check_kill(forker, name, target, when, tmp_path / f"{target}-{when}", source)


@pytest.mark.slow
def test_the_walked_experiment_writes_where_the_tiny_one_does(tmp_path, forker):
    """The walked experiment (two training steps, DCP on a few sequences) writes every file
    the tiny preset's experiment writes, from every line of code it writes it from, each
    kind of temporary and replaced checkpoint included: fewer writes, no fewer sites."""
    walked, tiny = tmp_path / "walked", tmp_path / "tiny"
    walked.mkdir()
    tiny.mkdir()
    argv = command("experiment", walked / "out", None)
    fewer = child(forker, argv, 0, "never", walked, FEWER_STEPS)
    every = child(
        forker, [*TINY_EXPERIMENT, "--quiet", "--out", str(tiny / "out")], 0, "never", tiny
    )
    assert len(fewer) < len(every)
    assert {json.dumps(site) for site in fewer} == {json.dumps(site) for site in every}


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
