"""The all-reduce kernels with 2, 4 and 8 ranks emulated on one GPU (``tests/helpers/emulated_ranks.cu``).

Each rank has its own workspace, stream and peer table, and every call launches the FFI handlers'
grids on every rank's stream, so the exchange protocol (flag-free slots, launch counters, two-shot
barriers, bounded wait) runs as on a node, with local stores in place of NVLink. This is how the
kernels' 4- and 8-rank paths and every protocol change get a GPU run where only one GPU is lent.
The harness compiles wherever nvcc is (CI); the rest is marked ``gpu``.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
from helpers.emulated_ranks import DTYPES, EPS, Emulation, build_harness, load, rel, same_bits
from switchyard.kernels import build

# Relative error against float64, as tests/kernels/test_kernels_gpu.py: the final rounding of each result.
TOL = {"float32": 1e-6, "bfloat16": 8e-3, "float16": 1e-3}
needs_nvcc = pytest.mark.skipif(build.find_nvcc() is None, reason="nvcc not on PATH")


def f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, np.float64)


def rounded(a: np.ndarray, dtype: str) -> np.ndarray:
    return a.astype(DTYPES[dtype][1])


@needs_nvcc
def test_harness_compiles(tmp_path: Path) -> None:
    """CI has nvcc but no GPU: the harness and the kernels' host-side launch code compile."""
    lib = load(build_harness(tmp_path / "emulated_ranks.so"))
    for symbol in ("emu_init", "emu_run", "emu_reset", "emu_calls", "emu_error", "emu_shutdown"):
        assert hasattr(lib, symbol)


# ---- on a GPU -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    if build.find_nvcc() is None:
        pytest.skip("nvcc not on PATH")
    return load(build_harness(tmp_path_factory.mktemp("emu") / "emulated_ranks.so"))


@pytest.fixture(params=[2, 4, 8], ids=lambda w: f"world{w}")
def emu(request: pytest.FixtureRequest, lib: ctypes.CDLL):
    e = Emulation(lib, request.param)
    try:
        yield e
        assert e.error() == 0, "a bounded wait gave up"
    finally:
        e.close()


def _sizes(world: int) -> tuple[int, ...]:
    # 1 MB + 3 elements needs 64 one-shot blocks a rank: resident together only for 2 ranks.
    return (1, 7, 4097, (1 << 20) + 3) if world == 2 else (1, 7, 4097, 65536 + 3)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["oneshot", "twoshot"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_all_reduce_matches_float64(emu: Emulation, kernel: str, dtype: str, rng) -> None:
    for n in _sizes(emu.world):
        for vec in (True, False):
            x = rounded(rng.standard_normal((emu.world, n)), dtype)
            out, _, _ = emu.run(kernel, x, dtype, vec=vec)
            assert not np.isnan(f64(out)).any(), f"unwritten elements, n={n}"
            ref = f64(x).sum(axis=0)
            for r in range(emu.world):
                assert rel(f64(out[r]), ref) < TOL[dtype], (n, r, vec)
            assert same_bits(out), f"ranks differ, n={n}"
    assert emu.calls(0) >= 0, "launch counters differ between block indices"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("rows", "hidden", "splits"), [(1, 4096, 0), (5, 1000, 0), (3, 4097, 0), (16, 8192, 0),
                                                       (2, 8, 0), (2, 4096, 4), (3, 1000, 3)])
def test_fused_matches_float64(emu: Emulation, dtype: str, rows: int, hidden: int, splits: int, rng) -> None:
    n = rows * hidden
    res = rounded(rng.standard_normal(n), dtype)
    w = rounded(rng.uniform(0.5, 1.5, hidden), dtype)
    if splits:
        x = rng.standard_normal((emu.world, splits, n)).astype(np.float32)
        contrib = f64(rounded(x.sum(axis=1, dtype=np.float32), dtype))  # float32 sum of slices, rounded
        kernel = "fused_partials"
    else:
        x = rounded(rng.standard_normal((emu.world, n)), dtype)
        contrib = f64(x)
        kernel = "fused"
    vec = hidden % (4 if dtype == "float32" else 8) == 0  # the handler's rule
    nr, normed, _ = emu.run(kernel, x, dtype, residual=res, weight=w, vec=vec)
    ref_nr = (f64(res) + contrib.sum(axis=0)).reshape(rows, hidden)
    ref_normed = f64(w) * ref_nr / np.sqrt(np.mean(ref_nr**2, axis=-1, keepdims=True) + EPS)
    assert not np.isnan(f64(nr)).any() and not np.isnan(f64(normed)).any(), "unwritten elements"
    for r in range(emu.world):
        assert rel(f64(nr[r]), ref_nr.ravel()) < 2 * TOL[dtype], r
        assert rel(f64(normed[r]), ref_normed.ravel()) < 4 * TOL[dtype], r
    assert same_bits(nr) and same_bits(normed), "ranks differ"


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["oneshot", "twoshot", "fused"])
def test_100k_calls_across_epoch_wrap(emu: Emulation, kernel: str, rng) -> None:
    """100 000 back-to-back calls (several blocks each) from 50 000 below 2^32, so the counters wrap:
    the last call's result must be exact (integer-valued float32) and every rank's launch counters
    must all read start + 100 000 (mod 2^32)."""
    calls, start = 100_000, 2**32 - 50_000
    emu.reset(start)
    rows, hidden = 3, 4096  # 3 blocks for fused, 6 for one-shot, 3 for two-shot at 2 ranks
    x = rng.integers(-8, 8, (emu.world, rows * hidden)).astype(np.float32)
    if kernel == "fused":
        zero, ones = np.zeros(rows * hidden, np.float32), np.ones(hidden, np.float32)
        out, _, _ = emu.run(kernel, x, "float32", residual=zero, weight=ones, calls=calls)
    else:
        out, _, _ = emu.run(kernel, x, "float32", calls=calls)
    assert emu.error() == 0
    for r in range(emu.world):
        np.testing.assert_array_equal(out[r], x.sum(axis=0))
        assert emu.calls(r) == (start + calls) % 2**32, r
    emu.reset(0)


@pytest.mark.gpu
def test_every_rank_chain_replayed_from_one_graph(emu: Emulation, rng) -> None:
    """The benchmark's timing mode: each rank's chain of calls a branch of one CUDA graph. Results
    as direct launches give them, and every replayed launch counted on every rank."""
    rows, hidden, calls, reps = 2, 4096, 50, 3
    x = rounded(rng.standard_normal((emu.world, rows * hidden)), "bfloat16")
    res = rounded(rng.standard_normal(rows * hidden), "bfloat16")
    w = rounded(rng.uniform(0.5, 1.5, hidden), "bfloat16")
    emu.reset(0)
    nr, normed, us = emu.run("fused", x, "bfloat16", residual=res, weight=w, calls=calls, graph_reps=reps)
    nr1, normed1, _ = emu.run("fused", x, "bfloat16", residual=res, weight=w)
    assert us > 0
    assert same_bits(np.concatenate([nr, nr1])) and same_bits(np.concatenate([normed, normed1]))
    for r in range(emu.world):
        assert emu.calls(r) == (1 + reps) * calls + 1, r


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["oneshot", "twoshot", "fused"])
def test_a_rank_that_never_comes_ends_in_the_bounded_wait(lib: ctypes.CDLL, kernel: str) -> None:
    """Rank 1 never launches: the others give up after the timeout and raise the error word, and
    a reset makes the workspaces usable again."""
    emu = Emulation(lib, 2, timeout_s=0.05)
    try:
        x = np.ones((2, 4096), np.float32)
        kw = {"residual": np.zeros(4096, np.float32), "weight": np.ones(4096, np.float32)} if kernel == "fused" else {}
        emu.run(kernel, x, "float32", absent=1, **kw)
        assert emu.error() != 0
        emu.reset(0)
        assert emu.error() == 0
        out, _, _ = emu.run(kernel, x, "float32", **kw)
        assert emu.error() == 0
        np.testing.assert_array_equal(out[0], np.full(4096, 2.0, np.float32))
    finally:
        emu.close()
