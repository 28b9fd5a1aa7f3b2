"""Decode attention for the engine: each row's new token against its KV cache, the new K/V written in.

``decode_attention_packed`` (q, k_new and v_new packed per row, as the engine's QKV projection
produces them) runs the CUDA kernel of ``csrc/decode_attention.cuh`` on GPUs where the kernel
library is loaded (one launch; the sequence is split across up to 8 blocks of one cluster when the
batch is small), and otherwise the pure-JAX reference below, with the same semantics.
``decode_attention`` takes them separately. Called inside ``jax.shard_map``
on one device's shard: rows are the first ``n`` rows of the caches.

``paged_decode_attention_packed`` is the same over a paged KV cache: per layer a pool of blocks of
``B`` positions, and per row a block table that says which block holds each ``B`` of its positions
(the same kernel, which finds each position's K/V through the table).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from switchyard.kernels import kv_cache, native

KERNEL_DTYPES = ("bfloat16", "float16")
KERNEL_HEAD_DIMS = (64, 128)
KERNEL_GROUPS = (1, 2, 4, 8)  # up to kAttnMaxGroup in csrc/decode_attention.cuh
# Blocks resident at once: two per SM of an H100/H200 (132 SMs; the kernel's registers allow two).
# Splitting into more would start a second wave of blocks, which costs more than longer slices.
TARGET_BLOCKS = 264
# The FP8 pools' kernel (128 registers a thread, a 34 KB ring) fits four blocks per SM. With two, its
# ring holds half the bytes of a 16-bit pool's in flight: at batch 32, one wave of 256 blocks moved
# 1.85 TB/s of FP8 against 3.57 of bf16 in the same time (benchmarks/NOTES.md).
TARGET_BLOCKS_FP8 = 528
MIN_SLICE = 64  # positions per block below which splitting the sequence further does not pay
PORTABLE_SPLITS = 8  # the portable cluster size
# Beyond the portable 8 slices, only while each keeps this many positions: on an H200 at batch 1,
# 16 slices beat 8 at contexts of 4096 and 32768 and lost at 1024 (benchmarks/NOTES.md).
WIDE_MIN_SLICE = 256
MAX_SPLITS = 16  # kAttnMaxSplits in csrc/decode_attention.cuh: the slices of a (row, head) form one cluster
MAX_PAIRS = (1 << 31) - 1  # (row, KV head) pairs: the grid's x dimension
# Paged pools: the block sizes the kernel is built and tested for (it needs a power of two), and the
# pool rows (blocks x KV heads x block size) must stay below POOL_ROW_LIMIT (a row's index is 32-bit).
KERNEL_BLOCK_SIZES = (16, 32, 64, 128)
POOL_ROW_LIMIT = 0xFFFFFFFF  # kPagedRowLimit in csrc/paged_attention.cuh
MAX_TABLE_POSITIONS = (1 << 31) - 1  # M x B: positions are int32


def splits_for(n: int, kv_heads: int, cache_len: int, fp8_pools: bool = False) -> int:
    """How many slices of the sequence each (row, KV head) is split into (the launch lowers it further
    where the clusters would not fit in one wave)."""
    fit = (TARGET_BLOCKS_FP8 if fp8_pools else TARGET_BLOCKS) // max(n * kv_heads, 1)
    portable = min(fit, math.ceil(cache_len / MIN_SLICE), PORTABLE_SPLITS)
    wide = min(fit, cache_len // WIDE_MIN_SLICE, MAX_SPLITS)
    return max(1, portable, wide)


def kernel_supports(dtype: jnp.dtype, head_dim: int, group: int) -> bool:
    return jnp.dtype(dtype).name in KERNEL_DTYPES and head_dim in KERNEL_HEAD_DIMS and group in KERNEL_GROUPS


def reference_decode_attention(
    q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
    positions: jax.Array, write_at: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [n, H, D]; k_new, v_new [n, kv, D]; caches [slots, kv, L, D]; positions, write_at [n].

    Writes row b's new K/V at ``write_at[b]`` (dropped when outside the cache) and attends over
    positions ``[0, positions[b]]``. Returns (out [n, H, D], k_cache, v_cache).
    """
    n = q.shape[0]
    rows = jnp.arange(n)
    # The scatter drops writes aimed past the cache's end; it never reads the cache (reading it would
    # make XLA copy the whole cache to scatter in place).
    k_cache = k_cache.at[rows, :, write_at, :].set(k_new.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[rows, :, write_at, :].set(v_new.astype(v_cache.dtype), mode="drop")
    visible = jnp.arange(k_cache.shape[2])[None, :] <= positions[:, None]
    return _attend(q, k_cache[:n], v_cache[:n], visible), k_cache, v_cache


def _attend(q: jax.Array, kc: jax.Array, vc: jax.Array, visible: jax.Array) -> jax.Array:
    """q [n, H, D] against kc, vc [n, kv, S, D] where ``visible`` [n, S]; out [n, H, D]."""
    n, heads, d = q.shape
    kv = kc.shape[1]
    qg = q.reshape(n, kv, heads // kv, d)
    scores = jnp.einsum("bkgd,bksd->bkgs", qg, kc, preferred_element_type=jnp.float32)
    scores = jnp.where(visible[:, None, None, :], scores / math.sqrt(d), -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(vc.dtype)
    out = jnp.einsum("bkgs,bksd->bkgd", probs, vc)
    return out.reshape(n, heads, d)


def reference_decode_attention_packed(
    qkv: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array, write_at: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """As :func:`reference_decode_attention`, with q, k_new and v_new packed per row in ``qkv``
    [n, H + 2 kv, D] (query heads, then K heads, then V heads)."""
    kv = k_cache.shape[1]
    heads = qkv.shape[1] - 2 * kv
    return reference_decode_attention(qkv[:, :heads], qkv[:, heads:heads + kv], qkv[:, heads + kv:],
                                      k_cache, v_cache, positions, write_at)


def _kernel(qkv, k_cache, v_cache, positions, write_at):
    n, total, d = qkv.shape
    kv = k_cache.shape[1]
    splits = splits_for(n, kv, k_cache.shape[2])
    out, k_cache, v_cache = jax.ffi.ffi_call(
        "switchyard_decode_attention",
        (jax.ShapeDtypeStruct((n, total - 2 * kv, d), qkv.dtype), jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
         jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)),
        input_output_aliases={1: 1, 2: 2},
    )(qkv, k_cache, v_cache, positions.astype(jnp.int32), write_at.astype(jnp.int32),
      scale=np.float32(1.0 / math.sqrt(d)), splits=np.int32(splits))
    return out, k_cache, v_cache


def decode_attention_packed(
    qkv: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array, write_at: jax.Array,
    *, use_kernel: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """As :func:`reference_decode_attention_packed`; on CUDA with the kernel library, one fused kernel
    that reads q, k_new and v_new in place from ``qkv`` [n, H + 2 kv, D]."""
    args = (qkv, k_cache, v_cache, positions, write_at)
    kv = k_cache.shape[1]
    heads = qkv.shape[1] - 2 * kv
    usable = (use_kernel and heads > 0 and heads % kv == 0 and qkv.dtype == k_cache.dtype
              and kernel_supports(qkv.dtype, qkv.shape[2], heads // kv) and qkv.shape[0] * kv <= MAX_PAIRS
              and native.attention_ready())
    if not usable:
        return reference_decode_attention_packed(*args)
    return jax.lax.platform_dependent(*args, default=reference_decode_attention_packed, cuda=_kernel)


def decode_attention(
    q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
    positions: jax.Array, write_at: jax.Array, *, use_kernel: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """As :func:`reference_decode_attention`; on CUDA with the kernel library, q, k_new and v_new are
    packed into one array and :func:`decode_attention_packed` runs the kernel."""
    if not use_kernel or q.shape[1] % max(k_new.shape[1], 1) or not (q.dtype == k_new.dtype == v_new.dtype):
        return reference_decode_attention(q, k_new, v_new, k_cache, v_cache, positions, write_at)
    qkv = jnp.concatenate([q, k_new.astype(q.dtype), v_new.astype(q.dtype)], axis=1)
    return decode_attention_packed(qkv, k_cache, v_cache, positions, write_at, use_kernel=use_kernel)


# ---- paged KV cache ---------------------------------------------------------------------------------


def paged_kernel_supports(dtype: jnp.dtype, head_dim: int, group: int, block_size: int) -> bool:
    return kernel_supports(dtype, head_dim, group) and block_size in KERNEL_BLOCK_SIZES


def _check_paged(qkv: jax.Array, k_pool: jax.Array, v_pool: jax.Array, block_tables: jax.Array,
                 positions: jax.Array, write_at: jax.Array) -> None:
    """Clear errors for shapes that do not fit together (at trace time)."""
    if k_pool.ndim != 4 or k_pool.shape != v_pool.shape:
        raise ValueError(f"paged attention: pools must both be [num_blocks, kv, B, D]; got {k_pool.shape} "
                         f"and {v_pool.shape}")
    num_blocks, kv, _, d = k_pool.shape
    if qkv.ndim != 3 or qkv.shape[2] != d or kv == 0 or qkv.shape[1] <= 2 * kv or (qkv.shape[1] - 2 * kv) % kv:
        raise ValueError(f"paged attention: qkv {qkv.shape} must be [n, H + 2 kv, D] with H a multiple of "
                         f"kv = {kv} and D = {d}")
    n = qkv.shape[0]
    if block_tables.ndim != 2 or block_tables.shape[0] != n or block_tables.shape[1] == 0:
        raise ValueError(f"paged attention: block tables {block_tables.shape} must be [n = {n}, M >= 1]")
    if positions.shape != (n,) or write_at.shape != (n,):
        raise ValueError(f"paged attention: positions {positions.shape} and write_at {write_at.shape} must be ({n},)")
    if num_blocks == 0:
        raise ValueError("paged attention: the pools have no blocks")
    for name, arr in (("block tables", block_tables), ("positions", positions), ("write_at", write_at)):
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"paged attention: {name} must be integers, got {arr.dtype}")


def reference_paged_decode_attention_packed(
    qkv: jax.Array, k_pool: jax.Array, v_pool: jax.Array, block_tables: jax.Array, positions: jax.Array,
    write_at: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Decode attention over a paged KV cache, in pure JAX.

    qkv [n, H + 2 kv, D] (query heads, then K heads, then V heads; rope applied); pools
    [num_blocks, kv, B, D], dense or FP8 (``kv_cache``); block_tables int [n, M]: row b's logical
    position p lives in block ``block_tables[b, p // B]`` at offset ``p % B``; positions [n]: row b
    attends over logical positions ``[0, positions[b]]`` (at most M * B of them); write_at [n]: row
    b's new K/V go to logical position ``write_at[b]``, not written where that is outside ``[0, M * B)`` or its table
    entry is outside ``[0, num_blocks)``. Table entries of the attended positions must be in
    ``[0, num_blocks)``; the others may hold anything and are never read. Returns
    (out [n, H, D], k_pool, v_pool).
    """
    _check_paged(qkv, k_pool, v_pool, block_tables, positions, write_at)
    num_blocks, kv, bs, d = k_pool.shape
    n, m = block_tables.shape
    heads = qkv.shape[1] - 2 * kv
    q, k_new, v_new = qkv[:, :heads], qkv[:, heads:heads + kv], qkv[:, heads + kv:]
    tables = block_tables.astype(jnp.int32)
    positions, write_at = positions.astype(jnp.int32), write_at.astype(jnp.int32)
    rows = jnp.arange(n)
    # The write: one scatter into the pool that drops what it may not write (index num_blocks is past
    # the pool); like the contiguous reference, it never reads the pool.
    block = tables[rows, jnp.clip(write_at // bs, 0, m - 1)]
    writes = (write_at >= 0) & (write_at < m * bs) & (block >= 0) & (block < num_blocks)
    block = jnp.where(writes, block, num_blocks)
    offset = write_at % bs
    k_pool = kv_cache.write(k_pool, (block, slice(None), offset), k_new)
    v_pool = kv_cache.write(v_pool, (block, slice(None), offset), v_new)
    # The rows' blocks, in logical order: [n, kv, M * B, D] (an FP8 pool's dequantized to q's dtype).
    # Positions past a row's own are zeroed as well as masked, so whatever unused blocks hold (stale
    # or NaN) never reaches the output.
    visible = jnp.arange(m * bs)[None, :] <= positions[:, None]
    as_dtype = q.dtype if kv_cache.is_fp8(k_pool) else None

    def gather(pool: kv_cache.Pool) -> jax.Array:
        seq = kv_cache.read(pool, (jnp.clip(tables, 0, num_blocks - 1),), as_dtype)
        seq = seq.transpose(0, 2, 1, 3, 4).reshape(n, kv, m * bs, d)
        return jnp.where(visible[:, None, :, None], seq, jnp.zeros((), seq.dtype))

    return _attend(q, gather(k_pool), gather(v_pool), visible), k_pool, v_pool


def _paged_kernel(qkv, k_pool, v_pool, block_tables, positions, write_at):
    n, total, d = qkv.shape
    kv, bs = k_pool.shape[1], k_pool.shape[2]
    splits = splits_for(n, kv, block_tables.shape[1] * bs)
    out, k_pool, v_pool = jax.ffi.ffi_call(
        "switchyard_paged_decode_attention",
        (jax.ShapeDtypeStruct((n, total - 2 * kv, d), qkv.dtype), jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype),
         jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype)),
        input_output_aliases={1: 1, 2: 2},
    )(qkv, k_pool, v_pool, block_tables.astype(jnp.int32), positions.astype(jnp.int32), write_at.astype(jnp.int32),
      scale=np.float32(1.0 / math.sqrt(d)), splits=np.int32(splits))
    return out, k_pool, v_pool


def _paged_fp8_kernel(qkv, k_pool, v_pool, block_tables, positions, write_at):
    n, total, d = qkv.shape
    kv, bs = k_pool.shape[1], k_pool.shape[2]
    splits = splits_for(n, kv, block_tables.shape[1] * bs, fp8_pools=True)
    data, scales = jax.ShapeDtypeStruct(k_pool.data.shape, k_pool.data.dtype), jax.ShapeDtypeStruct(
        k_pool.scale.shape, k_pool.scale.dtype)
    out, k_data, k_scale, v_data, v_scale = jax.ffi.ffi_call(
        "switchyard_paged_decode_attention_fp8",
        (jax.ShapeDtypeStruct((n, total - 2 * kv, d), qkv.dtype), data, scales, data, scales),
        input_output_aliases={1: 1, 2: 2, 3: 3, 4: 4},
    )(qkv, k_pool.data, k_pool.scale, v_pool.data, v_pool.scale, block_tables.astype(jnp.int32),
      positions.astype(jnp.int32), write_at.astype(jnp.int32), scale=np.float32(1.0 / math.sqrt(d)),
      splits=np.int32(splits))
    return out, kv_cache.Fp8Pool(k_data, k_scale), kv_cache.Fp8Pool(v_data, v_scale)


def paged_decode_attention_packed(
    qkv: jax.Array, k_pool: kv_cache.Pool, v_pool: kv_cache.Pool, block_tables: jax.Array, positions: jax.Array,
    write_at: jax.Array, *, use_kernel: bool = True,
) -> tuple[jax.Array, kv_cache.Pool, kv_cache.Pool]:
    """As :func:`reference_paged_decode_attention_packed`; on CUDA with the kernel library, one launch
    of the decode-attention kernel that finds each position's K/V through the block table (the pools
    are updated in place when donated). FP8 pools (``kv_cache.Fp8Pool``) go to the kernel's FP8
    variant, whose products read the e4m3 rows widened to fp16 (whatever the queries' dtype) and take
    their scales in fp32."""
    _check_paged(qkv, k_pool, v_pool, block_tables, positions, write_at)
    args = (qkv, k_pool, v_pool, block_tables, positions, write_at)
    num_blocks, kv, bs, d = k_pool.shape
    n, m = block_tables.shape
    heads = qkv.shape[1] - 2 * kv
    fp8 = kv_cache.is_fp8(k_pool) and kv_cache.is_fp8(v_pool)
    pools_fit = fp8 or (qkv.dtype == k_pool.dtype == v_pool.dtype)
    usable = (use_kernel and pools_fit
              and paged_kernel_supports(qkv.dtype, d, heads // kv, bs) and n * kv <= MAX_PAIRS
              and num_blocks * kv * bs < POOL_ROW_LIMIT and m * bs <= MAX_TABLE_POSITIONS and native.attention_ready())
    if not usable:
        return reference_paged_decode_attention_packed(*args)
    return jax.lax.platform_dependent(*args, default=reference_paged_decode_attention_packed,
                                      cuda=_paged_fp8_kernel if fp8 else _paged_kernel)
