"""Progress output in a log: whole lines, no carriage return, no blank line; a terminal keeps
tqdm's bar."""

from __future__ import annotations

import io

import pytest
from tqdm import tqdm as terminal_tqdm

from dcp_lens.utils import progress as progress_module
from dcp_lens.utils.progress import LogProgress, progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_whole_lines_and_no_blank_ones() -> None:
    log = io.StringIO()
    items = list(progress(range(5), desc="DCP sweep", leave=False, stream=log))
    again = list(progress([1, 2], desc="DCP fit", leave=False, stream=log))
    assert items == [0, 1, 2, 3, 4] and again == [1, 2]
    text = log.getvalue()
    assert "\r" not in text
    lines = text.split("\n")
    assert lines[-1] == "" and all(line.strip() for line in lines[:-1]), lines
    assert lines[0].startswith("DCP sweep: 5/5 done (") and lines[1].startswith("DCP fit: 2/2 done")


def test_a_long_run_writes_a_line_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(float(t) for t in range(0, 1000, 10))  # 10 s per call of the clock
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: next(clock))
    log = io.StringIO()
    bar = progress(total=12, desc="train", stream=log)
    for _ in range(12):
        bar.update(1)
        bar.set_postfix(loss="0.5")
    bar.close()
    bar.close()  # a second close writes nothing
    lines = log.getvalue().splitlines()
    # One line per LOG_INTERVAL (30 s) of a 120 s run, then the last.
    assert 3 <= len(lines) - 1 <= 120 / progress_module.LOG_INTERVAL, lines
    assert lines[-1].startswith("train: 12/12 done") and lines[-1].endswith("loss=0.5)")


def test_disabled_writes_nothing_and_a_terminal_keeps_tqdm() -> None:
    log = io.StringIO()
    assert list(progress(range(3), desc="x", enabled=False, stream=log)) == [0, 1, 2]
    assert log.getvalue() == ""
    bar = progress(range(3), desc="x", stream=_Terminal(), leave=False)
    assert isinstance(bar, terminal_tqdm)
    bar.close()
    with pytest.raises(TypeError, match="update"):
        list(LogProgress(desc="no iterable", stream=log))
