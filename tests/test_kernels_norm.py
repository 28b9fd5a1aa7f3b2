"""Residual add + RMSNorm for one GPU (switchyard.kernels.residual_rmsnorm): the reference against
float64 and the CUDA lowering on CPU, and the kernel against float64 on fresh random inputs of
awkward sizes with poisoned outputs (marked ``gpu``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from switchyard.kernels import native, norm

TOL = {"float32": 2e-6, "bfloat16": 1e-2, "float16": 2e-3}


def float64_reference(x, residual, weight, eps):
    nr = np.asarray(residual, np.float64) + np.asarray(x, np.float64)
    normed = nr / np.sqrt(np.mean(nr * nr, axis=-1, keepdims=True) + eps)
    return nr, np.asarray(weight, np.float64) * normed


def random_inputs(rng, rows, hidden, dtype):
    x = jnp.asarray(rng.standard_normal((rows, hidden)), dtype)
    residual = jnp.asarray(3 * rng.standard_normal((rows, hidden)), dtype)
    weight = jnp.asarray(rng.uniform(0.5, 1.5, hidden), dtype)
    return x, residual, weight


def rel(got, want):
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


def test_reference_matches_float64():
    rng = np.random.default_rng(0)
    x, residual, weight = random_inputs(rng, 3, 40, jnp.float32)
    nr, normed = jax.jit(lambda *a: norm.residual_rmsnorm(*a, 1e-5))(x, residual, weight)
    want_nr, want_normed = float64_reference(x, residual, weight, 1e-5)
    assert rel(nr, want_nr) < 1e-6 and rel(normed, want_normed) < 1e-6


def test_cuda_lowering_is_one_custom_call_where_the_kernel_applies(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(native, "local_kernels_ready", lambda: True)
    specs = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((2, 64), (2, 64), (64,))]

    def lowered(fn, *args):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    text = lowered(lambda *a: norm.residual_rmsnorm(*a, 1e-5), *specs)
    assert text.count("custom_call @switchyard_residual_rmsnorm") == 1 and "eps = 9.99999974E-6" in text
    assert "switchyard" not in lowered(lambda *a: norm.residual_rmsnorm(*a, 1e-5, use_kernel=False), *specs)
    mixed = [specs[0], jax.ShapeDtypeStruct((2, 64), jnp.float32), specs[2]]  # residual in another dtype
    assert "switchyard" not in lowered(lambda *a: norm.residual_rmsnorm(*a, 1e-5), *mixed)
    int8 = [jax.ShapeDtypeStruct(s, jnp.int8) for s in ((2, 64), (2, 64), (64,))]
    assert not norm.kernel_supports(*int8)
    cpu = jax.jit(lambda *a: norm.residual_rmsnorm(*a, 1e-5)).trace(*specs).lower().as_text()
    assert "switchyard" not in cpu  # CPU lowering takes the reference branch


# ---- GPU ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize(("rows", "hidden"), [(1, 4096), (2, 4096), (5, 1000), (3, 4097), (64, 8192), (2, 8),
                                              (1100, 520)])
def test_kernel_matches_float64_with_poisoned_outputs(rows, hidden, dtype):
    assert native.local_kernels_ready(), native.status()
    rng = np.random.default_rng()
    x, residual, weight = random_inputs(rng, rows, hidden, dtype)
    fn = jax.jit(lambda *a: norm.residual_rmsnorm(*a, 1e-5))
    assert "switchyard_residual_rmsnorm" in fn.lower(x, residual, weight).as_text()
    fn(x, residual, weight)  # compiled; then NaN in the blocks the outputs will reuse
    poison = [jnp.full((rows, hidden), jnp.nan, dtype) for _ in range(4)]
    jax.block_until_ready(poison)
    del poison
    nr, normed = (np.asarray(a.astype(jnp.float32), np.float64) for a in fn(x, residual, weight))
    assert np.isfinite(nr).all() and np.isfinite(normed).all(), "unwritten output elements"
    want_nr, want_normed = float64_reference(x.astype(jnp.float32), residual.astype(jnp.float32),
                                             weight.astype(jnp.float32), 1e-5)
    assert rel(nr, want_nr) < TOL[dtype] and rel(normed, want_normed) < 2 * TOL[dtype]
    # Each element, not only the norm of the error: a stale element would show here.
    np.testing.assert_allclose(normed, want_normed, rtol=8 * TOL[dtype], atol=8 * TOL[dtype])
    same = jax.jit(lambda *a: norm.residual_rmsnorm(*a, 1e-5, use_kernel=False))(x, residual, weight)
    assert np.array_equal(nr, np.asarray(same[0].astype(jnp.float32), np.float64)), "residual add differs from XLA"
