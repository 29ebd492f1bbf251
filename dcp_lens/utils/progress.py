"""Progress output that suits where it lands: a tqdm bar on a terminal or in a notebook, whole
lines in a log.

tqdm redraws its bar with carriage returns and, for a bar that is not left behind, clears it with
a line of spaces; a log file or a CI console shows each of those as a line of its own, most of
them blank. Where stderr is not a terminal (and no notebook widget draws the bar), `progress`
writes instead one line per `LOG_INTERVAL` seconds at most and one when the work ends, each a
whole line, such as ``DCP sweep: 12/40`` followed by the seconds since the start.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from tqdm.auto import tqdm as auto_tqdm

_Item = TypeVar("_Item")
LOG_INTERVAL = 30.0  # seconds between two lines of a log's progress, at most one line per


@runtime_checkable
class TextStream(Protocol):
    """Where a log's lines go: ``sys.stderr``, a file, an ``io.StringIO``."""

    def write(self, text: str, /) -> object: ...

    def flush(self) -> object: ...


def progress(
    iterable: Iterable[_Item] | None = None,
    *,
    desc: str,
    total: int | None = None,
    initial: int = 0,
    enabled: bool = True,
    leave: bool = True,
    stream: TextStream | None = None,
) -> Any:
    """A progress display for ``iterable`` (or for `update` calls, with ``total``): tqdm where
    stderr is a terminal or a notebook draws tqdm's widget, `LogProgress` otherwise, nothing
    (the iterable itself, or a `LogProgress` that writes nothing) where not ``enabled``.
    ``stream``: where a log's lines go (default: stderr at call time)."""
    stream = sys.stderr if stream is None else stream
    if enabled and (_is_terminal(stream) or _in_notebook()):
        return auto_tqdm(iterable, desc=desc, total=total, initial=initial, leave=leave)
    return LogProgress(
        iterable, desc=desc, total=total, initial=initial, enabled=enabled, stream=stream
    )


class LogProgress(Generic[_Item]):
    """The part of tqdm's interface dcp-lens uses (iterate, `update`, `set_postfix`, `close`, a
    context manager), written as whole lines: at most one per `LOG_INTERVAL` seconds while the
    work goes on and one when it ends (the iterable exhausted, or `close`)."""

    def __init__(
        self,
        iterable: Iterable[_Item] | None = None,
        *,
        desc: str,
        total: int | None = None,
        initial: int = 0,
        enabled: bool = True,
        stream: TextStream | None = None,
    ) -> None:
        self.iterable, self.desc, self.enabled = iterable, desc, enabled
        sized = total is None and hasattr(iterable, "__len__")
        self.total = len(iterable) if sized else total  # type: ignore[arg-type]
        self.n = initial
        self.postfix = ""
        self.stream = stream if stream is not None else sys.stderr
        self.started = self.last_line = time.monotonic()
        self.closed = False

    def __iter__(self) -> Iterator[_Item]:
        if self.iterable is None:
            raise TypeError("LogProgress was built without an iterable; call update() instead.")
        for item in self.iterable:
            yield item
            self.update(1)
        self.close()

    def __enter__(self) -> LogProgress[_Item]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self.last_line >= LOG_INTERVAL:
            self._line("")

    def set_postfix(self, **values: object) -> None:
        self.postfix = ", ".join(f"{key}={value}" for key, value in values.items())

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._line(" done")

    def _line(self, end: str) -> None:
        now = time.monotonic()
        self.last_line = now
        if not self.enabled:
            return
        count = f"{self.n}/{self.total}" if self.total is not None else str(self.n)
        extra = f", {self.postfix}" if self.postfix else ""
        self.stream.write(f"{self.desc}: {count}{end} ({now - self.started:.0f} s{extra})\n")
        self.stream.flush()


def _is_terminal(stream: TextStream) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())


def _in_notebook() -> bool:
    """Whether tqdm.auto draws a notebook widget here (a Jupyter kernel with ipywidgets)."""
    return auto_tqdm.__module__ == "tqdm.notebook"
