"""benchmarks/emulated_allreduce.py's pure parts on CPU: the baseline build's source patch still
applies to the kernels as they are (and compiles, where nvcc is), and its float64 check."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from helpers import scripts
from helpers.emulated_ranks import build_harness
from switchyard.kernels import build


def test_baseline_counter_patch_applies_and_compiles(tmp_path):
    bench = scripts.load("emulated_allreduce")
    csrc = bench.baseline_counter_csrc(tmp_path / "csrc")
    common = (csrc / "common.cuh").read_text()
    assert bench.BASELINE_COUNTER in common
    assert "calls[blockIdx.x]" not in common and "atomicAdd(&P.self->pad[0]" in common
    if build.find_nvcc() is None:
        pytest.skip("nvcc not on PATH")
    assert build_harness(tmp_path / "baseline.so", csrc).is_file()


def test_check_measures_the_error_of_every_rank():
    bench = scripts.load("emulated_allreduce")
    rng = np.random.default_rng(0)
    x, extra = bench.inputs("fused", 2, 2 * 4096 * 2, rng)
    total = np.asarray(x, np.float64).sum(0)
    w = np.asarray(extra["weight"], np.float64)
    nr = np.asarray(extra["residual"], np.float64) + total
    rows = nr.reshape(-1, w.size)
    normed = (w * rows / np.sqrt(np.mean(rows**2, -1, keepdims=True) + 1e-5)).ravel()
    out = np.stack([nr, nr]).astype(ml_dtypes.bfloat16)
    good = np.stack([normed, normed]).astype(ml_dtypes.bfloat16)
    assert bench.check("fused", x, extra, out, good) < 8e-3
    bad = good.copy()
    bad[1, :10] = 0
    assert bench.check("fused", x, extra, out, bad) > 1e-2
    y, _ = bench.inputs("oneshot", 2, 64, rng)
    assert bench.check("oneshot", y, {}, np.stack([np.asarray(y, np.float64).sum(0)] * 2), None) == 0
