"""Progress of a long byte count (writing or loading a checkpoint) where a person waits for it.

On a terminal, a tqdm bar. Anywhere else (a log file, a pod's log, a pipe), a bar's carriage returns
become hundreds of lines; there, one line every few seconds with the bytes done, the total and the rate,
and one at the end. A process that configured logging (``switchyard serve``) gets those lines in its
log, through the ``switchyard.progress`` logger; one that did not (``make-checkpoint``) on stderr.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol, TextIO

INTERVAL_S = 5.0


class Progress(Protocol):
    def update(self, n: int = 1) -> None: ...

    def close(self) -> None: ...


class NoProgress:
    """What a progress display does when there is none to show."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def format_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


class ProgressLines:
    """``desc: 2.1 GB of 16.1 GB (13%), 410.2 MB/s`` every ``interval`` seconds, and a last line with
    the total time; ``write`` takes each line."""

    def __init__(self, total: int, desc: str, write: Callable[[str], None], interval: float = INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.desc, self.write, self.interval, self.clock = total, desc, write, interval, clock
        self.done = 0
        self.started = self.last = clock()
        self.closed = False

    def update(self, n: int = 1) -> None:
        self.done += n
        now = self.clock()
        if now - self.last >= self.interval and self.done < self.total:
            self.last = now
            self.write(f"{self.desc}: {self._figures(now)}")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        now = self.clock()
        self.write(f"{self.desc}: done, {self._figures(now)} in {now - self.started:.1f} s")

    def _figures(self, now: float) -> str:
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        rate = self.done / max(now - self.started, 1e-9)
        return f"{format_bytes(self.done)} of {format_bytes(self.total)}{share}, {format_bytes(rate)}/s"


def progress_bytes(total: int, desc: str, stream: TextIO | None = None) -> Progress:
    """A bar on a terminal that no logging writes to; else lines (see the module's docstring)."""
    stream = stream if stream is not None else sys.stderr
    logs = logging.getLogger().hasHandlers()
    if not logs and _is_terminal(stream):
        return _bar(total, desc, stream)
    if logs:
        log = logging.getLogger("switchyard.progress")
        return ProgressLines(total, desc, log.info)

    def write(line: str) -> None:
        print(line, file=stream, flush=True)

    return ProgressLines(total, desc, write)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or unusual stream
        return False


def _bar(total: int, desc: str, stream: TextIO) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, file=stream)
