"""Decode attention for the engine: each row's new token against its KV cache, the new K/V written in.

``decode_attention_packed`` (q, k_new and v_new packed per row, as the engine's QKV projection
produces them) runs the CUDA kernel of ``csrc/decode_attention.cuh`` on GPUs where the kernel
library is loaded (one launch; the sequence is split across up to 8 blocks of one cluster when the
batch is small), and otherwise the pure-JAX reference below, with the same semantics.
``decode_attention`` takes them separately. Called inside ``jax.shard_map``
on one device's shard: rows are the first ``n`` rows of the caches.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from switchyard.kernels import native

KERNEL_DTYPES = ("bfloat16", "float16")
KERNEL_HEAD_DIMS = (64, 128)
KERNEL_GROUPS = (1, 2, 4, 8)  # up to kAttnMaxGroup in csrc/decode_attention.cuh
# Blocks resident at once: two per SM of an H100/H200 (132 SMs; the kernel's registers allow two).
# Splitting into more would start a second wave of blocks, which costs more than longer slices.
TARGET_BLOCKS = 264
MIN_SLICE = 64  # positions per block below which splitting the sequence further does not pay
MAX_SPLITS = 8  # kAttnMaxSplits in csrc/decode_attention.cuh: the slices of a (row, head) form one cluster
MAX_PAIRS = (1 << 31) - 1  # (row, KV head) pairs: the grid's x dimension


def splits_for(n: int, kv_heads: int, cache_len: int) -> int:
    """How many slices of the sequence each (row, KV head) is split into."""
    return max(1, min(TARGET_BLOCKS // max(n * kv_heads, 1), math.ceil(cache_len / MIN_SLICE), MAX_SPLITS))


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
    n, heads, d = q.shape
    kv = k_new.shape[1]
    rows = jnp.arange(n)
    # The scatter drops writes aimed past the cache's end; it never reads the cache (reading it would
    # make XLA copy the whole cache to scatter in place).
    k_cache = k_cache.at[rows, :, write_at, :].set(k_new.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[rows, :, write_at, :].set(v_new.astype(v_cache.dtype), mode="drop")
    kc, vc = k_cache[:n], v_cache[:n]
    visible = jnp.arange(k_cache.shape[2])[None, :] <= positions[:, None]
    qg = q.reshape(n, kv, heads // kv, d)
    scores = jnp.einsum("bkgd,bksd->bkgs", qg, kc, preferred_element_type=jnp.float32)
    scores = jnp.where(visible[:, None, None, :], scores / math.sqrt(d), -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(vc.dtype)
    out = jnp.einsum("bkgs,bksd->bkgd", probs, vc)
    return out.reshape(n, heads, d), k_cache, v_cache


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


def reference_paged_decode_attention_packed(
    qkv: jax.Array, k_pool: jax.Array, v_pool: jax.Array, block_tables: jax.Array, positions: jax.Array,
    write_at: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """As :func:`reference_decode_attention_packed` over a paged pool: pools [NB, kv, B, D]; row b's
    logical position p lives in block ``block_tables[b, p // B]`` at offset ``p % B``. A ``write_at``
    outside the table's positions, or whose table entry is outside the pool, writes nothing."""
    n, _, d = qkv.shape
    nb, kv, bs, _ = k_pool.shape
    m = block_tables.shape[1]
    heads = qkv.shape[1] - 2 * kv
    rows = jnp.arange(n)
    inside = (write_at >= 0) & (write_at < m * bs)
    entry = block_tables[rows, jnp.clip(write_at // bs, 0, m - 1)]
    block = jnp.where(inside & (entry >= 0) & (entry < nb), entry, nb)
    offset = jnp.where(inside, write_at % bs, 0)
    k_pool = k_pool.at[block, :, offset, :].set(qkv[:, heads:heads + kv].astype(k_pool.dtype), mode="drop")
    v_pool = v_pool.at[block, :, offset, :].set(qkv[:, heads + kv:].astype(v_pool.dtype), mode="drop")
    kc = jnp.swapaxes(k_pool[block_tables], 1, 2).reshape(n, kv, m * bs, d)
    vc = jnp.swapaxes(v_pool[block_tables], 1, 2).reshape(n, kv, m * bs, d)
    visible = jnp.arange(m * bs)[None, :] <= positions[:, None]
    kc = jnp.where(visible[:, None, :, None], kc, 0)  # unwritten positions may hold anything
    vc = jnp.where(visible[:, None, :, None], vc, 0)
    qg = qkv[:, :heads].reshape(n, kv, heads // kv, d)
    scores = jnp.einsum("bkgd,bksd->bkgs", qg, kc, preferred_element_type=jnp.float32)
    scores = jnp.where(visible[:, None, None, :], scores / math.sqrt(d), -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(vc.dtype)
    out = jnp.einsum("bkgs,bksd->bkgd", probs, vc)
    return out.reshape(n, heads, d), k_pool, v_pool


def paged_decode_attention_packed(
    qkv: jax.Array, k_pool: jax.Array, v_pool: jax.Array, block_tables: jax.Array, positions: jax.Array,
    write_at: jax.Array, *, use_kernel: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """As :func:`reference_paged_decode_attention_packed`."""
    return reference_paged_decode_attention_packed(qkv, k_pool, v_pool, block_tables, positions, write_at)
