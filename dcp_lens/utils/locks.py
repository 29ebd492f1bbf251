"""One writer per output folder: a lock held on a file in the folder while a command writes it.

`FolderLock` takes an exclusive ``flock`` on ``FOLDER/.lock`` without waiting; a second command
into the same folder is refused at once with a `FolderBusyError` naming the process that holds
it. The operating system drops the lock when its process ends, however it ends (a SIGKILL
included), so a stale lock file never blocks a later run: whether a lock is held is asked of the
system, never read from the file's content.

The lock file is opened without following a link and without blocking (``O_NOFOLLOW``,
``O_NONBLOCK``) and must be a regular file of one name (checked on the open descriptor): a link,
folder, FIFO, socket, device or hard-linked file named ``.lock`` is refused with a `ConfigError`
naming it, so the lock can neither hang nor write outside the folder. The holder's process id is
written into a lock file this command created, or into one holding nothing or a dcp-lens lock
record (`RECORD`); a file of other content is locked as it is and never rewritten.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from dcp_lens.utils.errors import ConfigError, DCPLensError, InputError

LOCK_FILE = ".lock"
RECORD = "dcp-lens lock held by pid "  # the start of what a holder writes into its lock file
_RECORD_SIZE = 64  # bytes of a lock file read to find a record
_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


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

    @property
    def path(self) -> Path:
        return self.folder / LOCK_FILE

    def acquire(self) -> FolderLock:
        """Take the lock, or raise `FolderBusyError` if another process holds it (and
        `ConfigError` if ``.lock`` is not a regular file of its own)."""
        import fcntl  # POSIX only; imported here so that the module imports everywhere

        self.folder.mkdir(parents=True, exist_ok=True)
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                holder = _holder(fd)
                os.close(fd)
                raise FolderBusyError(
                    f"{self.flag} {self.folder} is being written by another dcp-lens process "
                    f"({holder}, lock {self.path}); wait for it to finish or choose another "
                    "folder."
                ) from error
            if _same_file(fd, self.path):
                break
            # The file was removed or replaced (its folder swapped) between open and lock: the
            # lock taken is on a file nobody else will open. Take the one the path names now.
            os.close(fd)
        if self.created or _holder(fd, unknown="") != "" or os.fstat(fd).st_size == 0:
            os.ftruncate(fd, 0)  # ours (made here, empty, or a lock record): a file of another
            os.pwrite(fd, f"{RECORD}{os.getpid()}\n".encode(), 0)  # program's stays as it was
        self._fd = fd
        return self

    def _open(self) -> int:
        """The lock file opened (made if missing), checked to be a regular file of one name."""
        path = self.path
        try:
            fd = os.open(path, _FLAGS | os.O_CREAT | os.O_EXCL, 0o644)
            self.created = True
        except FileExistsError:
            self.created = False
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                return self._open()  # removed since: make it
            if not stat.S_ISREG(mode):  # refused before an open that could hang or follow
                raise self._refusal(mode) from None
            try:
                fd = os.open(path, _FLAGS)
            except OSError as error:  # replaced by a link or special file since the lstat
                raise self._refusal(None, error) from error
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            os.close(fd)
            raise self._refusal(info.st_mode, links=info.st_nlink)
        return fd

    def _refusal(
        self, mode: int | None, error: OSError | None = None, links: int = 1
    ) -> ConfigError:
        what = _kind(mode) if mode is not None else f"not a regular file ({error})"
        if mode is not None and stat.S_ISREG(mode) and links != 1:
            what = f"a file with {links} names (a hard link to a file elsewhere)"
        return ConfigError(
            f"{self.flag} {self.folder}: its lock file {self.path} is {what}; dcp-lens locks a "
            "folder with a regular file of that name. Remove or rename it, or choose another "
            "folder."
        )

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self, *, remove: bool = False) -> None:
        """Drop the lock. The lock file stays (an unlocked one means nothing), unless
        ``remove`` and this lock created it (a command refused a folder it does not own)."""
        if self._fd is not None:
            if remove and self.created and _same_file(self._fd, self.path):
                self.path.unlink(missing_ok=True)
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


def _holder(fd: int, unknown: str = "a process that holds the lock") -> str:
    """Who holds the lock, from a lock record in the file (``pid N``); else ``unknown``."""
    text = os.pread(fd, _RECORD_SIZE, 0).decode(errors="replace")
    pid = text.removeprefix(RECORD).strip()
    if text.startswith(RECORD) and text.endswith("\n") and pid.isdigit():
        return f"pid {pid}"
    return unknown


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


__all__ = ["LOCK_FILE", "RECORD", "FolderBusyError", "FolderLock", "model_in_use"]
