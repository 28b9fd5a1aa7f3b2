"""Decode attention (switchyard.kernels.attention): the reference semantics against float64 on CPU,
and the CUDA kernel against float64 on fresh random inputs with poisoned caches (marked ``gpu``)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from switchyard.kernels import attention


def reference_f64(q, k_new, v_new, k_cache, v_cache, positions, write_at):
    """Float64 numpy: write, then softmax over [0, pos] of each row."""
    q, k_new, v_new = (np.asarray(a, np.float64) for a in (q, k_new, v_new))
    kc, vc = np.array(k_cache, np.float64), np.array(v_cache, np.float64)
    n, heads, d = q.shape
    kv = k_new.shape[1]
    group = heads // kv
    for b in range(n):
        if 0 <= write_at[b] < kc.shape[2]:
            kc[b, :, write_at[b]] = k_new[b]
            vc[b, :, write_at[b]] = v_new[b]
    out = np.zeros_like(q)
    for b in range(n):
        for hq in range(heads):
            h = hq // group
            keys = kc[b, h, : positions[b] + 1]
            scores = keys @ q[b, hq] / math.sqrt(d)
            p = np.exp(scores - scores.max())
            out[b, hq] = (p / p.sum()) @ vc[b, h, : positions[b] + 1]
    return out, kc, vc


def random_case(rng, n, kv, group, d, slots, length, dtype):
    heads = kv * group
    cast = lambda a: np.array(jnp.asarray(a, dtype).astype(jnp.float32))  # noqa: E731 - exact dtype values
    q = cast(rng.standard_normal((n, heads, d)))
    k_new, v_new = cast(rng.standard_normal((n, kv, d))), cast(rng.standard_normal((n, kv, d)))
    k_cache = cast(rng.standard_normal((slots, kv, length, d)))
    v_cache = cast(rng.standard_normal((slots, kv, length, d)))
    positions = rng.integers(0, length, n).astype(np.int32)
    positions[0] = length - 1
    if n > 1:
        positions[1] = 0
    write_at = positions.copy()
    if n > 2:
        write_at[2] = length  # a row that must not write (stale work in a pipeline)
    if n > 3:
        write_at[3] = positions[3] // 2  # a write inside the attended range, not at its end
    return q, k_new, v_new, k_cache, v_cache, positions, write_at


def test_reference_matches_float64_and_drops_writes_outside_the_cache():
    rng = np.random.default_rng(0)
    case = random_case(rng, n=3, kv=2, group=4, d=16, slots=5, length=37, dtype=jnp.float32)
    got = jax.jit(attention.reference_decode_attention)(*(jnp.asarray(a) for a in case))
    want = reference_f64(*case)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=2e-5, atol=2e-5)
    k_cache = np.asarray(got[1])
    assert np.array_equal(k_cache[2], case[3][2]), "a row aimed past the cache must leave it unchanged"
    assert np.array_equal(k_cache[3:], case[3][3:]), "rows beyond the batch are never touched"


def test_packed_layout_is_q_then_k_then_v_heads():
    rng = np.random.default_rng(2)
    q, k_new, v_new, k_cache, v_cache, positions, write_at = (
        jnp.asarray(a) for a in random_case(rng, n=4, kv=2, group=3, d=8, slots=4, length=21, dtype=jnp.float32))
    qkv = jnp.concatenate([q, k_new, v_new], axis=1)
    got = jax.jit(attention.decode_attention_packed)(qkv, k_cache, v_cache, positions, write_at)
    want = attention.reference_decode_attention(q, k_new, v_new, k_cache, v_cache, positions, write_at)
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(np.asarray(g), np.asarray(w))


def test_without_gpu_kernel_the_reference_runs():
    rng = np.random.default_rng(1)
    case = [jnp.asarray(a) for a in random_case(rng, 2, 2, 2, 64, 2, 16, jnp.bfloat16)]
    case[:5] = [a.astype(jnp.bfloat16) for a in case[:5]]
    got = jax.jit(attention.decode_attention)(*case)
    want = jax.jit(attention.reference_decode_attention)(*case)
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))


def test_split_and_support_rules():
    assert attention.splits_for(1, 8, 1152) == 8  # few (row, head) pairs: split the sequence
    assert attention.splits_for(1, 8, 4096) == 16  # beyond the portable cluster: long slices only
    assert attention.splits_for(1, 8, 2560) == 10
    assert attention.splits_for(8, 8, 1152) == 4  # no more blocks than fit at once (264)
    assert attention.splits_for(32, 8, 1152) == 1
    assert attention.splits_for(64, 8, 1152) == 1  # enough blocks already
    assert attention.splits_for(2, 8, 64) == 1  # never slices shorter than MIN_SLICE positions
    assert attention.splits_for(1, 1, 131072) == attention.MAX_SPLITS
    # FP8 pools: twice the blocks at once, where the rows alone would leave half the room empty
    assert attention.splits_for(32, 8, 1152, fp8_pools=True) == 2
    assert attention.splits_for(8, 8, 1152, fp8_pools=True) == 8
    assert attention.splits_for(64, 8, 1152, fp8_pools=True) == 1
    assert attention.splits_for(1, 8, 1152, fp8_pools=True) == attention.splits_for(1, 8, 1152)
    assert attention.kernel_supports(jnp.bfloat16, 128, 4) and attention.kernel_supports(jnp.float16, 64, 8)
    assert not attention.kernel_supports(jnp.float32, 128, 4)
    assert not attention.kernel_supports(jnp.bfloat16, 96, 4) and not attention.kernel_supports(jnp.bfloat16, 128, 3)


# ---- GPU ----------------------------------------------------------------------------------------------
GPU_CASES = [  # n, kv, group, head_dim, slots, cache length
    (1, 8, 4, 128, 2, 1152),
    (3, 2, 8, 64, 5, 200),
    (7, 1, 1, 128, 9, 77),
    (64, 8, 4, 128, 64, 1152),
    (2, 4, 2, 64, 3, 4096),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "n{}-kv{}-g{}-d{}-s{}-L{}".format(*c))
def test_kernel_matches_float64_and_writes_only_its_positions(case, dtype, rng):
    from switchyard.kernels import native

    assert native.attention_ready(), native.status()
    n, kv, group, d, slots, length = case
    q, k_new, v_new, k_cache, v_cache, positions, write_at = random_case(rng, n, kv, group, d, slots, length, dtype)
    # Poison every cache position no row may read (beyond its position) and every row beyond the
    # batch: a read shows as NaN in the output, a stray write as a changed NaN pattern.
    for arr in (k_cache, v_cache):
        for b in range(n):
            arr[b, :, positions[b] + 1 :] = np.nan
        arr[n:] = np.nan
    want_out, want_k, want_v = reference_f64(q, k_new, v_new, np.nan_to_num(k_cache), np.nan_to_num(v_cache),
                                             positions, write_at)
    args = [jnp.asarray(a, dtype) for a in (q, k_new, v_new, k_cache, v_cache)] + [
        jnp.asarray(positions), jnp.asarray(write_at)]
    fn = jax.jit(attention.decode_attention, donate_argnums=(3, 4))
    out, kc, vc = fn(*args)
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert np.isfinite(out).all(), "the kernel read a position beyond a row's own"
    err = np.linalg.norm(out - want_out) / np.linalg.norm(want_out)
    assert err < (1e-2 if dtype == "bfloat16" else 2e-3), err
    for got, want, before in ((kc, want_k, k_cache), (vc, want_v, v_cache)):
        got = np.asarray(got.astype(jnp.float32), np.float64)
        written = np.zeros(got.shape, bool)
        for b in range(n):
            if 0 <= write_at[b] < length:
                written[b, :, write_at[b]] = True
        np.testing.assert_array_equal(got[written], want[written])
        np.testing.assert_array_equal(np.isnan(got), np.isnan(before) & ~written)
        np.testing.assert_array_equal(got[~written & ~np.isnan(before)], before[~written & ~np.isnan(before)])
