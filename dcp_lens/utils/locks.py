"""One writer per output folder: a lock held on a file in the folder while a command writes it.

`FolderLock` takes an exclusive ``fcntl`` lock on ``FOLDER/.lock`` without waiting; a second
command into the same folder is refused at once with a `FolderBusyError` naming the process that
holds it. The operating system drops the lock when its process ends, however it ends (a SIGKILL
included), so a stale lock file never blocks a later run.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType

from dcp_lens.utils.errors import DCPLensError

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

    def acquire(self) -> FolderLock:
        """Take the lock, or raise `FolderBusyError` if another process holds it."""
        import fcntl  # POSIX only; imported here so that the module imports everywhere

        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / LOCK_FILE
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
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
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (the lock file stays; an unlocked one means nothing)."""
        if self._fd is not None:
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


def _same_file(fd: int, path: Path) -> bool:
    """Does ``path`` still name the file open as ``fd``?"""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


__all__ = ["LOCK_FILE", "FolderBusyError", "FolderLock"]
