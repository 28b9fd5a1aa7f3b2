"""Prompt chunks' attention: each chunk's queries against its sequence's earlier keys and its own.

The two parts are computed apart and merged by their log-sum-exps (as FlashAttention merges the
blocks it visits). Split so, each part has a mask a library kernel takes natively: the earlier keys
a padding mask (the first ``start`` positions of the sequence), the chunk's own keys a causal one.
cuDNN then stops at the last real key instead of reading a bias over the whole bucket, which made it
about three times slower per query-key pair than causal flash attention.

The earlier keys are in the KV pool, [blocks, kv, B, D], found through the sequence's block table
[M]. cuDNN reads them there through the table (paged attention); XLA's ops gather the first
``kv_len`` positions into one array first (dequantizing an FP8 pool as they gather it: cuDNN's
paged attention takes 16-bit pools only).

A step may carry several chunks (of several sequences), K of them, each padded to C tokens: the
attention takes them as a batch, q [K, C, H, D], one block table [K, M] and one ``start`` [K] per
chunk, in one library call per part whatever K is.

A partial attention is ``(q [K, C, H, D], k [K, S, kv, D], v [K, S, kv, D], kv_len [K] | None,
causal) -> (out [K, C, H, D] float32, lse [K, C, H] float32)`` with grouped queries (H a multiple of
kv); a query that sees no key has lse -inf. An earlier-keys attention is ``(q, k_pool, v_pool, table
[K, M], start [K], kv_len) -> (out, lse)`` over positions ``[0, start)``, ``start <= kv_len``
(static, a whole number of blocks).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from switchyard.kernels import kv_cache

PartialAttention = Callable[..., tuple[jax.Array, jax.Array]]
EarlierAttention = Callable[..., tuple[jax.Array, jax.Array]]


def xla_partial(q: jax.Array, k: jax.Array, v: jax.Array, kv_len: jax.Array | None = None,
                causal: bool = False) -> tuple[jax.Array, jax.Array]:
    """One chunk's partial attention in XLA's ops (any platform): q [C, H, D] against k, v [S, kv, D],
    keys below ``kv_len`` when given; with ``causal``, query i sees keys 0..i. (out [C, H, D], lse [C, H])."""
    c, heads, d = q.shape
    s, kv, _ = k.shape
    qg = q.reshape(c, kv, heads // kv, d)
    scores = jnp.einsum("qkgd,skd->kgqs", qg, k, preferred_element_type=jnp.float32) / math.sqrt(d)
    visible = jnp.ones((c, s), bool)
    if kv_len is not None:
        visible &= (jnp.arange(s) < kv_len)[None, :]
    if causal:
        visible &= jnp.arange(s)[None, :] <= jnp.arange(c)[:, None]
    scores = jnp.where(visible[None, None], scores, -jnp.inf)
    top = scores.max(-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    probs = jnp.exp(scores - top)
    total = probs.sum(-1)  # [kv, g, C]; 0 where a query sees no key
    seen = total > 0
    safe_total = jnp.where(seen, total, 1.0)
    out = jnp.einsum("kgqs,skd->qkgd", probs, v.astype(jnp.float32))
    out = out / safe_total.transpose(2, 0, 1)[..., None]
    lse = jnp.where(seen, top[..., 0] + jnp.log(safe_total), -jnp.inf)
    return out.reshape(c, heads, d), lse.reshape(heads, c).T


def xla_partials(q: jax.Array, k: jax.Array, v: jax.Array, kv_len: jax.Array | None = None,
                 causal: bool = False) -> tuple[jax.Array, jax.Array]:
    """:func:`xla_partial` over a batch of chunks (module docstring)."""
    if kv_len is None:
        return jax.vmap(lambda q, k, v: xla_partial(q, k, v, None, causal))(q, k, v)
    return jax.vmap(lambda q, k, v, n: xla_partial(q, k, v, n, causal))(q, k, v, kv_len)


def cudnn_partials(q: jax.Array, k: jax.Array, v: jax.Array, kv_len: jax.Array | None = None,
                   causal: bool = False) -> tuple[jax.Array, jax.Array]:
    """As :func:`xla_partials`, through cuDNN's flash attention (CUDA, 16-bit inputs), the chunks as
    its batch. Its float32 log-sum-exp comes from the function under ``jax.nn.dot_product_attention``,
    whose own ``return_residual`` rounds it to the inputs' dtype (too coarse to merge by)."""
    from jax._src.cudnn import fused_attention_stablehlo as sdpa

    k_chunks, c, _, d = q.shape
    seqlens: dict[str, jax.Array] = {}
    if kv_len is not None:
        mask = sdpa.MaskType.PADDING_CAUSAL if causal else sdpa.MaskType.PADDING
        seqlens = {"q_seqlen": jnp.full((k_chunks,), c, jnp.int32), "kv_seqlen": kv_len.astype(jnp.int32)}
    else:
        mask = sdpa.MaskType.CAUSAL if causal else sdpa.MaskType.NO_MASK
    # Head-major (BNTH), as the earlier keys' paged call takes them: the chunks' queries are then laid
    # out once for both of their calls, and both outputs come back alike.
    out, lse = sdpa.dot_product_attention(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), scale=1.0 / math.sqrt(d),
                                          mask_type=mask, qkv_layout="BNTH", return_residual=True, **seqlens)
    # [K, H, C, D] -> [K, C, H, D]; [K, H, C] -> [K, C, H]
    return jnp.swapaxes(out, 1, 2).astype(jnp.float32), jnp.swapaxes(lse, 1, 2)


def gather_earlier(pool: kv_cache.Pool, table: jax.Array, start: jax.Array, kv_len: int,
                   dtype: Any | None = None) -> jax.Array:
    """Positions ``[0, kv_len)`` of a sequence from a pool [blocks, kv, B, D] (dense or FP8) through its
    table [M], as [kv_len, kv, D] in the pool's dtype or ``dtype``, those at or past ``start`` zeroed
    (they may hold anything, stale or not yet written)."""
    _, kv, bs, d = pool.shape
    seq = jnp.swapaxes(kv_cache.read(pool, (table[: kv_len // bs],), dtype), 1, 2).reshape(kv_len, kv, d)
    return jnp.where((jnp.arange(kv_len) < start)[:, None, None], seq, jnp.zeros((), seq.dtype))


def xla_earlier(q: jax.Array, k_pool: kv_cache.Pool, v_pool: kv_cache.Pool, table: jax.Array, start: jax.Array,
                kv_len: int) -> tuple[jax.Array, jax.Array]:
    """The earlier keys' partial attention in XLA's ops: each chunk's gathered from the pool, then
    attended."""
    def one(q: jax.Array, table: jax.Array, start: jax.Array) -> tuple[jax.Array, jax.Array]:
        k, v = (gather_earlier(pool, table, start, kv_len, q.dtype) for pool in (k_pool, v_pool))
        return xla_partial(q, k, v, start)

    return jax.vmap(one)(q, table, start)


def cudnn_earlier(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, table: jax.Array, start: jax.Array,
                  kv_len: int) -> tuple[jax.Array, jax.Array]:
    """The earlier keys' partial attention through cuDNN's paged flash attention, reading the pool in
    place through each chunk's table (the chunks as its batch). The pool [blocks, kv, B, D] is cuDNN's
    BNSH block layout, so queries go in (and come out) head-major. The module's ``paged_attention``
    wants a pool of exactly the tables' blocks; the call under it takes any pool, as cuDNN does."""
    from jax._src.cudnn import fused_attention_stablehlo as sdpa

    k_chunks, c, _, d = q.shape
    bs = k_pool.shape[2]
    pages = table[:, : kv_len // bs].astype(jnp.int32).reshape(k_chunks, 1, -1, 1)
    unused = jnp.zeros(0, q.dtype)
    out, lse = sdpa._dot_product_attention(
        jnp.swapaxes(q, 1, 2), k_pool, v_pool, unused, jnp.full((k_chunks,), c, jnp.int32),
        start.astype(jnp.int32), unused, unused, pages, pages, 1.0 / math.sqrt(d), 42, 0.0,
        (False, False), sdpa.MaskType.PADDING, sdpa.AttentionLayout.BNTH.value, None, sdpa.check_cudnn_version(),
        True)
    return jnp.swapaxes(out, 1, 2).astype(jnp.float32), jnp.swapaxes(lse, 1, 2)


def merge(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array) -> jax.Array:
    """Two partial attentions of the same queries over disjoint keys, as one (lse_b finite)."""
    top = jnp.maximum(lse_a, lse_b)
    wa, wb = jnp.exp(lse_a - top)[..., None], jnp.exp(lse_b - top)[..., None]
    return (out_a * wa + out_b * wb) / (wa + wb)


def split_chunk_attention(own: PartialAttention, earlier: EarlierAttention, q: jax.Array, k_pool: jax.Array,
                          v_pool: jax.Array, table: jax.Array, start: jax.Array, kv_len: int, k_chunk: jax.Array,
                          v_chunk: jax.Array) -> jax.Array:
    """Chunk j's queries q[j] [C, H, D] at positions start[j].. against its sequence's keys at
    positions < start[j] (in the pools, through ``table[j]``) and its own (k_chunk[j], v_chunk[j]
    [C, kv, D], causal); returns [K, C, H, D] in q's dtype.

    Padded queries past a chunk's real end see padded own keys only, never a real query's.
    """
    out_b, lse_b = own(q, k_chunk, v_chunk, None, True)
    out_a, lse_a = earlier(q, k_pool, v_pool, table, start, kv_len)
    # A first chunk has no earlier keys; whatever a kernel returns for an empty key set is unused.
    has_earlier = (start > 0)[:, None, None]
    out_a = jnp.where(has_earlier[..., None], out_a, 0.0)
    lse_a = jnp.where(has_earlier, lse_a, -jnp.inf)
    return merge(out_a, lse_a, out_b, lse_b).astype(q.dtype)


def chunk_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, table: jax.Array, start: jax.Array,
                    kv_len: int, k_chunk: jax.Array, v_chunk: jax.Array) -> jax.Array:
    """:func:`split_chunk_attention` in XLA's ops (any platform, any dtype)."""
    return split_chunk_attention(xla_partials, xla_earlier, q, k_pool, v_pool, table, start, kv_len, k_chunk,
                                 v_chunk)


def cudnn_takes(q: jax.Array, k_pool: kv_cache.Pool) -> bool:
    """Whether cuDNN's flash attention takes these queries and pools: 16-bit, the pools dense in the
    queries' dtype (an FP8 pool's earlier keys go through XLA's ops, dequantized as gathered)."""
    return (jnp.dtype(q.dtype).name in ("bfloat16", "float16") and not kv_cache.is_fp8(k_pool)
            and k_pool.dtype == q.dtype)


def cudnn_chunk_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, table: jax.Array, start: jax.Array,
                          kv_len: int, k_chunk: jax.Array, v_chunk: jax.Array) -> jax.Array:
    """:func:`split_chunk_attention` through cuDNN (where :func:`cudnn_takes` the inputs; others go
    through XLA's ops)."""
    if not cudnn_takes(q, k_pool):
        return chunk_attention(q, k_pool, v_pool, table, start, kv_len, k_chunk, v_chunk)
    return split_chunk_attention(cudnn_partials, cudnn_earlier, q, k_pool, v_pool, table, start, kv_len, k_chunk,
                                 v_chunk)
