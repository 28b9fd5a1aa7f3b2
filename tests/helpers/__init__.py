"""Shared test helpers: fixtures, reference models, harnesses and the scripts tests run in subprocesses."""

import os
from pathlib import Path

HELPERS = Path(__file__).resolve().parent
ROOT = HELPERS.parents[1]  # the repository

# How the tests compile XLA's CPU programs, in their own process (tests/conftest.py) and in the JAX
# processes they start: the older LLVM fusion emitters compile a tiny engine's step programs about a
# fifth faster than the MLIR ones, for the same results.
CPU_COMPILE_FLAGS = "--xla_cpu_use_fusion_emitters=false"


def cpu_xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test's JAX subprocess on ``devices`` host CPU devices (with the compile flags
    where the test process took them: not on a GPU host)."""
    compile_flags = CPU_COMPILE_FLAGS if CPU_COMPILE_FLAGS in os.environ.get("XLA_FLAGS", "") else ""
    return f"--xla_force_host_platform_device_count={devices} {compile_flags}".strip()
