"""XLA's autotuner notices while a warm-up compiles step programs side by side.

XLA's GEMM autotuner times each candidate behind a "delay kernel" that holds the stream until every
timed launch is queued. When another compile thread meanwhile makes a call that waits for the GPU
(freeing its scratch memory, loading its executable), the two wait on each other until the delay
kernel gives up after about 100 ms, and XLA logs a warning, "Delay kernel timed out: measured time
has sub-optimal accuracy" (at most five a process). That candidate's time then includes its launch
overhead; nothing else is affected. No option of XLA's turns the notice off short of turning the
autotuner off, which made Llama-3-8B's decode step 2.8x slower at batch 1 and 7.6x at batch 32
(benchmarks/NOTES.md). So the warm-up passes the process's stderr through :class:`NoticeFilter`,
which drops those lines and counts them; every other line passes unchanged and in order, and the
warm-up reports the count in its one INFO line.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

NOTICE = b"Delay kernel timed out"
# How long leaving the filter waits for its last lines to be passed on. A process started inside it
# keeps the pipe open; its lines are still passed on after that, only the wait ends.
DRAIN_S = 2.0


class NoticeFilter:
    """Bytes of a log, fed as they come: every line that holds ``marker`` is dropped and counted, the
    others are returned whole (a line is held back until its newline, or :meth:`close`)."""

    def __init__(self, marker: bytes = NOTICE) -> None:
        self.marker = marker
        self.dropped = 0
        self._partial = b""

    def _keep(self, line: bytes) -> bool:
        if self.marker in line:
            self.dropped += 1
            return False
        return True

    def feed(self, data: bytes) -> bytes:
        *lines, self._partial = (self._partial + data).split(b"\n")
        return b"".join(line + b"\n" for line in lines if self._keep(line))

    def close(self) -> bytes:
        rest, self._partial = self._partial, b""
        return rest if rest and self._keep(rest) else b""


def _flush_stderr() -> None:
    if sys.stderr is not None:
        sys.stderr.flush()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


@contextlib.contextmanager
def autotuner_notices_counted(fd: int = 2) -> Iterator[NoticeFilter]:
    """Within the block, what is written to ``fd`` (the process's stderr: XLA's C++ log and Python's
    alike) goes through a :class:`NoticeFilter` to where ``fd`` pointed before; after it, ``fd`` points
    there again. Yields the filter (its ``dropped`` count is final once the block has ended)."""
    notices = NoticeFilter()
    _flush_stderr()
    try:
        restore = os.dup(fd)
    except OSError:  # no stderr to filter (closed): nothing to do
        yield notices
        return
    target = os.dup(fd)
    read_end, write_end = os.pipe()
    os.dup2(write_end, fd)
    os.close(write_end)

    def forward() -> None:
        try:
            while chunk := os.read(read_end, 1 << 16):
                _write_all(target, notices.feed(chunk))
            _write_all(target, notices.close())
        except OSError:
            pass  # where stderr went is gone: nothing left to tell
        finally:
            os.close(read_end)
            os.close(target)

    thread = threading.Thread(target=forward, name="xla-notice-filter", daemon=True)
    thread.start()
    try:
        yield notices
    finally:
        _flush_stderr()
        os.dup2(restore, fd)  # the pipe's last write end closes: the thread reads to its end
        os.close(restore)
        thread.join(DRAIN_S)
