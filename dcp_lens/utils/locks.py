"""One writer per output folder: a lock held on a file in the folder while a command writes it.

`FolderLock` takes an exclusive ``fcntl`` lock on ``FOLDER/.lock`` without waiting; a second
command into the same folder is refused at once with a `FolderBusyError` naming the process that
holds it. The operating system drops the lock when its process ends, however it ends (a SIGKILL
included), so a stale lock file never blocks a later run.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from dcp_lens.utils.errors import DCPLensError, InputError

LOCK_FILE = ".lock"


class FolderBusyError(DCPLensError):
    """Another dcp-lens process is writing the output folder."""


class FolderLock:
    """An exclusive lock on ``folder`` (created if needed) for a ``with`` block or until
    `release`; ``flag`` names the folder in messages (``--out``)."""

    def __init__(self, folder: str | Path, flag: str = "--out") -> None:
        self.folder = Path(folder)
        self.flag = flag
        self._fd: int | None = None
        self.created = False

    def acquire(self) -> FolderLock:
        """Take the lock, or raise `FolderBusyError` if another process holds it."""
        import fcntl  # POSIX only; imported here so that the module imports everywhere

        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / LOCK_FILE
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                self.created = True
            except FileExistsError:
                fd = os.open(path, os.O_RDWR)
                self.created = False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                holder = os.read(fd, 64).decode(errors="replace").strip() or "another process"
                os.close(fd)
                raise FolderBusyError(
                    f"{self.flag} {self.folder} is being written by another dcp-lens process "
                    f"(pid {holder}, lock {path}); wait for it to finish or choose another "
                    "folder."
                ) from error
            if _same_file(fd, path):
                break
            # The file was removed or replaced (its folder swapped) between open and lock: the
            # lock taken is on a file nobody else will open. Take the one the path names now.
            os.close(fd)
        previous = os.read(fd, 64)
        if self.created or not previous.strip() or previous.strip().isdigit():
            os.ftruncate(fd, 0)  # a file of another program's stays as it was
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self, *, remove: bool = False) -> None:
        """Drop the lock. The lock file stays (an unlocked one means nothing), unless
        ``remove`` and this lock created it (a command refused a folder it does not own)."""
        if self._fd is not None:
            if remove and self.created:
                (self.folder / LOCK_FILE).unlink(missing_ok=True)
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


_IN_USE: weakref.WeakKeyDictionary[object, threading.Lock] = weakref.WeakKeyDictionary()
_IN_USE_GUARD = threading.Lock()


@contextlib.contextmanager
def model_in_use(model: object) -> Iterator[None]:
    """Hold ``model`` for one protocol run: the run installs hooks, iteration settings and
    per-run state on the model object, so a second run on the same object at the same time
    (another thread) is refused at once with an `InputError` saying what to do."""
    with _IN_USE_GUARD:
        lock = _IN_USE.setdefault(model, threading.Lock())
    if not lock.acquire(blocking=False):
        raise InputError(
            f"this model ({type(model).__name__}) is already being run by another protocol (in "
            "another thread); a run sets hooks and state on the model, so run protocols on one "
            "model one after another, or give each thread its own copy (copy.deepcopy(model))."
        )
    try:
        yield
    finally:
        lock.release()


def _same_file(fd: int, path: Path) -> bool:
    """Does ``path`` still name the file open as ``fd``?"""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


__all__ = ["LOCK_FILE", "FolderBusyError", "FolderLock", "model_in_use"]
