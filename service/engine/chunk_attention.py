"""A prompt chunk's attention: its queries against the sequence's earlier keys and against its own.

The two parts are computed apart and merged by their log-sum-exps (as FlashAttention merges the
blocks it visits). Split so, each part has a mask a library kernel takes natively: the earlier keys
a padding mask (the first ``start`` of the gathered context bucket), the chunk's own keys a causal
one. cuDNN then stops at the last real key instead of reading a bias over the whole bucket, which
made it about three times slower per query-key pair than causal flash attention.

A partial attention is ``(q [C, H, D], k [S, kv, D], v [S, kv, D], kv_len | None, causal) ->
(out [C, H, D] float32, lse [C, H] float32)`` with grouped queries (H a multiple of kv); a query that
sees no key has lse -inf.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

PartialAttention = Callable[..., tuple[jax.Array, jax.Array]]


def xla_partial(q: jax.Array, k: jax.Array, v: jax.Array, kv_len: jax.Array | None = None,
                causal: bool = False) -> tuple[jax.Array, jax.Array]:
    """A partial attention in XLA's ops (any platform): keys below ``kv_len`` when given; with
    ``causal``, query i sees keys 0..i."""
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


def cudnn_partial(q: jax.Array, k: jax.Array, v: jax.Array, kv_len: jax.Array | None = None,
                  causal: bool = False) -> tuple[jax.Array, jax.Array]:
    """As :func:`xla_partial`, through cuDNN's flash attention (CUDA, 16-bit inputs). Its float32
    log-sum-exp comes from the function under ``jax.nn.dot_product_attention``, whose own
    ``return_residual`` rounds it to the inputs' dtype (too coarse to merge by)."""
    from jax._src.cudnn import fused_attention_stablehlo as sdpa

    c, _, d = q.shape
    seqlens: dict[str, jax.Array] = {}
    if kv_len is not None:
        mask = sdpa.MaskType.PADDING_CAUSAL if causal else sdpa.MaskType.PADDING
        seqlens = {"q_seqlen": jnp.full((1,), c, jnp.int32),
                   "kv_seqlen": jnp.reshape(kv_len, (1,)).astype(jnp.int32)}
    else:
        mask = sdpa.MaskType.CAUSAL if causal else sdpa.MaskType.NO_MASK
    out, lse = sdpa.dot_product_attention(q[None], k[None], v[None], scale=1.0 / math.sqrt(d), mask_type=mask,
                                          return_residual=True, **seqlens)
    return out[0].astype(jnp.float32), lse[0].T  # lse [1, H, C] -> [C, H]


def merge(out_a: jax.Array, lse_a: jax.Array, out_b: jax.Array, lse_b: jax.Array) -> jax.Array:
    """Two partial attentions of the same queries over disjoint keys, as one (lse_b finite)."""
    top = jnp.maximum(lse_a, lse_b)
    wa, wb = jnp.exp(lse_a - top)[..., None], jnp.exp(lse_b - top)[..., None]
    return (out_a * wa + out_b * wb) / (wa + wb)


def split_chunk_attention(partial: PartialAttention, q: jax.Array, k_earlier: jax.Array, v_earlier: jax.Array,
                          start: jax.Array, k_chunk: jax.Array, v_chunk: jax.Array) -> jax.Array:
    """Queries q [C, H, D] at positions start.. against the keys at positions < start (the first
    ``start`` rows of k_earlier, v_earlier [S, kv, D]) and their own (k_chunk, v_chunk [C, kv, D],
    causal); returns [C, H, D] in q's dtype.

    Padded queries past the chunk's real end see padded own keys only, never a real query's.
    """
    out_b, lse_b = partial(q, k_chunk, v_chunk, None, True)
    out_a, lse_a = partial(q, k_earlier, v_earlier, start, False)
    # A first chunk has no earlier keys; whatever a kernel returns for an empty key set is unused.
    has_earlier = start > 0
    out_a = jnp.where(has_earlier, out_a, 0.0)
    lse_a = jnp.where(has_earlier, lse_a, -jnp.inf)
    return merge(out_a, lse_a, out_b, lse_b).astype(q.dtype)


def chunk_attention(q: jax.Array, k_earlier: jax.Array, v_earlier: jax.Array, start: jax.Array,
                    k_chunk: jax.Array, v_chunk: jax.Array) -> jax.Array:
    """:func:`split_chunk_attention` in XLA's ops (any platform, any dtype)."""
    return split_chunk_attention(xla_partial, q, k_earlier, v_earlier, start, k_chunk, v_chunk)


def cudnn_chunk_attention(q: jax.Array, k_earlier: jax.Array, v_earlier: jax.Array, start: jax.Array,
                          k_chunk: jax.Array, v_chunk: jax.Array) -> jax.Array:
    """:func:`split_chunk_attention` through cuDNN (16-bit inputs; others go through XLA's ops)."""
    if jnp.dtype(q.dtype).name not in ("bfloat16", "float16"):
        return chunk_attention(q, k_earlier, v_earlier, start, k_chunk, v_chunk)
    return split_chunk_attention(cudnn_partial, q, k_earlier, v_earlier, start, k_chunk, v_chunk)
