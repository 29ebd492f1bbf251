"""What runs write into their output folders: nothing on a refused or failed run, never outside
the folder, no overwrite without ``--overwrite`` (and then the run whole), one writer at a time
under the lock, whole files under concurrent and interrupted writes, and workers that end with
their parent.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import (
    SMALL,
    one_line_error,
    run_argv,
)

from dcp_lens.cli import main
from dcp_lens.protocol.dcp import DepthControlProtocol
from dcp_lens.protocol.results import ProtocolResults
from dcp_lens.utils.errors import (
    ConfigError,
    IncompleteRunError,
    ResourceLimitError,
)


def test_a_run_that_fails_its_checks_leaves_no_folder(capsys, tmp_path):
    out = tmp_path / "out"
    argv = ["run", "--model", "planted:readout_shift", "--dense", "no-such-model"]
    argv += ["--out", str(out), *SMALL, "--quiet"]
    assert "unknown model spec 'no-such-model'" in one_line_error(capsys, argv)
    assert not out.exists()


def test_a_run_refused_by_the_sweeps_own_checks_leaves_no_folder(capsys, tmp_path, monkeypatch):
    def refuse(*_: object) -> None:
        raise ValueError("the calibration split overlaps the evaluation split")

    monkeypatch.setattr(DepthControlProtocol, "run", refuse)
    out = tmp_path / "out"
    argv = ["run", "--model", "planted:readout_shift", "--out", str(out), *SMALL]
    assert "overlaps" in one_line_error(capsys, argv)
    assert not out.exists()


def test_a_run_stopped_after_its_first_model_is_marked_incomplete_and_resumes(
    capsys, tmp_path, monkeypatch
):
    import dcp_lens.utils.snapshots as snapshots

    def stop_after_first_model(point: str) -> None:
        if point == "model:1":
            raise KeyboardInterrupt

    out = tmp_path / "out"
    argv = ["run", "--out", str(out), *SMALL, "--quiet"]  # default, then default-dense
    with monkeypatch.context() as patch:
        patch.setattr(snapshots, "die_if_asked", stop_after_first_model)
        assert main(argv) == 130
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "stopped by SIGINT" in err and "--resume" in err, err
    assert (out / "default" / "results.json").is_file()
    assert not (out / "default-dense").exists() and not (out / "results.json").exists()
    with pytest.raises(IncompleteRunError, match="marked incomplete .*Rerun the command"):
        ProtocolResults.load(out / "default")
    assert main([*argv, "--resume"]) == 0
    assert ProtocolResults.load(out / "default-dense").model == "default-dense"
    assert (out / "results.json").is_file() and not (out / "INCOMPLETE").exists()


def tree(folder: Path) -> dict[str, str]:
    """Every file below ``folder`` (relative path -> content hash)."""
    import hashlib

    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def test_model_folder_names_never_leave_the_output_folder():
    from dcp_lens.utils.files import safe_name

    for spec in ("..", ".", "", "/", "../../etc", "/abs/path", "huginn:../x", ".hidden", "a/../.."):
        name = safe_name(spec)
        assert name and not name.startswith(".") and "/" not in name, (spec, name)
        assert (Path("/out") / name).resolve().parent == Path("/out"), (spec, name)


def test_a_model_given_as_a_parent_path_writes_inside_out(capsys, tmp_path, monkeypatch):
    from dcp_lens.zoo.bundled import bundled_path

    model = shutil.copytree(bundled_path("default"), tmp_path / "model")
    (model / "sub").mkdir()
    before = tree(tmp_path / "model")
    monkeypatch.chdir(model / "sub")
    out = tmp_path / "out"
    assert main(["run", "--model", "..", *SMALL, "--quiet", "--out", str(out)]) == 0
    assert tree(tmp_path / "model") == before  # nothing written beside the model or --out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out"]
    assert (out / "__" / "results.json").is_file()


@pytest.mark.parametrize("target", ["results.json", "planted_readout_shift/shares.csv", "sub"])
def test_report_refuses_an_out_that_would_overwrite_the_run(capsys, tmp_path, finished_run, target):
    run = shutil.copytree(finished_run, tmp_path / "run")
    before = tree(run)
    out = run / target
    if target == "sub":  # a folder holding a file of another kind named report.html
        out.mkdir()
        (out / "report.html").write_text("not a report")
        before = tree(run)
    err = one_line_error(capsys, ["report", str(run), "--out", str(out)])
    assert "--out" in err and ("html" in err or "not a report" in err), err
    assert tree(run) == before
    assert main(["report", str(run)]) == 0  # the run is intact and still reads


def test_report_writes_a_new_html_file_and_replaces_its_own(capsys, tmp_path, finished_run):
    run = shutil.copytree(finished_run, tmp_path / "run")
    assert main(["report", str(run), "--out", str(tmp_path / "copy.html")]) == 0
    assert main(["report", str(run), "--out", str(tmp_path / "copy.html")]) == 0
    assert "<html" in (tmp_path / "copy.html").read_text().lower()


def test_overwrite_with_a_bad_argument_leaves_the_finished_run_readable(
    capsys, tmp_path, finished_run
):
    run = shutil.copytree(finished_run, tmp_path / "run")
    before = tree(run)
    argv = ["run", "--model", "planted:no_such", *SMALL, "--out", str(run), "--overwrite"]
    assert "unknown planted model" in one_line_error(capsys, argv)
    assert tree(run) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no sibling left either
    ProtocolResults.load(run / "planted_readout_shift")


def test_overwrite_replaces_the_run_whole_and_leaves_no_sibling(capsys, tmp_path, finished_run):
    """Every file the old run wrote (its manifest lists them) goes; a file added since stays."""
    run = shutil.copytree(finished_run, tmp_path / "run")
    from dcp_lens.utils.ownership import identity

    (run / "stale.txt").write_text("a file of the old run")
    manifest = json.loads((run / ".dcp-lens.json").read_text())
    manifest["files"]["stale.txt"] = identity((run / "stale.txt").stat(), run / "stale.txt")
    (run / ".dcp-lens.json").write_text(json.dumps(manifest))
    (run / "notes.txt").write_text("the user's")
    argv = run_argv(run, "--overwrite", "--seed", "3")
    assert main(argv) == 0
    assert not (run / "stale.txt").exists() and not (run / "INCOMPLETE").exists()
    assert (run / "notes.txt").read_text() == "the user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert json.loads((run / "results.json").read_text())["runs"][0]["metadata"]["seed"] == 3


def test_overwrite_stopped_midway_keeps_the_old_finished_run(
    capsys, tmp_path, finished_run, monkeypatch
):
    import dcp_lens.utils.snapshots as snapshots

    def stop(point: str) -> None:
        if point == "model:1":
            raise KeyboardInterrupt

    run = shutil.copytree(finished_run, tmp_path / "run")
    before = tree(run)
    monkeypatch.setattr(snapshots, "die_if_asked", stop)
    assert main(run_argv(run, "--overwrite", "--seed", "3")) == 130
    assert "stopped by SIGINT" in capsys.readouterr().err
    assert tree(run) == before  # the old run, whole; the new one waits beside it, incomplete
    monkeypatch.undo()
    assert main(run_argv(run, "--overwrite", "--seed", "3")) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_second_run_into_a_busy_out_is_refused_by_the_lock(capsys, tmp_path):
    from dcp_lens.utils.locks import FolderLock

    out = tmp_path / "out"
    with FolderLock(out):
        err = one_line_error(capsys, run_argv(out))
    assert "is being written by another dcp-lens process" in err
    assert main(run_argv(out)) == 0  # the lock is gone with its holder


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGHUP", "SIGQUIT"])
def test_stop_signals_end_the_run_in_one_line_and_it_resumes(capsys, tmp_path, monkeypatch, signum):
    import os
    import signal

    import dcp_lens.utils.snapshots as snapshots

    def stop(point: str) -> None:
        if point == "calibration:1":
            os.kill(os.getpid(), getattr(signal, signum))

    out = tmp_path / "out"
    monkeypatch.setattr(snapshots, "die_if_asked", stop)
    code = main(run_argv(out, "--checkpoint-every", "1", "--batch-size", "8"))
    assert code == 128 + getattr(signal, signum)
    err = capsys.readouterr().err.strip()
    assert err == err.splitlines()[0] and f"stopped by {signum}" in err and "--resume" in err
    assert (out / "INCOMPLETE").is_file()
    monkeypatch.undo()
    assert main(run_argv(out, "--checkpoint-every", "1", "--batch-size", "8", "--resume")) == 0


def test_atomic_writes_from_threads_leave_one_whole_file(tmp_path):
    """Four threads writing one path 200 times each: no error, the file is one writer's whole
    text, no temporary file is left beside it."""
    import threading

    from dcp_lens.utils.files import write_text_atomically

    path, errors = tmp_path / "shared.json", []

    def writer(index: int) -> None:
        for round_ in range(200):
            try:
                write_text_atomically(path, json.dumps({"writer": index, "round": round_}) * 50)
            except Exception as error:  # the property: none
                errors.append(error)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    text = path.read_text()
    assert text == text[: len(text) // 50] * 50 and json.loads(text[: len(text) // 50])
    assert [p.name for p in tmp_path.iterdir()] == ["shared.json"]
    assert oct(path.stat().st_mode & 0o777) != oct(0o600)  # not mkstemp's private mode


def test_a_full_disk_names_itself_and_leaves_the_old_file(tmp_path, monkeypatch):
    import errno
    import os

    from dcp_lens.utils import files

    path = files.write_text_atomically(tmp_path / "validation.json", "old\n")

    def full(descriptor: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(ResourceLimitError, match=r"no space left on .* while writing .*validation"):
        files.write_text_atomically(path, "new\n" * 1000)
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == [path.name]
    # a library's own words for it (safetensors' SafetensorError, torch's short write)
    with pytest.raises(ResourceLimitError, match="no space left"):
        with files.naming_full_disk(tmp_path / "model"):
            raise RuntimeError('IoError(Os { code: 28, kind: StorageFull, message: "No space left"')


def test_overwrite_keeps_the_users_files_and_follows_a_link(tmp_path, capsys, finished_run):
    run = shutil.copytree(finished_run, tmp_path / "run", symlinks=True)
    (run / "my_notes.txt").write_text("mine")
    (run / "analysis").mkdir()
    (run / "analysis" / "fig.png").write_bytes(b"\x89PNG")
    link = tmp_path / "link"
    link.symlink_to(run)
    err = one_line_error(
        capsys,
        [
            "run",
            "--model",
            "planted:readout_shift",
            *SMALL,
            "--quiet",
            "--seed",
            "3",
            "--out",
            str(link),
        ],
    )
    assert "finished" in err and "--overwrite" in err
    argv = [
        "run",
        "--model",
        "planted:readout_shift",
        *SMALL,
        "--quiet",
        "--seed",
        "3",
        "--overwrite",
        "--out",
        str(link),
    ]
    assert main(argv) == 0
    assert link.is_symlink() and (run / "my_notes.txt").read_text() == "mine"
    assert (run / "analysis" / "fig.png").read_bytes() == b"\x89PNG"
    seeds = {r["metadata"]["seed"] for r in json.loads((run / "results.json").read_text())["runs"]}
    assert seeds == {3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "run"]  # no .replacing left


@pytest.mark.parametrize("command", ["run", "train", "validate", "experiment", "report", "save"])
def test_every_writer_refuses_a_folder_of_the_users_files(tmp_path, capsys, finished_run, command):
    """A folder holding files no dcp-lens command wrote is refused, naming what is there."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "validation.md").write_text("my notes")
    (out / "plotly.min.js").write_text("my script")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    argv = {
        "run": ["run", "--model", "planted:readout_shift", *SMALL, "--quiet", "--out", str(out)],
        "train": ["train", "--preset", "tiny", "--steps", "1", "--out", str(out)],
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
        "experiment": [
            "experiment",
            "training-intervention",
            "--preset",
            "tiny",
            "--seeds",
            "0",
            "--out",
            str(out),
        ],
        "report": ["report", str(finished_run), "--out", str(out)],
    }
    if command == "save":
        results = ProtocolResults.load(finished_run / "planted_readout_shift")
        with pytest.raises(ConfigError, match="did not write"):
            results.save(out)
    else:
        err = one_line_error(capsys, argv[command])
        assert "did not write" in err and "validation.md" in err, err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_report_to_a_file_touches_nothing_beside_it(tmp_path, capsys, finished_run):
    folder = tmp_path / "d"
    folder.mkdir()
    for name, text in (("plotly.min.js", "mine"), (".lock", "my lock"), ("notes.txt", "x")):
        (folder / name).write_text(text)
    assert main(["report", str(finished_run), "--out", str(folder / "r.html")]) == 0
    assert sorted(p.name for p in folder.iterdir()) == [
        ".lock",
        "notes.txt",
        "plotly.min.js",
        "r.html",
        "r_files",
    ]
    assert (folder / "plotly.min.js").read_text() == "mine"
    assert (folder / ".lock").read_text() == "my lock"
    page = (folder / "r.html").read_text()
    assert "src='r_files/plotly.min.js'" in page  # its own copy, in the folder it owns
    results = ProtocolResults.load(finished_run / "planted_readout_shift")
    for bad in (finished_run / "results.json", tmp_path / "x.txt"):
        before = bad.read_bytes() if bad.exists() else None
        with pytest.raises(ConfigError):
            results.report(bad)
        assert (bad.read_bytes() if bad.exists() else None) == before
    run_copy = shutil.copytree(finished_run, tmp_path / "run")
    with pytest.raises(ConfigError, match="run"):
        results.save(run_copy)  # a run folder is not a save folder: its results.json stays
    assert (run_copy / "results.json").read_bytes() == (finished_run / "results.json").read_bytes()


@pytest.mark.parametrize(
    "offset",
    [1.5, pytest.param(0.0, marks=pytest.mark.slow), pytest.param(6.0, marks=pytest.mark.slow)],
)
def test_two_runs_into_one_folder_exactly_one_finishes(tmp_path, offset):
    """Two runs into one --out, the second started ``offset`` seconds after the first (while it
    loads, writes or has finished): one exits 0, the other 2 (busy or finished), and the folder
    holds the winner's run, whole."""
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parents[2]
    code = "import sys; from dcp_lens.cli import main; raise SystemExit(main(sys.argv[1:]))"
    env = {**__import__("os").environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    for out in (tmp_path / "out",):
        processes = []
        for seed in (1, 2):
            argv = [
                "run",
                "--model",
                "planted:readout_shift",
                *SMALL,
                "--quiet",
                "--seed",
                str(seed),
                "--out",
                str(out),
            ]
            process = subprocess.Popen(
                [sys.executable, "-c", code, *argv],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            processes.append(process)
            time.sleep(offset)
        codes = [p.wait(timeout=300) for p in processes]
        errors = [p.stderr.read().decode() for p in processes if p.stderr is not None]
        assert sorted(codes) == [0, 2], (codes, errors)
        loser = errors[codes.index(2)]
        assert "another dcp-lens process" in loser or "finished" in loser, loser
        winner = codes.index(0) + 1
        runs = json.loads((out / "results.json").read_text())["runs"]
        assert {r["metadata"]["seed"] for r in runs} == {winner}
        assert not (out / "INCOMPLETE").exists()


def test_workers_die_with_their_parent(tmp_path):
    """A pool's worker, set up by die_with_parent, ends when its parent is SIGKILLed."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "parent.py"
    script.write_text(
        "import os, sys, time, multiprocessing\n"
        "from concurrent.futures import ProcessPoolExecutor\n"
        "from dcp_lens.utils.signals import die_with_parent\n"
        "def work():\n    time.sleep(120)\n"
        "if __name__ == '__main__':\n"
        "    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context('spawn'),\n"
        "                               initializer=die_with_parent, initargs=(os.getpid(),))\n"
        "    pool.submit(work)\n"
        "    time.sleep(2)\n"
        "    print(*[p.pid for p in pool._processes.values()], flush=True)\n"
        "    time.sleep(120)\n"
    )
    root = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert parent.stdout is not None
    workers = [int(pid) for pid in parent.stdout.readline().split()]
    assert workers
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 20
    alive = workers
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in workers if _alive(pid)]
        time.sleep(0.2)
    assert alive == [], f"workers {alive} outlived their parent"


def _alive(pid: int) -> bool:
    import os

    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def test_the_finished_check_is_made_again_under_the_lock(tmp_path):
    """B judges the folder new before A has finished it; once B holds the lock it judges it
    again and refuses the finished run (B never replaces what A wrote)."""
    from dcp_lens.utils.files import write_text_atomically
    from dcp_lens.utils.folders import OutputFolder
    from dcp_lens.utils.locks import FolderBusyError

    out = tmp_path / "out"
    first = OutputFolder(out, "run")
    second = OutputFolder(out, "run")
    assert second.plan() == "new"  # before anything is locked
    work = first.open()
    first.prepare()
    with pytest.raises(FolderBusyError):
        second.open()
    write_text_atomically(work / "results.json", "{}")  # recorded: the command's own
    first.finish()
    with pytest.raises(ConfigError, match="holds a finished run"):
        second.open()
    assert (out / "results.json").read_text() == "{}"
    manifest = json.loads((out / ".dcp-lens.json").read_text())
    assert manifest["finished"] and sorted(manifest["files"]) == [".lock", "results.json"]
    (out / "notes.txt").write_text("mine")  # a user's file after the run: kept by a restart
    third = OutputFolder(out, "run", overwrite=True)
    third.open()
    third.prepare()
    names = [".dcp-lens.journal", ".dcp-lens.json", ".lock", "notes.txt"]
    assert sorted(p.name for p in out.iterdir()) == names
    third.close()
