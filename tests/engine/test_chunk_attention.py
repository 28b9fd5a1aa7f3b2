"""Prompt chunks' attention, split into their earlier keys (in a paged pool, through a block table)
and their own and merged by log-sum-exp, against a float64 attention over the whole causal context
(one chunk, and several of different sequences side by side); on CPU through XLA's ops, on a GPU
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
from switchyard.service.engine.model import Chunk, _write_chunk_blocks, _write_chunk_positions

POISON = 1e4  # pool positions at or past start, and blocks outside the table: the attention must not read them


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
    """(q, k_earlier, v_earlier [context, kv, dim], k_chunk, v_chunk) with rows at or past start poisoned."""
    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    k_earlier, v_earlier = normal(context, kv, dim), normal(context, kv, dim)
    k_earlier[start:] = POISON
    v_earlier[start:] = POISON
    return tuple(jnp.asarray(a, dtype) for a in (normal(chunk, heads, dim), k_earlier, v_earlier,
                                                  normal(chunk, kv, dim), normal(chunk, kv, dim)))


def _paged(seq: jax.Array, block: int, order: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """A sequence [context, kv, dim] as a pool [blocks, kv, block, dim] whose block order[i] holds its
    block i, the pool's other blocks poisoned; and its block table."""
    context, kv, dim = seq.shape
    n = context // block
    pool = np.full((len(order), kv, block, dim), POISON, np.float32)
    pool[order[:n]] = np.asarray(seq.astype(jnp.float32)).reshape(n, block, kv, dim).transpose(0, 2, 1, 3)
    return jnp.asarray(pool, seq.dtype), jnp.asarray(order[:n], jnp.int32)


def _run(fn, rng, args, start: int, block: int) -> jax.Array:
    """``fn`` on the inputs of :func:`_inputs` as a batch of one chunk, the earlier keys paged in
    shuffled blocks among 3 spare ones."""
    q, k_earlier, v_earlier, k_chunk, v_chunk = args
    order = rng.permutation(k_earlier.shape[0] // block + 3)
    (k_pool, table), (v_pool, _) = _paged(k_earlier, block, order), _paged(v_earlier, block, order)
    one = lambda a: a[None]  # noqa: E731
    return jax.jit(fn, static_argnums=5)(one(q), k_pool, v_pool, one(table), jnp.array([start], jnp.int32),
                                         k_earlier.shape[0], one(k_chunk), one(v_chunk))[0]


def _run_side_by_side(fn, rng, inputs: list[tuple], starts: list[int], block: int) -> jax.Array:
    """``fn`` on several chunks of :func:`_inputs` (one context length) at once, each sequence's
    earlier keys in blocks of its own, all shuffled into one pool with 3 spare blocks."""
    context = inputs[0][1].shape[0]
    n = context // block
    order = rng.permutation(len(inputs) * n + 3)
    pools = []
    for part in (1, 2):
        pool = np.full((len(order), *np.asarray(inputs[0][part]).shape[1:2], block, inputs[0][part].shape[2]), POISON,
                       np.float32)
        for i, args in enumerate(inputs):
            seq = np.asarray(args[part].astype(jnp.float32))
            pool[order[i * n: (i + 1) * n]] = seq.reshape(n, block, *seq.shape[1:]).transpose(0, 2, 1, 3)
        pools.append(jnp.asarray(pool, inputs[0][part].dtype))
    tables = jnp.asarray(np.stack([order[i * n: (i + 1) * n] for i in range(len(inputs))]), jnp.int32)
    stack = lambda j: jnp.stack([args[j] for args in inputs])  # noqa: E731
    return jax.jit(fn, static_argnums=5)(stack(0), *pools, tables, jnp.asarray(starts, jnp.int32), context,
                                         stack(3), stack(4))


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
    out = np.asarray(_run(chunk_attention, rng, args, start, block=8))
    assert np.isfinite(out).all()  # padded queries included
    assert np.abs(out[:length] - expected).max() < 1e-4


def test_chunks_side_by_side_each_match_their_own_float64(rng):
    """Chunks of four sequences in one call (a first chunk among them, and one whose real length is
    1): each attends to its own sequence's keys only."""
    chunk, context, heads, kv, dim = 8, 48, 4, 2, 8
    starts, lengths = [0, 13, 40, 29], [8, 1, 8, 5]
    inputs = [_inputs(rng, chunk, context, s, heads, kv, dim, jnp.float32) for s in starts]
    out = np.asarray(_run_side_by_side(chunk_attention, rng, inputs, starts, block=8))
    assert np.isfinite(out).all()
    for i, (args, start, length) in enumerate(zip(inputs, starts, lengths, strict=True)):
        expected = float64_chunk_attention(*args[:3], start, *args[3:], length)
        assert np.abs(out[i, :length] - expected).max() < 1e-4, i


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
        out = np.asarray(_run(fn, rng, args, start, block=64), np.float64)
        assert np.isfinite(out).all(), fn.__name__
        assert np.abs(out[:length] - expected).max() < 2e-2, fn.__name__


@pytest.mark.gpu
def test_cudnn_chunks_side_by_side_each_match_their_own_float64(rng):
    """Four small chunks of four sequences in one cuDNN call per part, as a step packs short prompts."""
    chunk, context, heads, kv, dim = 64, 1024, 32, 8, 128
    starts, lengths = [0, 960, 448, 64], [64, 1, 33, 64]
    inputs = [_inputs(rng, chunk, context, s, heads, kv, dim, jnp.bfloat16) for s in starts]
    for fn in (cudnn_chunk_attention, chunk_attention):
        out = np.asarray(_run_side_by_side(fn, rng, inputs, starts, block=64), np.float64)
        assert np.isfinite(out).all(), fn.__name__
        for i, (args, start, length) in enumerate(zip(inputs, starts, lengths, strict=True)):
            expected = float64_chunk_attention(*args[:3], start, *args[3:], length)
            assert np.abs(out[i, :length] - expected).max() < 2e-2, (fn.__name__, i)


@pytest.mark.parametrize(("start_block", "length", "chunk"), [(2, 12, 24), (0, 24, 24), (3, 1, 8), (5, 8, 24)])
def test_block_writes_put_each_real_row_where_position_writes_do(rng, start_block, length, chunk):
    """A chunk's K/V written a block at a time (chunks that start on a block boundary) against one
    position at a time: the same values at every real position, no block outside the chunk's real
    ones touched (a table past its end included)."""
    bs, kv, dim, m = 8, 2, 4, 7
    pool = jnp.asarray(rng.standard_normal((12, kv, bs, dim)), jnp.float32)
    table = jnp.asarray(rng.permutation(12)[:m], jnp.int32)
    new = jnp.asarray(rng.standard_normal((chunk, kv, dim)), jnp.float32)
    one = lambda x: jnp.array([x], jnp.int32)  # noqa: E731
    c = Chunk(jnp.zeros((1, chunk), jnp.int32), one(start_block * bs), one(length), table[None], m * bs, True)
    by_block = np.asarray(jax.jit(lambda p, n: _write_chunk_blocks(p, n[None], c))(pool, new))
    by_position = np.asarray(jax.jit(lambda p, n: _write_chunk_positions(p, n[None], c))(pool, new))
    positions = np.arange(start_block * bs, start_block * bs + length)
    blocks, offsets = np.asarray(table)[positions // bs], positions % bs
    assert (by_position[blocks, :, offsets] == np.asarray(new)[:length]).all()
    assert (by_block[blocks, :, offsets] == by_position[blocks, :, offsets]).all()
    untouched = np.setdiff1d(np.arange(12), blocks)
    assert (by_block[untouched] == np.asarray(pool)[untouched]).all()
    assert (by_position[untouched] == np.asarray(pool)[untouched]).all()
