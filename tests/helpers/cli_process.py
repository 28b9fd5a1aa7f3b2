"""``switchyard`` as a user runs it: a subprocess with none of the test session's SWITCHYARD_* settings
and one CPU device, and the check that a mistake is one line and exit 2."""

from __future__ import annotations

import os
import subprocess
import sys


def switchyard(*argv: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
    environment["XLA_FLAGS"] = ""  # one CPU device, not the test session's four
    environment.update(env or {})
    return subprocess.run([sys.executable, "-m", "switchyard.cli.main", *argv], capture_output=True, text=True,
                          timeout=timeout, env=environment)


def assert_one_line(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stderr[-3000:])
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    for word in words:
        assert word in lines[0], lines[0]
