"""FP8 arithmetic, the FP8 weight and the FP8 KV pool, each against a float64 reference: rounding to
e4m3 with its scales, the two products (weight-only and FP8 x FP8) and their split-K partials, block
scales, and a pool's writes and reads inside attention."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from switchyard import kernels
from switchyard.kernels import attention, kv_cache, native
from switchyard.kernels.fp8 import FP8_MAX, quantize_rows, quantize_rows_np
from switchyard.kernels.selection import Capability
from switchyard.kernels.weights import DenseWeight, Fp8Weight, quantize_weight, with_w8a8_min_rows

E4M3 = ml_dtypes.float8_e4m3fn
# e4m3 keeps 3 mantissa bits: a normal value rounds to within half a step, 2^-4 of its magnitude;
# below 2^-6 (subnormals) the step is 2^-9 of the scale.
REL_STEP = 2.0**-4
SUBNORMAL_STEP = 2.0**-9


def _dequant64(q, scale) -> np.ndarray:
    return np.asarray(q).astype(np.float64) * np.asarray(scale, np.float64)


@pytest.mark.parametrize("shape", [(7, 33), (1, 5), (3, 4, 129)])
def test_rows_round_to_e4m3_within_half_a_step_of_their_scale(rng, shape) -> None:
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-6, 6, (*shape[:-1], 1)))
    x[0, ..., 0] = 0.0
    if len(shape) == 2:
        x[-1] = 0.0  # a row of zeros: a finite scale, zeros back
    q, scale = quantize_rows(jnp.asarray(x, jnp.float32))
    assert q.dtype == jnp.float8_e4m3fn and scale.shape == (*shape[:-1], 1)
    amax = np.abs(x.astype(np.float32)).max(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(scale), np.maximum(amax / FP8_MAX, 1e-12), rtol=1e-6)
    # The largest magnitude of each row lands on e4m3's largest finite value.
    assert np.all(np.abs(np.asarray(q).astype(np.float64)).max(-1) <= FP8_MAX)
    back = _dequant64(q, scale)
    bound = np.maximum(REL_STEP * np.abs(x), SUBNORMAL_STEP * np.asarray(scale, np.float64)) * (1 + 1e-6)
    assert np.all(np.abs(back - x) <= bound + 1e-30)
    # The host version (checkpoints) rounds alike (XLA may divide by 448 a last bit differently).
    q_np, scale_np = quantize_rows_np(x.astype(np.float32))
    np.testing.assert_allclose(scale_np, np.asarray(scale), rtol=1e-6)
    assert np.all(np.abs(_dequant64(q_np, scale_np) - x) <= bound + 1e-30)


def _weight(rng, k: int, n: int, block_k: int = 0, w8a8_min_rows: int = 0) -> tuple[Fp8Weight, np.ndarray]:
    """An FP8 weight of a random [in k, out n] matrix with random positive scales, and its float64
    dense form [k, n]."""
    q = (rng.standard_normal((n, k)) * 100).clip(-FP8_MAX, FP8_MAX).astype(E4M3)
    groups = 1 if not block_k else -(-k // block_k)
    scale = rng.uniform(1e-4, 1e-3, (n, groups)).astype(np.float32)
    full = np.repeat(scale, block_k, axis=1)[:, :k] if block_k else scale
    dense = (q.astype(np.float64) * full.astype(np.float64)).T
    return Fp8Weight(jnp.asarray(q), jnp.asarray(scale), block_k, w8a8_min_rows), dense


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_device_and_the_host_round_alike(rng, dtype) -> None:
    """``quantize_rows`` (JAX) and ``quantize_rows_np`` (the checkpoints' and the references' rounding)
    give the same scales and e4m3 values, bf16 inputs (whose ratios often fall on ties) included."""
    x = jnp.asarray(rng.standard_normal((256, 1024)) * np.exp(rng.uniform(-4, 4, (256, 1))), dtype)
    q, scale = jax.jit(quantize_rows)(x)
    hq, hscale = quantize_rows_np(np.asarray(x, np.float32))
    np.testing.assert_array_equal(np.asarray(scale), hscale)
    np.testing.assert_array_equal(np.asarray(q, np.float32), hq.astype(np.float32))


@pytest.mark.parametrize("block_k", [0, 32])
def test_weight_only_products_are_the_dequantized_matrix_product(rng, block_k) -> None:
    k, n = 100, 24  # K not a multiple of the block: the last block is partial
    w, dense = _weight(rng, k, n, block_k)
    x = rng.standard_normal((5, k)).astype(np.float32)
    assert w.shape == (k, n) and not w.runs_w8a8(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(w.dequantized(jnp.float32), np.float64).T, dense, rtol=1e-6)
    expected = x.astype(np.float64) @ dense
    got = np.asarray(jnp.asarray(x) @ w, np.float64)
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
    # The split-K partials sum to the product (K = 100 in 4 slices of 25).
    partials = np.asarray(w.split_product(jnp.asarray(x), 4), np.float64)
    assert partials.shape == (4, 5, n)
    assert np.abs(partials.sum(0) - expected).max() <= 1e-5 * np.abs(expected).max()
    with pytest.raises(ValueError, match="cannot split K = 100 into 3"):
        w.split_product(jnp.asarray(x), 3)


def test_fp8_x_fp8_products_quantize_each_token_and_keep_close_to_the_exact_product(rng) -> None:
    k, n = 96, 40
    w, dense = _weight(rng, k, n, w8a8_min_rows=8)
    x = rng.standard_normal((2, 8, k)).astype(np.float32) * np.array([[[1.0]], [[50.0]]], np.float32)
    xj = jnp.asarray(x)
    assert w.runs_w8a8(xj) and not w.runs_w8a8(xj[:, :3]) and not with_w8a8_min_rows(w, 0).runs_w8a8(xj)
    # Exactly the product of the per-token-quantized activation and the weight (float64 reference).
    xq, xs = quantize_rows_np(x)
    expected = (xq.astype(np.float64) * xs) @ dense
    got = np.asarray(xj @ w, np.float64)
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()
    partials = np.asarray(w.split_product(xj, 2), np.float64)
    assert np.abs(partials.sum(0) - expected).max() <= 1e-5 * np.abs(expected).max()
    # Against the unquantized activation: cosine similarity per token, as the serving bar demands.
    exact = x.astype(np.float64) @ dense
    cos = (got * exact).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(exact, axis=-1)
    assert cos.min() >= 0.999, cos.min()
    # Block-scaled weights never run FP8 x FP8 (the scales would be inside the GEMM's K loop).
    blocked, _ = _weight(rng, k, n, block_k=32, w8a8_min_rows=1)
    assert not blocked.runs_w8a8(xj)


def test_quantize_on_load_keeps_a_scale_per_output_channel(rng) -> None:
    w = rng.standard_normal((64, 12)).astype(np.float32) * rng.uniform(0.01, 10, (1, 12)).astype(np.float32)
    fp8 = quantize_weight(jnp.asarray(w))
    assert fp8.w.shape == (12, 64) and fp8.scale.shape == (12, 1) and fp8.shape == (64, 12)
    back = np.asarray(fp8.dequantized(jnp.float32), np.float64).T
    assert np.all(np.abs(back - w) <= REL_STEP * np.abs(w) + SUBNORMAL_STEP * np.asarray(fp8.scale).T + 1e-12)


def test_the_products_policy_is_static_and_shared_by_every_fp8_weight_of_a_tree(rng) -> None:
    w, _ = _weight(rng, 16, 8)
    tree = {"a": w, "b": DenseWeight(jnp.zeros((4, 4))), "c": [w]}
    out = with_w8a8_min_rows(tree, 64)
    assert out["a"].w8a8_min_rows == out["c"][0].w8a8_min_rows == 64 and out["a"].w is w.w
    assert out["b"].w is tree["b"].w
    # The policy is in the tree's structure (static), its arrays are the leaves.
    assert jax.tree.leaves(out["a"]) == [w.w, w.scale]
    assert jax.tree.structure(out) != jax.tree.structure(tree)


@pytest.mark.parametrize("weights", ["channel", "block"])
def test_the_fused_row_parallel_call_takes_fp8_weights(rng, weights, monkeypatch) -> None:
    """Over two devices: the row-parallel product + all-reduce + residual + RMSNorm of an FP8 weight
    (its K sharded with its block scales) is that of its dequantized matrix on CPU, and lowered for
    CUDA it hands float32 partial products to the fused kernel as a dense weight does."""
    k, n = 128, 64
    block_k = 32 if weights == "block" else 0
    w, dense = _weight(rng, k, n, block_k)
    mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("tp",))
    a = rng.standard_normal((3, k)).astype(np.float32)
    r = rng.standard_normal((3, n)).astype(np.float32)
    g = (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    w_spec = Fp8Weight(P(None, "tp"), P(None, "tp") if block_k else P(), block_k)

    def body(a, w, r, g):
        return kernels.row_parallel_residual_rmsnorm(a, w, r, g, 1e-5, "tp", "xla")

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "tp"), w_spec, P(), P()), out_specs=P(),
                               check_vma=False))
    res, h = fn(jnp.asarray(a), w, jnp.asarray(r), jnp.asarray(g))
    exact = r + a.astype(np.float64) @ dense
    np.testing.assert_allclose(np.asarray(res), exact, rtol=1e-5, atol=1e-5 * np.abs(exact).max())
    normed = exact / np.sqrt((exact**2).mean(-1, keepdims=True) + 1e-5) * g
    np.testing.assert_allclose(np.asarray(h), normed, rtol=1e-4, atol=1e-4)

    cap = Capability(True, world=2, oneshot_bytes=1 << 20, twoshot_bytes=1 << 24, reason="test")
    monkeypatch.setattr(native, "capability", lambda: cap)

    def fused(a, w, r, g):
        return kernels.row_parallel_residual_rmsnorm(a, w, r, g, 1e-5, "tp", "oneshot")

    fn = jax.jit(jax.shard_map(fused, mesh=mesh, in_specs=(P(None, "tp"), w_spec, P(), P()), out_specs=P(),
                               check_vma=False))
    text = fn.trace(
        jax.ShapeDtypeStruct((2, k), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "tp"))),
        jax.tree.map(lambda arr, spec: jax.ShapeDtypeStruct(arr.shape, arr.dtype, sharding=NamedSharding(mesh, spec)),
                     w, w_spec),
        *(jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=NamedSharding(mesh, P())) for s in ((2, n), (n,))),
    ).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @switchyard_fused_rmsnorm" in text
    # The weight enters the program in FP8 and is converted there (never held dequantized).
    assert re.search(r"convert .*f8E4M3FN>\) -> tensor<[0-9x]*(bf16|f32)>", text)


# ---- the KV pool ---------------------------------------------------------------------------------
def test_an_fp8_pool_stores_each_position_with_a_scale_of_its_own(rng) -> None:
    shape = (5, 2, 4, 16)  # blocks, KV heads, positions per block, head_dim
    pool = kv_cache.zeros(shape, "fp8", jnp.bfloat16)
    assert isinstance(pool, kv_cache.Fp8Pool) and pool.scale.shape == shape[:-1] and pool.shape == shape
    rows = rng.standard_normal((3, 2, 16)) * np.array([1e-3, 1.0, 300.0])[:, None, None]
    block, offset = jnp.array([1, 4, 7]), jnp.array([0, 3, 2])  # block 7 is outside: dropped
    pool = kv_cache.write(pool, (block, slice(None), offset), jnp.asarray(rows, jnp.float32))
    back = np.asarray(kv_cache.read(pool, (block[:2], slice(None), offset[:2])), np.float64)
    scale = np.abs(rows[:2]).max(-1, keepdims=True) / FP8_MAX
    assert np.all(np.abs(back - rows[:2]) <= REL_STEP * np.abs(rows[:2]) + SUBNORMAL_STEP * scale + 1e-30)
    # What a write will store is what a chunk's own queries are shown.
    stored = np.asarray(kv_cache.stored(pool, jnp.asarray(rows[:2], jnp.float32)), np.float64)
    np.testing.assert_array_equal(stored, back)
    # Untouched positions stay zero (the dropped write went nowhere).
    untouched = np.ones(shape[:-1], bool)
    untouched[1, :, 0] = untouched[4, :, 3] = False
    assert not np.asarray(pool.data).astype(np.float32)[untouched].any()
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv_cache.zeros(shape, "int8", jnp.bfloat16)


def test_paged_decode_attention_over_an_fp8_pool_is_attention_over_its_dequantized_values(rng) -> None:
    """The reference path reads an FP8 pool dequantized: the same output as a dense pool holding
    exactly those values, and the new K/V written with their scales."""
    blocks, kv, bs, d, heads, n = 6, 2, 4, 16, 4, 2
    dense = jnp.asarray(rng.standard_normal((blocks, kv, bs, d)), jnp.float32)
    pool_k = kv_cache.write(kv_cache.zeros(dense.shape, "fp8", jnp.float32), (slice(None),), dense)
    pool_v = kv_cache.write(kv_cache.zeros(dense.shape, "fp8", jnp.float32), (slice(None),), 2 * dense)
    qkv = jnp.asarray(rng.standard_normal((n, heads + 2 * kv, d)), jnp.float32)
    tables = jnp.array([[1, 2, 3], [4, 5, 0]], jnp.int32)
    positions = jnp.array([9, 5], jnp.int32)
    out, k_after, v_after = attention.paged_decode_attention_packed(qkv, pool_k, pool_v, tables, positions, positions)
    assert isinstance(k_after, kv_cache.Fp8Pool)
    # The dense pools the FP8 ones stand for, the new rows as FP8 stores them.
    as_dense = [kv_cache.read(p, (slice(None),)) for p in (k_after, v_after)]
    new = [kv_cache.stored(k_after, qkv[:, heads + i * kv: heads + (i + 1) * kv]) for i in range(2)]
    stored_qkv = jnp.concatenate([qkv[:, :heads], *new], axis=1)
    ref, _, _ = attention.reference_paged_decode_attention_packed(stored_qkv, *as_dense, tables, positions, positions)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-6, atol=1e-6)
    new_k = np.asarray(kv_cache.read(k_after, (jnp.array([3, 5]), slice(None), jnp.array([1, 1]))))
    np.testing.assert_array_equal(new_k, np.asarray(kv_cache.stored(k_after, qkv[:, heads: heads + kv])))
