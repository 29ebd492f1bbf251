"""The folder lock: a regular file of its own, never followed, never blocking, never rewritten
when its content is not a lock record; whether it is held is the system's answer."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest

from dcp_lens.utils.errors import ConfigError
from dcp_lens.utils.locks import LOCK_FILE, RECORD, FolderBusyError, FolderLock


def acquire_within(folder: Path, seconds: float = 10.0) -> BaseException | FolderLock:
    """``FolderLock(folder).acquire()`` in a thread: its lock or its error; a failure (not a
    hang of the test) if it takes longer than ``seconds``."""
    outcome: list[BaseException | FolderLock] = []

    def take() -> None:
        try:
            outcome.append(FolderLock(folder).acquire())
        except BaseException as error:  # the outcome under test
            outcome.append(error)

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"acquiring the lock of {folder} hung"
    return outcome[0]


def special_lock(folder: Path, kind: str, outside: Path) -> None:
    path = folder / LOCK_FILE
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink":
        path.symlink_to(outside)
    elif kind == "dangling":
        path.symlink_to(folder / "nowhere")
    elif kind == "folder":
        path.mkdir()
    elif kind == "hardlink":
        os.link(outside, path)
    elif kind == "socket":
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        server.close()


@pytest.mark.parametrize("kind", ["fifo", "symlink", "dangling", "folder", "hardlink", "socket"])
def test_a_lock_that_is_not_a_regular_file_of_its_own_is_refused(tmp_path, kind):
    folder, outside = tmp_path / "out", tmp_path / "file"
    folder.mkdir()
    outside.write_text("12345\n")
    special_lock(folder, kind, outside)
    outcome = acquire_within(folder)
    assert isinstance(outcome, ConfigError), outcome
    assert str(folder / LOCK_FILE) in str(outcome) and "regular file" in str(outcome)
    assert outside.read_text() == "12345\n"  # nothing written through a link
    assert os.path.lexists(folder / LOCK_FILE)  # and nothing removed


@pytest.mark.parametrize("content", ["12345\n", "", "my own notes\n"])
def test_a_users_lock_file_is_locked_but_never_rewritten(tmp_path, content):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / LOCK_FILE).write_text(content)
    lock = acquire_within(folder)
    assert isinstance(lock, FolderLock) and lock.held and not lock.created
    written = (folder / LOCK_FILE).read_text()
    # an empty file holds nothing to lose: it gets the holder's record
    assert written == (content or f"{RECORD}{os.getpid()}\n")
    with pytest.raises(FolderBusyError, match="another dcp-lens process"):
        FolderLock(folder).acquire()
    lock.release(remove=True)
    assert (folder / LOCK_FILE).read_text() == written  # not ours to remove


def test_staleness_is_the_systems_answer_not_the_files_content(tmp_path):
    folder = tmp_path / "out"
    first = FolderLock(folder).acquire()
    assert (folder / LOCK_FILE).read_text() == f"{RECORD}{os.getpid()}\n"
    with pytest.raises(FolderBusyError, match=f"pid {os.getpid()}"):
        FolderLock(folder).acquire()  # held: refused, naming the holder
    first.release()
    (folder / LOCK_FILE).write_text(f"{RECORD}1\n")  # a record naming a live process (init)
    second = FolderLock(folder).acquire()  # not held by anyone: taken, the record rewritten
    assert (folder / LOCK_FILE).read_text() == f"{RECORD}{os.getpid()}\n"
    second.release()


def test_a_lock_this_command_created_goes_when_it_abandons_the_folder(tmp_path):
    folder = tmp_path / "out"
    lock = FolderLock(folder).acquire()
    assert lock.created
    lock.release(remove=True)
    assert not (folder / LOCK_FILE).exists()
