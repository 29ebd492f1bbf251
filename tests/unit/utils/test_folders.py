"""The output-folder contract at its edges: a file is the command's own only by its record; a
folder interrupted at any write is resumed or replaced; user files are kept byte for byte."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dcp_lens.utils import files
from dcp_lens.utils.errors import ConfigError
from dcp_lens.utils.files import write_text_atomically
from dcp_lens.utils.folders import MANIFEST, OutputFolder, report_target


def user_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.name.startswith("user")}


def write_run(out: Path, *, resume: bool = False, overwrite: bool = False) -> None:
    """A small command: two files, the second in a subfolder."""
    with OutputFolder(out, "run", resume=resume, overwrite=overwrite) as work:
        write_text_atomically(work / "results.json", "{}\n")
        (work / "model").mkdir(exist_ok=True)
        write_text_atomically(work / "model" / "table.csv", "a\n")


class Killed(BaseException):
    """Stands for a SIGKILL at a write: nothing after it runs (no cleanup is asked for)."""


def interrupted(out: Path, at: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`write_run` stopped at its ``at``-th rename (before it, when ``at`` is even; after it
    when odd), leaving the folder as a kill there would."""
    calls = {"n": 0}
    real_replace = os.replace

    def replace(source: object, target: object) -> None:
        calls["n"] += 1
        if calls["n"] * 2 - 1 == at:
            raise Killed
        real_replace(source, target)  # type: ignore[arg-type]
        if calls["n"] * 2 == at:
            raise Killed

    monkeypatch.setattr(files.os, "replace", replace)
    close = OutputFolder.close  # a kill cleans nothing up: the lock is only released
    monkeypatch.setattr(OutputFolder, "close", lambda self, abandon=False: close(self))
    opened: list[OutputFolder] = []
    open_folder = OutputFolder.open

    def open_noted(self: OutputFolder, **options: bool) -> Path:
        opened.append(self)
        return open_folder(self, **options)

    monkeypatch.setattr(OutputFolder, "open", open_noted)
    with pytest.raises(Killed):
        write_run(out)
    monkeypatch.undo()
    for folder in opened:  # the locks go with a killed process, wherever it stopped
        for lock in folder._locks:
            lock.release()


@pytest.mark.parametrize("at", range(1, 9))
@pytest.mark.parametrize("how", ["rerun", "resume", "overwrite"])
def test_a_folder_killed_at_any_write_is_recovered_and_keeps_user_files(
    tmp_path, monkeypatch, at, how
):
    out = tmp_path / "out"
    interrupted(out, at, monkeypatch)
    (out / "user_notes.txt").write_text("mine")  # added to the interrupted folder
    before = user_files(out)
    finished = (out / MANIFEST).is_file() and json.loads((out / MANIFEST).read_text())["finished"]
    if finished and how == "rerun":  # killed after its last write: a finished run, refused
        with pytest.raises(ConfigError, match="holds a finished run"):
            write_run(out)
        how = "overwrite"
    write_run(out, resume=how == "resume", overwrite=how == "overwrite")
    assert user_files(out) == before
    assert (out / "results.json").read_text() == "{}\n"
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["finished"] and "user_notes.txt" not in manifest["files"]
    leftovers = [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []  # the command's temporary files, known by their token, are gone
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing beside --out


def test_a_file_added_while_the_command_writes_is_the_users(tmp_path, capsys):
    out = tmp_path / "out"
    with OutputFolder(out, "run") as work:
        write_text_atomically(work / "results.json", "{}\n")
        (work / "user_added.txt").write_text("mine")  # appears during the run
    manifest = json.loads((out / MANIFEST).read_text())
    assert "user_added.txt" not in manifest["files"]
    write_run(out, overwrite=True)
    assert (out / "user_added.txt").read_text() == "mine"
    assert "user_added.txt" in capsys.readouterr().err  # the note names what was kept


def test_a_file_put_in_place_of_the_commands_is_not_overwritten(tmp_path):
    out = tmp_path / "out"
    write_run(out)
    (out / "results.json").unlink()
    (out / "results.json").write_text("my edit")
    with pytest.raises(ConfigError, match="results.json were written by dcp-lens and have been"):
        write_run(out, overwrite=True)
    assert (out / "results.json").read_text() == "my edit"


def test_a_copied_folder_still_proves_its_files(tmp_path):
    import shutil

    write_run(tmp_path / "out")
    copy = Path(shutil.copytree(tmp_path / "out", tmp_path / "copy"))
    write_run(copy, overwrite=True)  # its files are known by their content
    assert sorted(p.name for p in copy.iterdir() if not p.name.startswith(".")) == [
        "model",
        "results.json",
    ]


def test_a_lone_file_of_the_manifests_name_is_refused_and_kept(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / MANIFEST).write_text('{"kind": "run", "files": []}')
    with pytest.raises(ConfigError, match="not a manifest of dcp-lens"):
        write_run(out)
    assert (out / MANIFEST).read_text() == '{"kind": "run", "files": []}'


def test_a_users_replacing_folder_and_old_folder_are_never_touched(tmp_path, monkeypatch):
    out = tmp_path / "out"
    write_run(out)
    for name in (".out.replacing", "out.old", ".out.old"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "user_file.txt").write_text(name)
    monkeypatch.setattr(files, "_exchange", lambda first, second: False)  # no renameat2
    with OutputFolder(out, "run", overwrite=True) as _:
        pass
    write_run(out, overwrite=True)  # a finished run with files again: the staged replace's
    folder = OutputFolder(out, "run", overwrite=True)
    work = folder.open(staged=True)
    folder.prepare()
    write_text_atomically(work / "results.json", "{}\n")
    folder.finish()
    for name in (".out.replacing", "out.old", ".out.old"):
        assert (tmp_path / name / "user_file.txt").read_text() == name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["out", ".out.replacing", "out.old", ".out.old"]
    )


def test_a_users_page_or_assets_are_never_taken_for_a_report(tmp_path):
    page = tmp_path / "r.html"
    page.write_text("<html><title>dcp-lens notes</title>mine</html>")
    with pytest.raises(ConfigError, match="not a report dcp-lens wrote"):
        report_target(page)
    other = tmp_path / "s.html"
    (tmp_path / "s_files").mkdir()
    (tmp_path / "s_files" / "plotly.min.js").write_text("my script")
    with pytest.raises(ConfigError, match="did not write"):
        report_target(other)
    target = report_target(tmp_path / "t.html")  # new: written, then its own to replace
    with target.folder:
        write_text_atomically(target.file, "<html>report</html>")
    again = report_target(tmp_path / "t.html")
    assert again.lone and again.folder.contents is not None


def test_a_pages_temporary_file_left_by_a_kill_is_cleared_by_the_next_report(tmp_path, monkeypatch):
    from dcp_lens.utils import ownership

    page = tmp_path / "t.html"
    target = report_target(page)
    close = OutputFolder.close
    monkeypatch.setattr(OutputFolder, "close", lambda self, abandon=False: close(self))
    with pytest.raises(Killed), target.folder:
        leftover = tmp_path / (ownership.temporary_prefix(page) + "x1y2z3.tmp")
        leftover.write_text("<html>half a page")  # as a kill before the rename leaves it
        raise Killed
    monkeypatch.undo()
    (tmp_path / ".t.html.0123456789abcdef.user.tmp").write_text("a user's file of that look")
    target = report_target(page)
    with target.folder:
        write_text_atomically(target.file, "<html>report</html>")
    assert not leftover.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".t.html.0123456789abcdef.user.tmp",
        "t.html",
        "t_files",
    ]
