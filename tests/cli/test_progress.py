"""Progress where a person waits: a bar on a terminal; in a log (a file, a pipe, serve's log) a line
every few seconds with bytes done, the total and the rate, never carriage returns."""

from __future__ import annotations

import fcntl
import logging
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from switchyard.service.progress import ProgressLines, format_bytes, progress_bytes

pytestmark = pytest.mark.timeout(300)
LINE = re.compile(r"^writing (\S+): done, ([\d.]+ [kMG]?B) of \2 \(100%\), [\d.]+ [kMG]?B/s in [\d.]+ s$")


def environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
    env.update(XLA_FLAGS="", JAX_PLATFORMS="cpu", PYTHONSAFEPATH="1")
    return env


def test_lines_come_every_interval_with_bytes_total_and_rate() -> None:
    now = [0.0]
    lines: list[str] = []
    progress = ProgressLines(10_000_000_000, "writing m", lines.append, interval=5.0, clock=lambda: now[0])
    for _ in range(100):  # 100 MB every 0.5 s: 50 s, 10 intervals
        now[0] += 0.5
        progress.update(100_000_000)
    progress.close()
    progress.close()  # once
    assert len(lines) == 10, lines
    assert lines[0] == "writing m: 1.0 GB of 10.0 GB (10%), 200.0 MB/s", lines[0]
    assert lines[-1] == "writing m: done, 10.0 GB of 10.0 GB (100%), 200.0 MB/s in 50.0 s", lines[-1]


def test_byte_counts_read_as_people_write_them() -> None:
    assert [format_bytes(n) for n in (0, 999, 3_500_000, 16_060_522_496, 811_700_000_000)] == [
        "0 B", "999 B", "3.5 MB", "16.1 GB", "811.7 GB"]


def test_a_process_that_logs_gets_the_lines_in_its_log(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="switchyard.progress"):
        progress = progress_bytes(999, "loading m")
        progress.update(999)
        progress.close()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "switchyard.progress"]
    assert re.fullmatch(r"loading m: done, 999 B of 999 B \(100%\), [\d.]+ [kMG]?B/s in [\d.]+ s", line), line


def test_make_checkpoint_into_a_log_writes_lines_not_a_bar(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "switchyard.cli.main", "make-checkpoint", "--preset", "tiny",
                           "--out", str(tmp_path / "tiny")], capture_output=True, text=True, timeout=120,
                          env=environment())
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr, repr(done.stderr)
    assert LINE.match(done.stderr.strip()), done.stderr


def test_make_checkpoint_on_a_terminal_draws_a_bar(tmp_path: Path) -> None:
    main, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # a terminal's size
    try:
        proc = subprocess.Popen([sys.executable, "-m", "switchyard.cli.main", "make-checkpoint", "--preset", "tiny",
                                 "--out", str(tmp_path / "tiny")], stdout=subprocess.DEVNULL, stderr=secondary,
                                env=environment())
        os.close(secondary)
        seen = b""
        while True:
            try:
                chunk = os.read(main, 4096)
            except OSError:  # the terminal closed with the process
                break
            if not chunk:
                break
            seen += chunk
        assert proc.wait(120) == 0, seen.decode(errors="replace")
    finally:
        os.close(main)
    text = seen.decode(errors="replace")
    assert "\r" in text and "writing tiny:" in text and "100%" in text, text
    assert not LINE.search(text.replace("\r", "\n")), text


def test_loading_a_checkpoint_logs_its_bytes(tiny_checkpoint_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    from switchyard.service.engine.checkpoint import load_params
    from switchyard.service.engine.engine import make_mesh
    from switchyard.service.modelspec import ModelSpec

    spec = ModelSpec.from_file(tiny_checkpoint_dir)
    with caplog.at_level(logging.INFO, logger="switchyard.progress"):
        params = load_params(tiny_checkpoint_dir, spec, make_mesh(1), spec.dtype, progress=True)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "switchyard.progress"]
    import jax

    loaded = sum(a.nbytes for a in jax.tree_util.tree_leaves(params))
    assert line.startswith(f"loading {tiny_checkpoint_dir.name}: done, {format_bytes(loaded)} of "
                           f"{format_bytes(loaded)} (100%)"), line
