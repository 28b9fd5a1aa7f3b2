"""Test set-up: four simulated CPU devices for tensor-parallel tests, and the ``gpu`` marker."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import zlib
from pathlib import Path

# Must be set before JAX initialises its backends.
os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=4"
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
# One XLA compilation cache for the run, in this process and every `serve` it starts: most tests build
# engines of a few shapes, and on CPU XLA's compile is most of an engine's warm-up (a tiny model's 12
# step programs: 58 s compiled, 11 s from this cache). Programs are found by their HLO, options and
# devices, as in production; the compile-cache tests name folders of their own.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _xla_cache = tempfile.mkdtemp(prefix="switchyard-tests-xla-")
    atexit.register(shutil.rmtree, _xla_cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _xla_cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Without an NVIDIA GPU every program is compiled for XLA's CPU backend, and compiling is most of an
# engine test's time: with XLA's optimizations off an HF-parity pair of cases takes 44 s instead of 53
# (the same results). GPU runs keep XLA's defaults, and the `serve` processes tests start keep its
# optimizations (tests/helpers/serve_process.py), whose steps some tests time. The CPU compile flags
# of tests/helpers apply here and, through XLA_FLAGS, in every process the tests start.
if not Path("/dev/nvidiactl").exists():
    from helpers import CPU_COMPILE_FLAGS

    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
    if CPU_COMPILE_FLAGS not in os.environ["XLA_FLAGS"]:
        os.environ["XLA_FLAGS"] += f" {CPU_COMPILE_FLAGS}"

import pytest


def _gpu_count() -> int:
    try:
        import jax

        return len(jax.devices("gpu"))
    except Exception:
        return 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    if _gpu_count() == 0:
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU visible to JAX; none found")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint_dir(tmp_path_factory: pytest.TempPathFactory):
    """A random-weight tiny Llama checkpoint written by ``switchyard make-checkpoint``'s code path."""
    from helpers.engine_fixtures import tiny_checkpoint

    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-checkpoint"))


@pytest.fixture()
def rng(request: pytest.FixtureRequest):
    """A NumPy generator seeded by the test's id (parameters included): fresh inputs for every test
    and case, the same ones on every run, so a failure reproduces."""
    import numpy as np

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))
