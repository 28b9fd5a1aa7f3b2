"""A prompt chunk's attention, split into its earlier keys and its own and merged by log-sum-exp,
against a float64 attention over the whole causal context; on CPU through XLA's ops, on a GPU
through cuDNN."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from switchyard.service.engine.chunk_attention import (
    chunk_attention,
    cudnn_chunk_attention,
    merge,
    xla_partial,
)

POISON = 1e4  # earlier-key rows at or past start: the attention must not read them


def float64_chunk_attention(q, k_earlier, v_earlier, start, k_chunk, v_chunk, length) -> np.ndarray:
    """Queries at start.. (the first ``length`` real) against keys 0..start-1 and their own, causal."""
    q, ke, ve, kc, vc = (np.asarray(a, np.float64) for a in (q, k_earlier, v_earlier, k_chunk, v_chunk))
    k = np.concatenate([ke[:start], kc])
    v = np.concatenate([ve[:start], vc])
    heads, kv = q.shape[1], k.shape[1]
    k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)
    scores = np.einsum("qhd,shd->hqs", q, k) / np.sqrt(q.shape[2])
    q_pos = start + np.arange(q.shape[0])
    visible = np.arange(k.shape[0])[None, :] <= q_pos[:, None]
    scores = np.where(visible[None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("hqs,shd->qhd", probs, v)[:length]


def _inputs(rng, chunk, context, start, heads, kv, dim, dtype):
    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    k_earlier, v_earlier = normal(context, kv, dim), normal(context, kv, dim)
    k_earlier[start:] = POISON
    v_earlier[start:] = POISON
    return tuple(jnp.asarray(a, dtype) for a in (normal(chunk, heads, dim), k_earlier, v_earlier,
                                                  normal(chunk, kv, dim), normal(chunk, kv, dim)))


@pytest.mark.parametrize(("chunk", "context", "start", "length", "heads", "kv", "dim"), [
    (16, 64, 0, 16, 4, 2, 8),      # a first chunk: no earlier keys
    (16, 64, 0, 5, 4, 1, 8),       # a short first chunk, padded queries after it
    (24, 96, 37, 24, 6, 3, 16),    # awkward sizes everywhere
    (32, 128, 96, 9, 8, 2, 16),    # the last chunk of a prompt, most queries padding
    (8, 200, 199, 8, 2, 2, 32),    # one earlier key short of the bucket
])
def test_split_attention_matches_float64(rng, chunk, context, start, length, heads, kv, dim):
    args = _inputs(rng, chunk, context, start, heads, kv, dim, jnp.float32)
    expected = float64_chunk_attention(*args[:3], start, *args[3:], length)
    out = np.asarray(jax.jit(chunk_attention)(args[0], args[1], args[2], jnp.int32(start), args[3], args[4]))
    assert np.isfinite(out).all()  # padded queries included
    assert np.abs(out[:length] - expected).max() < 1e-4


def test_merge_of_two_halves_is_the_whole(rng):
    q = jnp.asarray(rng.standard_normal((12, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((40, 2, 8)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((40, 2, 8)), jnp.float32)
    whole, whole_lse = xla_partial(q, k, v)
    a, lse_a = xla_partial(q, k[:17], v[:17])
    b, lse_b = xla_partial(q, k[17:], v[17:])
    assert np.abs(np.asarray(merge(a, lse_a, b, lse_b) - whole)).max() < 1e-5
    assert np.abs(np.asarray(jnp.logaddexp(lse_a, lse_b) - whole_lse)).max() < 1e-5


def test_a_query_that_sees_no_key_has_lse_minus_infinity(rng):
    q = jnp.asarray(rng.standard_normal((3, 2, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((5, 1, 8)), jnp.float32)
    out, lse = xla_partial(q, k, k, jnp.int32(0))
    assert np.isneginf(np.asarray(lse)).all() and np.isfinite(np.asarray(out)).all()


@pytest.mark.gpu
@pytest.mark.parametrize(("chunk", "context", "start", "length", "heads", "kv", "dim"), [
    (256, 1024, 512, 256, 32, 8, 128),
    (256, 4096, 2048, 64, 32, 8, 128),     # a cached prefix's remainder
    (64, 320, 77, 50, 8, 2, 64),
    (256, 256, 0, 256, 32, 8, 128),        # a first chunk
    (2048, 4096, 2048, 2048, 32, 8, 128),  # a step with nothing decoding
    (512, 4352, 3840, 512, 32, 8, 128),
])
def test_cudnn_split_attention_matches_float64(rng, chunk, context, start, length, heads, kv, dim):
    args = _inputs(rng, chunk, context, start, heads, kv, dim, jnp.bfloat16)
    expected = float64_chunk_attention(*args[:3], start, *args[3:], length)
    for fn in (cudnn_chunk_attention, chunk_attention):
        out = np.asarray(jax.jit(fn)(args[0], args[1], args[2], jnp.int32(start), args[3], args[4]), np.float64)
        assert np.isfinite(out).all(), fn.__name__
        assert np.abs(out[:length] - expected).max() < 2e-2, fn.__name__
