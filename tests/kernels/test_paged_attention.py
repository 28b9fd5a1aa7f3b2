"""Paged decode attention (switchyard.kernels.attention.paged_decode_attention_packed): the reference
against float64 on CPU, and the CUDA kernel against float64 on fresh random inputs with poisoned
pools (marked ``gpu``). Block tables are shuffled, contexts are not multiples of the block size, and
some rows write nowhere, past their table, or through a table entry outside the pool."""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from switchyard.kernels import attention, kv_cache
from switchyard.kernels.fp8 import NP_FP8, quantize_rows_np


@dataclass
class PagedCase:
    qkv: np.ndarray  # [n, H + 2 kv, D], float32 holding exact `dtype` values
    k_pool: np.ndarray  # [num_blocks, kv, B, D]; NaN wherever no row may read
    v_pool: np.ndarray
    tables: np.ndarray  # int32 [n, M]
    positions: np.ndarray  # int32 [n]
    write_at: np.ndarray  # int32 [n]

    def args(self, dtype) -> list[jax.Array]:
        return [jnp.asarray(a, dtype) for a in (self.qkv, self.k_pool, self.v_pool)] + [
            jnp.asarray(a) for a in (self.tables, self.positions, self.write_at)]


def paged_case(rng, n: int, kv: int, group: int, d: int, block: int, m: int, dtype, spare: int = 3) -> PagedCase:
    """Random inputs: block 0 is the null block, the others are handed out in shuffled order; table
    entries past a row's length point at the null block. Every pool position no row may read is NaN."""
    heads = kv * group
    cast = lambda a: np.array(jnp.asarray(a, dtype).astype(jnp.float32))  # noqa: E731 - exact dtype values
    num_blocks = 1 + n * m + spare
    qkv = cast(rng.standard_normal((n, heads + 2 * kv, d)))
    k_pool = cast(rng.standard_normal((num_blocks, kv, block, d)))
    v_pool = cast(rng.standard_normal((num_blocks, kv, block, d)))
    tables = (1 + rng.permutation(num_blocks - 1)[: n * m]).reshape(n, m).astype(np.int32)
    capacity = m * block
    positions = rng.integers(0, capacity, n).astype(np.int32)
    positions[0] = capacity - 1 - (block // 2 if m > 1 else 0)  # a long context, not a multiple of B
    if n > 1:
        positions[1] = 0
    if n > 5 and m > 1:
        positions[5] = min(positions[5], (m - 1) * block - 1)  # room for a write past its length
    write_at = positions.copy()
    if n > 2:
        write_at[2] = capacity  # past the table: no write (stale work in a pipeline)
    if n > 3:
        write_at[3] = positions[3] // 2  # a write inside the attended range, not at its end
    if n > 4:
        write_at[4] = -1
    for b in range(n):
        tables[b, positions[b] // block + 1:] = 0  # past the row's length: the null block
    if n > 5 and m > 1:
        # A write past the row's length through a table entry outside the pool: dropped.
        write_at[5] = (positions[5] // block + 1) * block
        tables[5, positions[5] // block + 1] = num_blocks
    readable = np.zeros((num_blocks, block), bool)
    for b in range(n):
        p = np.arange(positions[b] + 1)
        readable[tables[b, p // block], p % block] = True
    for pool in (k_pool, v_pool):
        pool.transpose(0, 2, 1, 3)[~readable] = np.nan
    return PagedCase(qkv, k_pool, v_pool, tables, positions, write_at)


def reference_f64(case: PagedCase) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Float64 numpy: write, then softmax over each row's logical positions [0, pos]."""
    qkv = np.asarray(case.qkv, np.float64)
    kp, vp = np.array(case.k_pool, np.float64), np.array(case.v_pool, np.float64)
    num_blocks, kv, block, d = kp.shape
    n, m = case.tables.shape
    heads = qkv.shape[1] - 2 * kv
    for b in range(n):
        w = int(case.write_at[b])
        if 0 <= w < m * block and 0 <= case.tables[b, w // block] < num_blocks:
            kp[case.tables[b, w // block], :, w % block] = qkv[b, heads:heads + kv]
            vp[case.tables[b, w // block], :, w % block] = qkv[b, heads + kv:]
    out = np.zeros((n, heads, d))
    for b in range(n):
        p = np.arange(min(int(case.positions[b]), m * block - 1) + 1)
        blocks, offsets = case.tables[b, p // block], p % block
        keys, values = kp[blocks, :, offsets], vp[blocks, :, offsets]  # [P, kv, D]
        for hq in range(heads):
            h = hq // (heads // kv)
            scores = keys[:, h] @ qkv[b, hq] / math.sqrt(d)
            weights = np.exp(scores - scores.max())
            out[b, hq] = (weights / weights.sum()) @ values[:, h]
    return out, kp, vp


def written_mask(case: PagedCase) -> np.ndarray:
    """[num_blocks, kv, B, D]: the pool elements the step writes."""
    num_blocks, _, block, _ = case.k_pool.shape
    mask = np.zeros(case.k_pool.shape, bool)
    for b, w in enumerate(case.write_at):
        if 0 <= w < case.tables.shape[1] * block and 0 <= case.tables[b, w // block] < num_blocks:
            mask[case.tables[b, w // block], :, w % block] = True
    return mask


def check_pools(got_k, got_v, case: PagedCase, want_k, want_v) -> None:
    """The written positions hold the new K/V; every other element (NaN included) is unchanged."""
    written = written_mask(case)
    assert written.any()
    for got, want, before in ((got_k, want_k, case.k_pool), (got_v, want_v, case.v_pool)):
        got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
        np.testing.assert_array_equal(got[written], want[written])
        np.testing.assert_array_equal(got[~written], np.asarray(before, np.float64)[~written])


CPU_CASES = [  # n, kv, group, head_dim, block size, table entries per row
    (1, 2, 4, 16, 8, 5),
    (3, 2, 2, 8, 4, 7),
    (7, 1, 3, 16, 16, 3),
    (7, 4, 1, 8, 2, 9),
]


@pytest.mark.parametrize("shape", CPU_CASES, ids=lambda c: "n{}-kv{}-g{}-d{}-B{}-M{}".format(*c))
def test_reference_matches_float64_and_never_reads_unused_blocks(shape, rng):
    case = paged_case(rng, *shape, dtype=jnp.float32)
    fn = jax.jit(attention.reference_paged_decode_attention_packed)
    out, kp, vp = fn(*case.args(jnp.float32))
    want_out, want_k, want_v = reference_f64(case)
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all(), "a NaN of a position no row may read reached the output"
    np.testing.assert_allclose(out, want_out, rtol=2e-5, atol=2e-5)
    check_pools(kp, vp, case, want_k, want_v)


def test_the_case_covers_what_it_claims(rng):
    """The awkward parts of the inputs are there: shuffled tables, rows that write nowhere, a write
    past the table, a dropped write through an entry outside the pool, NaN in unused blocks."""
    case = paged_case(rng, 7, 2, 2, 8, 4, 9, dtype=jnp.float32)
    num_blocks, _, block, _ = case.k_pool.shape
    capacity = case.tables.shape[1] * block
    assert case.write_at[2] == capacity and case.write_at[4] == -1
    assert case.tables[5, case.write_at[5] // block] == num_blocks
    assert (case.positions[0] + 1) % block != 0
    used = case.tables[0, : case.positions[0] // block + 1]
    assert not np.array_equal(used, np.sort(used)), "the block table is not shuffled"
    spare = sorted(set(range(1, num_blocks)) - set(case.tables.ravel().tolist()))
    assert spare and np.isnan(case.k_pool[[0, *spare]]).all()  # the null block and the blocks no row holds
    assert written_mask(case).sum() == 4 * 2 * 8  # rows 0, 1, 3, 6 write, kv = 2, D = 8


def test_paged_reference_equals_contiguous_reference_on_a_contiguous_mapping(rng):
    """Row b's table lists blocks b*M .. b*M + M - 1: the pool is the contiguous cache cut into blocks."""
    n, kv, group, d, block, m = 5, 2, 3, 8, 4, 6
    heads = kv * group
    qkv = jnp.asarray(rng.standard_normal((n, heads + 2 * kv, d)), jnp.float32)
    k_cache = jnp.asarray(rng.standard_normal((n, kv, m * block, d)), jnp.float32)
    v_cache = jnp.asarray(rng.standard_normal((n, kv, m * block, d)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, m * block, n), jnp.int32)
    write_at = positions.at[1].set(m * block).at[2].set(positions[2] // 2)

    def to_pool(cache):
        return cache.reshape(n, kv, m, block, d).transpose(0, 2, 1, 3, 4).reshape(n * m, kv, block, d)

    tables = jnp.arange(n * m, dtype=jnp.int32).reshape(n, m)
    got = jax.jit(attention.reference_paged_decode_attention_packed)(
        qkv, to_pool(k_cache), to_pool(v_cache), tables, positions, write_at)
    want = jax.jit(attention.reference_decode_attention_packed)(qkv, k_cache, v_cache, positions, write_at)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(to_pool(want[1])))
    np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(to_pool(want[2])))


def test_without_gpu_kernel_the_reference_runs(rng):
    case = paged_case(rng, 3, 2, 2, 64, 16, 4, dtype=jnp.bfloat16)
    args = case.args(jnp.bfloat16)
    got = jax.jit(attention.paged_decode_attention_packed)(*args)
    want = jax.jit(attention.reference_paged_decode_attention_packed)(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))


def test_shapes_that_do_not_fit_are_refused():
    qkv = jnp.zeros((2, 6, 8))
    pool = jnp.zeros((4, 2, 4, 8))
    ok = (jnp.zeros((2, 3), jnp.int32), jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.int32))
    fn = attention.paged_decode_attention_packed
    with pytest.raises(ValueError, match="pools"):
        fn(qkv, pool, jnp.zeros((4, 2, 8, 8)), *ok)
    with pytest.raises(ValueError, match="qkv"):
        fn(jnp.zeros((2, 5, 8)), pool, pool, *ok)
    with pytest.raises(ValueError, match="block tables"):
        fn(qkv, pool, pool, jnp.zeros((3, 3), jnp.int32), *ok[1:])
    with pytest.raises(ValueError, match="positions"):
        fn(qkv, pool, pool, ok[0], jnp.zeros((3,), jnp.int32), ok[2])
    with pytest.raises(ValueError, match="integers"):
        fn(qkv, pool, pool, jnp.zeros((2, 3)), *ok[1:])


def test_paged_support_rules():
    assert attention.paged_kernel_supports(jnp.bfloat16, 128, 4, 64)
    assert all(attention.paged_kernel_supports(jnp.float16, 64, 8, b) for b in (16, 32, 64, 128))
    assert not attention.paged_kernel_supports(jnp.bfloat16, 128, 4, 48)
    assert not attention.paged_kernel_supports(jnp.bfloat16, 128, 3, 64)
    assert not attention.paged_kernel_supports(jnp.float32, 128, 4, 64)


# ---- GPU ----------------------------------------------------------------------------------------------
# Grids smaller and larger than the GPU, blocks smaller and larger than the kernel's 32-position
# stages, every group size; float16 at the first four.
GPU_CASES = [  # n, kv, group, head_dim, block size, table entries per row
    (1, 8, 4, 128, 64, 18),
    (3, 2, 8, 64, 16, 13),
    (40, 8, 8, 128, 16, 20),
    (33, 4, 2, 64, 16, 15),
    (7, 1, 1, 128, 32, 5),
    (7, 4, 4, 64, 128, 3),
    (64, 8, 4, 128, 64, 18),
    (2, 4, 8, 128, 16, 256),
    (5, 8, 1, 64, 32, 40),
    (3, 2, 4, 128, 128, 33),
]


STEPS = 5  # decode steps in one jit (the step tests)


def steps_case(rng) -> tuple[PagedCase, jax.Array]:
    """A case for STEPS decode steps, and each step's qkv: every row owns its blocks up to the end of
    its table and has room for the steps; positions later steps write hold finite values."""
    n, kv, group, d, block, m = 4, 8, 4, 128, 16, 8
    case = paged_case(rng, n, kv, group, d, block, m, dtype=jnp.bfloat16, spare=1)
    case.positions[:] = np.minimum(case.positions, m * block - STEPS)
    for b in range(n):
        case.tables[b] = 1 + np.arange(b * m, (b + 1) * m)[rng.permutation(m)]
    for pool in (case.k_pool, case.v_pool):
        pool[np.isnan(pool)] = 0.5  # positions written by later steps, read after they are written
    return case, jnp.asarray(rng.standard_normal((STEPS, *case.qkv.shape)), jnp.bfloat16)


def decode_steps(qkvs, k_pool, v_pool, tables, positions, *, use_kernel):
    """STEPS decode steps, each row writing and attending one position further: the outputs stacked
    and the final pools."""
    outs = []
    for i in range(STEPS):
        out, k_pool, v_pool = attention.paged_decode_attention_packed(
            qkvs[i], k_pool, v_pool, tables, positions + i, positions + i, use_kernel=use_kernel)
        outs.append(out)
    return jnp.stack(outs), k_pool, v_pool


def kernel_ready() -> None:
    from switchyard.kernels import native

    assert native.attention_ready(), native.status()


def uses_the_kernel(fn, *args) -> bool:
    return "switchyard_paged_decode_attention" in fn.lower(*args).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", GPU_CASES, ids=lambda c: "n{}-kv{}-g{}-d{}-B{}-M{}".format(*c))
def test_kernel_matches_float64_and_writes_only_its_positions(shape, dtype, rng):
    if dtype == "float16" and shape not in GPU_CASES[:4]:
        pytest.skip("float16 at four shapes only")
    kernel_ready()
    case = paged_case(rng, *shape, dtype=dtype)
    want_out, want_k, want_v = reference_f64(case)
    args = case.args(dtype)
    fn = jax.jit(attention.paged_decode_attention_packed, donate_argnums=(1, 2))
    assert uses_the_kernel(fn, *args)
    out, kp, vp = fn(*args)
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert np.isfinite(out).all(), "the kernel read a position no row may read"
    err = np.linalg.norm(out - want_out) / np.linalg.norm(want_out)
    assert err < (1e-2 if dtype == "bfloat16" else 2e-3), err
    check_pools(kp, vp, case, want_k, want_v)


@pytest.mark.gpu
def test_kernel_steps_in_one_jit_with_donated_pools(rng):
    """Several decode steps in one jitted function, the pools donated and updated in place: every
    step's output and the final pools agree with the reference run the same way."""
    kernel_ready()
    case, qkvs = steps_case(rng)

    args = case.args(jnp.bfloat16)
    tables, positions = args[3], args[4]
    kernel = jax.jit(lambda *a: decode_steps(*a, use_kernel=True), donate_argnums=(1, 2))
    assert uses_the_kernel(kernel, qkvs, args[1], args[2], tables, positions)
    want = jax.jit(lambda *a: decode_steps(*a, use_kernel=False))(qkvs, args[1], args[2], tables, positions)
    want = [np.asarray(w.astype(jnp.float32)) for w in want]
    got = kernel(qkvs, args[1], args[2], tables, positions)
    got = [np.asarray(g.astype(jnp.float32)) for g in got]
    err = np.linalg.norm(got[0] - want[0]) / np.linalg.norm(want[0])
    assert err < 1e-2, err
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])


# ---- FP8 pools (GPU) -------------------------------------------------------------------------------
FP8_GPU_CASES = [GPU_CASES[i] for i in (0, 1, 2, 3, 5, 7, 9)]


def fp8_case(case: PagedCase, dtype) -> tuple[kv_cache.Fp8Pool, kv_cache.Fp8Pool, PagedCase]:
    """The case's pools rounded to e4m3 with a scale per position and head (NaN where no row may read
    stays NaN, data and scale), and the case as the pools give it back: the pools dequantized to
    ``dtype`` and the new K/V as stored, so that ``reference_f64`` of it is what the FP8 step computes."""
    pools = []
    for pool in (case.k_pool, case.v_pool):
        q, scale = quantize_rows_np(pool)
        pools.append(kv_cache.Fp8Pool(jnp.asarray(q), jnp.asarray(scale[..., 0])))
    stored = lambda x: dequantize_np(*quantize_rows_np(x), dtype)  # noqa: E731
    kv = case.k_pool.shape[1]
    qkv = case.qkv.copy()
    qkv[:, -2 * kv:] = stored(qkv[:, -2 * kv:])
    as_read = [dequantize_np(np.asarray(p.data), np.asarray(p.scale)[..., None], dtype) for p in pools]
    return pools[0], pools[1], PagedCase(qkv, *as_read, case.tables, case.positions, case.write_at)


def dequantize_np(q: np.ndarray, scale: np.ndarray, dtype) -> np.ndarray:
    """As fp8.dequantize, on the host: q * scale in float32, rounded once to ``dtype``, as float32."""
    return np.asarray(jnp.asarray(np.asarray(q, np.float32) * scale).astype(dtype).astype(jnp.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", FP8_GPU_CASES, ids=lambda c: "n{}-kv{}-g{}-d{}-B{}-M{}".format(*c))
def test_fp8_kernel_matches_float64_of_what_the_pools_hold(shape, dtype, rng):
    """FP8 pools: the output against float64 attention over the dequantized pools (the new K/V as
    stored); the written positions hold the new K/V rounded as kv_cache.write rounds them, every
    other element (NaN included) is unchanged."""
    if dtype == "float16" and shape not in FP8_GPU_CASES[:3]:
        pytest.skip("float16 at three shapes only")
    kernel_ready()
    dtype = jnp.dtype(dtype)
    case = paged_case(rng, *shape, dtype=dtype)
    k_pool, v_pool, as_read = fp8_case(case, dtype)
    want_out, want_k, want_v = reference_f64(as_read)
    args = [jnp.asarray(case.qkv, dtype), k_pool, v_pool, *(jnp.asarray(a) for a in
                                                          (case.tables, case.positions, case.write_at))]
    fn = jax.jit(attention.paged_decode_attention_packed, donate_argnums=(1, 2))
    assert "switchyard_paged_decode_attention_fp8" in fn.lower(*args).as_text()
    before = [(np.asarray(p.data).view(np.uint8).copy(), np.asarray(p.scale).copy()) for p in (k_pool, v_pool)]
    out, kp, vp = fn(*args)
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert np.isfinite(out).all(), "the kernel read a position no row may read"
    err = np.linalg.norm(out - want_out) / np.linalg.norm(want_out)
    assert err < 1e-2, err
    written = written_mask(case)
    assert written.any()
    for got, want, (data0, scale0) in ((kp, want_k, before[0]), (vp, want_v, before[1])):
        data, scale = np.asarray(got.data), np.asarray(got.scale)
        np.testing.assert_array_equal(data.view(np.uint8)[~written], data0[~written])
        rows = written[..., 0]
        np.testing.assert_array_equal(scale[~rows], scale0[~rows])
        stored = dequantize_np(data, scale[..., None], dtype)
        np.testing.assert_allclose(stored[written], want[written], rtol=0.07, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fp8_kernel_reads_every_e4m3_value_exactly(head_dim, dtype):
    """Every finite e4m3 code (subnormals, zeros, both signs, 448) in the V row of the one cached
    position, scale 1: the new token's score is so low that its weight is exactly 0, so each output
    is the code's value, exactly, in the queries' dtype."""
    kernel_ready()
    dtype = jnp.dtype(dtype)
    kv, group, block = 256 // head_dim, 2, 16
    codes = np.arange(256, dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # the two NaN codes
    v_data = np.zeros((2, kv, block, head_dim), np.uint8)
    v_data[1, :, 0] = codes.reshape(kv, head_dim)
    scale = np.ones((2, kv, block), np.float32)
    as_pool = lambda data: kv_cache.Fp8Pool(jnp.asarray(data.view(NP_FP8)), jnp.asarray(scale))  # noqa: E731
    k_pool, v_pool = as_pool(np.zeros_like(v_data)), as_pool(v_data)
    qkv = np.zeros((1, kv * group + 2 * kv, head_dim), np.float32)
    qkv[0, :kv * group] = 8.0
    qkv[0, kv * group:kv * group + kv] = -8.0  # the new K: a score of -8 * 8 * sqrt(head_dim)
    args = (jnp.asarray(qkv, dtype), k_pool, v_pool, jnp.asarray([[1]], jnp.int32), jnp.asarray([1], jnp.int32),
            jnp.asarray([1], jnp.int32))
    fn = jax.jit(attention.paged_decode_attention_packed)
    assert "switchyard_paged_decode_attention_fp8" in fn.lower(*args).as_text()
    out = np.asarray(fn(*args)[0].astype(jnp.float32)).reshape(kv, group, head_dim)
    want = codes.view(NP_FP8).astype(np.float32).reshape(kv, 1, head_dim)
    np.testing.assert_array_equal(out, np.broadcast_to(want, out.shape))


@pytest.mark.gpu
def test_fp8_kernel_steps_like_the_pure_jax_path(rng):
    """Decode steps over FP8 pools in one jit: the kernel's outputs and final pools against the
    pure-JAX path's (kv_cache's rounding and dequantizing) run the same way."""
    kernel_ready()
    case, qkvs = steps_case(rng)
    k_pool, v_pool, _ = fp8_case(case, jnp.bfloat16)
    tables, positions = jnp.asarray(case.tables), jnp.asarray(case.positions)

    want = jax.jit(lambda *a: decode_steps(*a, use_kernel=False))(qkvs, k_pool, v_pool, tables, positions)
    kernel = jax.jit(lambda *a: decode_steps(*a, use_kernel=True))
    assert "switchyard_paged_decode_attention_fp8" in kernel.lower(qkvs, k_pool, v_pool, tables, positions).as_text()
    got = kernel(qkvs, k_pool, v_pool, tables, positions)
    g, w = (np.asarray(x[0].astype(jnp.float32)) for x in (got, want))
    assert np.linalg.norm(g - w) / np.linalg.norm(w) < 1e-2
    for gp, wp in ((got[1], want[1]), (got[2], want[2])):
        np.testing.assert_allclose(dequantize_np(np.asarray(gp.data), np.asarray(gp.scale)[..., None], jnp.bfloat16),
                                   dequantize_np(np.asarray(wp.data), np.asarray(wp.scale)[..., None], jnp.bfloat16),
                                   rtol=0.07, atol=1e-6)
