"""Stopping on a signal: SIGTERM, SIGHUP and SIGQUIT end a command as Ctrl-C (SIGINT) does.

Inside `stop_on_signals`, each of these signals raises `Interrupted` in the main thread, where
the command's ``finally`` blocks run (locks released, nothing half-written: every file dcp-lens
writes is written atomically) and the command line turns it into one line saying how to resume.
SIGINT's own KeyboardInterrupt is caught the same way by the command line.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, name)
)


class Interrupted(KeyboardInterrupt):
    """A stop signal arrived (a KeyboardInterrupt, so that code stopping on Ctrl-C stops on it)."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(signal.Signals(signum).name)


def signal_name(error: BaseException) -> str:
    """``SIGTERM``, ... for an `Interrupted`; ``SIGINT`` for Ctrl-C's KeyboardInterrupt."""
    return signal.Signals(error.signum).name if isinstance(error, Interrupted) else "SIGINT"


def exit_code(error: BaseException) -> int:
    """The shell's code for a process stopped by the signal (128 + its number)."""
    return 128 + (error.signum if isinstance(error, Interrupted) else int(signal.SIGINT))


def _raise(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, the stop signals raise `Interrupted`; the previous handlers come back
    after it. Outside the main thread (where Python cannot set handlers) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, Callable[[int, FrameType | None], object] | int | None] = {}
    for signum in STOP_SIGNALS:
        previous[signum] = signal.signal(signum, _raise)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def how_to_continue(command: str, out: object) -> str:
    """What to do after ``dcp-lens COMMAND --out OUT`` was stopped by a signal."""
    if command == "run" and out is not None:
        return (
            f"{out} is kept (marked INCOMPLETE if the run had started); rerun the same command "
            "with --resume to continue."
        )
    if command in ("train", "experiment") and out is not None:
        return f"rerun the same command to continue from {out}'s last checkpoint."
    return "nothing was written in part; rerun the command."


def die_with_parent(parent: int) -> None:
    """Make this (worker) process end when its parent ``parent`` does, however the parent ends
    (a SIGKILL included): Linux's parent-death signal, and elsewhere a thread that polls the
    parent. Called first thing in a worker (a pool's initializer)."""
    import ctypes
    import os
    import sys
    import time

    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before the signal was set
        os._exit(1)

    def poll() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=poll, daemon=True, name="die-with-parent").start()


__all__ = [
    "STOP_SIGNALS",
    "die_with_parent",
    "Interrupted",
    "exit_code",
    "signal_name",
    "stop_on_signals",
]
