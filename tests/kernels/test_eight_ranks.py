"""Eight tensor-parallel ranks on eight simulated CPU devices, in a separate process (the test
session's JAX already has four)."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import HELPERS, cpu_xla_flags


def test_collectives_and_engine_at_eight_ranks():
    env = dict(os.environ, XLA_FLAGS=cpu_xla_flags(8), JAX_PLATFORMS="cpu")
    script = HELPERS / "eight_ranks_check.py"
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "eight ranks: ok" in done.stdout
