"""The forward pass of a token-budget step, written for one tensor-parallel shard (it runs inside
``jax.shard_map``): one pass over a flat batch of decode rows and prompt chunks, over a paged KV pool,
built from the model layer's shared layers (``service/model/layers.py``); every family
(``service/model``) runs through it, its extra tensors applied by ``layers.qkv_projection``.

Megatron layout: QKV and gate/up are column-parallel (each shard owns whole heads / a slice of the
intermediate dimension), the attention output and down projections are row-parallel and followed
by one all-reduce each, which the collective layer fuses with the residual add and the next RMSNorm.
Weights are stored one array per layer and per matrix ([in, out] layout): a step reads each once,
with no dynamic slicing of stacked weights (which would make XLA copy them).

Parameter tree (global shapes; ``tp`` shards, ``c = (q_local + 2 kv_local) * head_dim``). The four
matrices of a layer are weights (``switchyard.kernels.weights``: dense, or FP8 with its scales, held
[out, in] as ``param_formats`` says); the rest are arrays::

    embed [vocab, hidden]                      replicated (rows are gathered)
    layers[i].attn_norm [hidden]               replicated
    layers[i].wqkv [hidden, tp * c]            weight; columns: shard r holds [q_r | k_r | v_r]
    layers[i].bqkv [tp * c]                    (QKV bias: Qwen2) shard r holds [q_r | k_r | v_r]
    layers[i].q_norm, k_norm [head_dim]        (per-head q/k norm: Qwen3) replicated
    layers[i].wo [heads * head_dim, hidden]    weight; rows by head
    layers[i].mlp_norm [hidden]                replicated
    layers[i].wgu [hidden, tp * 2 * inter/tp]  weight; columns: shard r holds [gate_r | up_r]
    layers[i].wdown [inter, hidden]            weight; rows
    final_norm [hidden]                        replicated
    lm_head [hidden, padded_vocab]             columns (vocabulary-parallel logits)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from switchyard.kernels import attention, kv_cache, rmsnorm, row_parallel_residual, row_parallel_residual_rmsnorm
from switchyard.service.engine import param_formats
from switchyard.service.engine.chunk_attention import chunk_attention, cudnn_chunk_attention
from switchyard.service.engine.param_formats import LayerFormats
from switchyard.service.model.layers import embed, qkv_projection, rope_inv_freq, swiglu
from switchyard.service.modelspec import ModelSpec

AXIS = "tp"
Params = dict[str, Any]
# (a, w (a weight), residual, norm weight, eps, axis, strategy) -> (residual + all_reduce(a @ w), its RMSNorm)
RowParallelNorm = Callable[..., tuple[jax.Array, jax.Array]]
# (a, w, residual, axis, strategy) -> residual + all_reduce(a @ w)
RowParallel = Callable[..., jax.Array]
# (qkv, k_pool, v_pool, block_tables, positions, write_at) -> (out, k_pool, v_pool)
PagedDecodeAttention = Callable[..., tuple[jax.Array, jax.Array, jax.Array]]
# (q [K, C, H, D], k_pool, v_pool [blocks, kv, B, D], table [K, M], start [K], kv_len (static), k_chunk,
# v_chunk [K, C, kv, D]) -> out [K, C, H, D]: K prompt chunks' queries, each against its sequence's keys
# before its start (in the pools) and, causally, its own
ChunkAttention = Callable[..., jax.Array]


@dataclasses.dataclass(frozen=True)
class ShardShape:
    """Per-shard sizes for a model at a tensor-parallel degree."""

    spec: ModelSpec
    tp: int
    vocab_shards: int = 0  # devices the LM head's vocabulary is split over (default: tp)

    def __post_init__(self) -> None:
        s = self.spec
        if not s.valid_tp(self.tp):
            raise ValueError(
                f"tensor-parallel size {self.tp} must divide both the attention heads ({s.num_heads}) and "
                f"the KV heads ({s.num_kv_heads}) of {s.name}")
        if s.intermediate_size % self.tp:
            raise ValueError(f"tensor-parallel size {self.tp} must divide intermediate_size {s.intermediate_size}")

    @property
    def q_heads(self) -> int:
        return self.spec.num_heads // self.tp

    @property
    def kv_heads(self) -> int:
        return self.spec.num_kv_heads // self.tp

    @property
    def qkv_cols(self) -> int:
        return (self.q_heads + 2 * self.kv_heads) * self.spec.head_dim

    @property
    def inter(self) -> int:
        return self.spec.intermediate_size // self.tp

    @property
    def padded_vocab(self) -> int:
        shards = self.vocab_shards or self.tp
        return math.ceil(self.spec.vocab_size / shards) * shards


def _formats(spec: ModelSpec, formats: Sequence[LayerFormats] | None) -> Sequence[LayerFormats]:
    if formats is None:
        return param_formats.uniform(spec.num_layers, param_formats.DENSE)
    if len(formats) != spec.num_layers:
        raise ValueError(f"{len(formats)} layers' weight formats for the {spec.num_layers} layers of {spec.name}")
    return formats


def param_specs(spec: ModelSpec, formats: Sequence[LayerFormats] | None = None) -> Params:
    """The parameter tree's partition specs (a weight's spec is that weight holding its arrays'), its
    matrices in ``formats`` (one mapping per layer; default: dense)."""
    layers = []
    for fmt in _formats(spec, formats):
        layer: Params = {"attn_norm": P(), "mlp_norm": P(),
                         **{name: param_formats.spec_leaf(name, fmt[name]) for name in param_formats.MATRICES}}
        if spec.attention_bias:
            layer["bqkv"] = P(AXIS)
        if spec.qk_norm:
            layer["q_norm"] = layer["k_norm"] = P()
        layers.append(layer)
    return {"embed": P(), "layers": layers, "final_norm": P(), "lm_head": P(None, AXIS)}


def matrix_shapes(shape: ShardShape) -> dict[str, tuple[int, int]]:
    """Each layer matrix's global [in, out]."""
    s, tp = shape.spec, shape.tp
    return {"wqkv": (s.hidden_size, tp * shape.qkv_cols), "wo": (s.q_size, s.hidden_size),
            "wgu": (s.hidden_size, 2 * s.intermediate_size), "wdown": (s.intermediate_size, s.hidden_size)}


def param_shapes(shape: ShardShape, formats: Sequence[LayerFormats] | None = None) -> Params:
    """The parameter tree's global shapes, as tuples (a weight's: that weight holding its arrays'),
    its matrices in ``formats`` (default: dense)."""
    s, tp = shape.spec, shape.tp
    matrices = matrix_shapes(shape)
    layers = []
    for fmt in _formats(s, formats):
        layer: Params = {"attn_norm": (s.hidden_size,), "mlp_norm": (s.hidden_size,),
                         **{name: param_formats.shape_leaf(name, fmt[name], matrices[name])
                            for name in param_formats.MATRICES}}
        if s.attention_bias:
            layer["bqkv"] = (tp * shape.qkv_cols,)
        if s.qk_norm:
            layer["q_norm"] = layer["k_norm"] = (s.head_dim,)
        layers.append(layer)
    return {"embed": (s.vocab_size, s.hidden_size), "layers": layers,
            "final_norm": (s.hidden_size,), "lm_head": (s.hidden_size, shape.padded_vocab)}


def is_shape(x: Any) -> bool:
    """A leaf of ``param_shapes``' tree (a shape tuple)."""
    return isinstance(x, tuple)


def stage_stacked(shapes: Params, specs: Params, stages: int, axis: str) -> tuple[Params, Params]:
    """One layer's shapes and specs with a leading stage dimension sharded over ``axis`` (pipeline
    stages: entry j of ``layers`` holds, on stage s, layer ``s * layers_per_stage + j``)."""
    return (jax.tree.map(lambda shp: (stages, *shp), shapes, is_leaf=is_shape),
            jax.tree.map(lambda ps: P(axis, *ps), specs))


# ---- forward passes (per shard) ------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ForwardConfig:
    """How the forward pass runs on one shard. The engine builds it from its public configuration
    (``engine.EngineConfig``): the callables' defaults are the product's."""

    shape: ShardShape
    strategy: str
    inv_freq: tuple[float, ...]
    # Row-parallel product, all-reduce, residual add and RMSNorm (the fused kernel where it runs).
    row_parallel_norm: RowParallelNorm = row_parallel_residual_rmsnorm
    # Row-parallel product, all-reduce and residual add: a pipeline stage's last layer.
    row_parallel: RowParallel = row_parallel_residual
    # Decode attention over a paged KV pool (block tables) through the CUDA kernel where it can run
    # (XLA's ops elsewhere): faster than XLA's ops, or within 1%, at every batch and context measured
    # (benchmarks/NOTES.md).
    paged_decode_attention: PagedDecodeAttention = attention.paged_decode_attention_packed
    # A prompt chunk's queries against its sequence's keys so far (see make()).
    chunk_attention: ChunkAttention | None = None

    @classmethod
    def make(cls, shape: ShardShape, strategy: str, platform: str = "cpu") -> ForwardConfig:
        """The product's configuration; on CUDA devices prompt chunks attend through cuDNN's flash
        attention (chosen here: tracing the cuDNN call needs cuDNN present)."""
        return cls(shape, strategy, tuple(float(f) for f in rope_inv_freq(shape.spec)),
                   chunk_attention=cudnn_chunk_attention if platform in ("gpu", "cuda") else chunk_attention)


def _qkv(h: jax.Array, layer: Params, positions: jax.Array, cfg: ForwardConfig) -> jax.Array:
    """The shard's packed, roped [n, q + 2 kv, head_dim] (``layers.qkv_projection``)."""
    shape = cfg.shape
    return qkv_projection(h, layer, positions, jnp.asarray(cfg.inv_freq, jnp.float32), shape.spec,
                          shape.q_heads, shape.kv_heads)


def run_layers(
    x: jax.Array, layers: list[Params], cfg: ForwardConfig, attention, final_norm: jax.Array | None,
    last_rows: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Runs ``layers`` on the residual stream ``x``; ``attention(i, h)`` returns the shard's partial
    attention output for layer i. Returns the residual stream and, with ``final_norm``, its RMSNorm.

    Each all-reduce is fused with the residual add and the norm that follows it; a pipeline stage
    that does not end the model hands on the residual stream un-normed (the next norm is the next
    stage's).

    ``last_rows`` (indices): the only rows whose output is wanted. The last layer still runs its
    attention over every row (each row's K/V must reach the cache), then its output projection and
    MLP over these rows alone, and the result has only these rows: a prompt chunk needs the output
    of its last position only.
    """
    eps = cfg.shape.spec.rms_norm_eps
    residual = x
    h = rmsnorm(x, layers[0]["attn_norm"], eps)
    for i, layer in enumerate(layers):
        out = attention(i, h)
        if last_rows is not None and i == len(layers) - 1:
            out, residual = out[last_rows], residual[last_rows]
        residual, h = cfg.row_parallel_norm(out, layer["wo"], residual, layer["mlp_norm"], eps, AXIS, cfg.strategy)
        act = swiglu(h, layer, cfg.shape.inter)
        next_norm = layers[i + 1]["attn_norm"] if i + 1 < len(layers) else final_norm
        if next_norm is None:
            return cfg.row_parallel(act, layer["wdown"], residual, AXIS, cfg.strategy), None
        residual, h = cfg.row_parallel_norm(act, layer["wdown"], residual, next_norm, eps, AXIS, cfg.strategy)
    return residual, h


# ---- paged KV pool: token-budget steps ------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Chunk:
    """The prompt chunks a step carries (traced arrays), K of them (K static, most often 1): chunk j
    is ``tokens[j]`` [C] padded, the first ``length[j]`` real, at positions ``start[j]..start[j] +
    length[j] - 1`` of the sequence whose block table is ``table[j]`` [M]. A chunk of length 0
    computes padding and writes nothing. ``kv_len`` (static) covers every position each attends to."""

    tokens: jax.Array  # int32 [K, C]
    start: jax.Array  # int32 [K]
    length: jax.Array  # int32 [K]
    table: jax.Array  # int32 [K, M]
    kv_len: int
    block_aligned: bool = False  # (static) every start is a multiple of the block size

    @property
    def positions(self) -> jax.Array:
        """Every chunk row's position, [K * C], in the order of :attr:`flat_tokens`."""
        return (self.start[:, None] + jnp.arange(self.tokens.shape[1])[None, :]).reshape(-1)

    @property
    def flat_tokens(self) -> jax.Array:
        return self.tokens.reshape(-1)

    def last_rows(self, first: int) -> jax.Array:
        """The rows, counted from ``first`` (where the chunks begin in the step's batch), of each
        chunk's last real token (its first row when it has none)."""
        c = self.tokens.shape[1]
        return first + jnp.arange(self.tokens.shape[0]) * c + jnp.maximum(self.length, 1) - 1


def _split_chunk_qkv(qkv: jax.Array, chunk: Chunk, cfg: ForwardConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The chunks' rows of qkv [K * C, q + 2 kv, hd] (roped) as q [K, C, q, hd], k and v [K, C, kv, hd]."""
    q_heads, kv = cfg.shape.q_heads, cfg.shape.kv_heads
    qkv = qkv.reshape(*chunk.tokens.shape, *qkv.shape[1:])
    return qkv[:, :, :q_heads], qkv[:, :, q_heads: q_heads + kv], qkv[:, :, q_heads + kv:]


def _write_chunk_kv(k_new: jax.Array, v_new: jax.Array, k_pool: kv_cache.Pool, v_pool: kv_cache.Pool,
                    chunk: Chunk) -> tuple[kv_cache.Pool, kv_cache.Pool]:
    """The chunks' K/V [K, C, kv, hd] written into their blocks."""
    write = _write_chunk_blocks if chunk.block_aligned else _write_chunk_positions
    return write(k_pool, k_new, chunk), write(v_pool, v_new, chunk)


def _chunk_layer_attention(q: jax.Array, k_new: jax.Array, v_new: jax.Array, k_pool: kv_cache.Pool,
                           v_pool: kv_cache.Pool, chunk: Chunk, cfg: ForwardConfig) -> jax.Array:
    """The chunks' attention in one layer: each chunk's queries q [K, C, q, hd] against its sequence's
    earlier keys (read from its blocks, positions before its start) and its own, k_new and v_new [K,
    C, kv, hd] (roped); returns [K * C, q, hd]. The pools may already hold the chunks' own K/V: no
    query reads them there."""
    attend = cfg.chunk_attention or chunk_attention
    # The chunks' own K/V as the pool stores them, so their queries see what later steps will read.
    out = attend(q, k_pool, v_pool, chunk.table, chunk.start, chunk.kv_len, kv_cache.stored(k_pool, k_new),
                 kv_cache.stored(v_pool, v_new))
    return out.reshape(-1, *out.shape[2:])


def _write_chunk_positions(pool: kv_cache.Pool, new: jax.Array, chunk: Chunk) -> kv_cache.Pool:
    """The chunks' real rows of ``new`` [K, C, kv, D] into the pool at their positions, one by one."""
    nb, _, bs, _ = pool.shape
    m = chunk.table.shape[1]
    k_chunks, c = new.shape[:2]
    pos = chunk.start[:, None] + jnp.arange(c)[None, :]  # [K, C]
    real = jnp.arange(c)[None, :] < chunk.length[:, None]
    block = jnp.where(real, jnp.take_along_axis(chunk.table, jnp.minimum(pos // bs, m - 1), axis=1), nb)  # nb: dropped
    return kv_cache.write(pool, (block.reshape(-1), slice(None), (pos % bs).reshape(-1)),
                          new.reshape(k_chunks * c, *new.shape[2:]))


def _write_chunk_blocks(pool: kv_cache.Pool, new: jax.Array, chunk: Chunk) -> kv_cache.Pool:
    """``new`` [K, C, kv, D] into the pool a whole block at a time, for chunks that start on a block
    boundary. Every block holding a real row is written whole: its positions past the chunk's end
    (only a prompt's last chunk has them) are the sequence's own, written again before they are read."""
    nb, kv, bs, d = pool.shape
    m = chunk.table.shape[1]
    k_chunks, c = new.shape[:2]
    n = -(-c // bs)
    blocks = jnp.pad(new, ((0, 0), (0, n * bs - c), (0, 0), (0, 0))).reshape(k_chunks, n, bs, kv, d)
    blocks = blocks.transpose(0, 1, 3, 2, 4).reshape(k_chunks * n, kv, bs, d)
    index = chunk.start[:, None] // bs + jnp.arange(n)[None, :]  # [K, n]
    real = (index * bs < (chunk.start + chunk.length)[:, None]) & (index < m)
    block = jnp.where(real, jnp.take_along_axis(chunk.table, jnp.minimum(index, m - 1), axis=1), nb)
    return kv_cache.write(pool, (block.reshape(-1),), blocks)


def budget_layers(
    x: jax.Array,
    layers: list[Params],
    k_pool: list[jax.Array],
    v_pool: list[jax.Array],
    positions: jax.Array,
    tables: jax.Array,
    write: jax.Array,
    chunk: Chunk | None,
    cfg: ForwardConfig,
    final_norm: jax.Array | None,
    last_rows: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None, list[jax.Array], list[jax.Array]]:
    """``layers`` of one token-budget step on its residual stream x [n (+ C), hidden]: a token for each
    of the ``n`` decode rows (positions, write [n], block tables [n, M]; rows where ``write`` is False
    neither write nor matter) then, when given, the chunks' K * C tokens. Pools: per layer [blocks,
    kv_heads_local, block_size, head_dim]. Returns (residual, its norm with ``final_norm`` or None,
    pools); ``last_rows`` as in :func:`run_layers`."""
    shape = cfg.shape
    n = positions.shape[0]
    hd = shape.spec.head_dim
    new_k, new_v = list(k_pool), list(v_pool)
    write_at = jnp.where(write, positions, tables.shape[1] * k_pool[0].shape[2])
    all_pos = positions if chunk is None else jnp.concatenate([positions, chunk.positions])

    # Rows that do not write are idle slots whose positions are stale: attending to one position
    # keeps each from costing the attention over a whole earlier sequence.
    attend_to = jnp.where(write, positions, 0)

    def layer_attention(i: int, h: jax.Array) -> jax.Array:
        qkv = _qkv(h, layers[i], all_pos, cfg)
        # Every write to a layer's pools comes before every read of them that is not the writer's own,
        # each taking the one before's result: XLA then updates the pools in place. A read that could
        # run before a write would make XLA copy the whole pool first (two copies a layer per step).
        if chunk is not None:
            c_q, c_k, c_v = _split_chunk_qkv(qkv[n:], chunk, cfg)
            new_k[i], new_v[i] = _write_chunk_kv(c_k, c_v, new_k[i], new_v[i], chunk)
        out, new_k[i], new_v[i] = cfg.paged_decode_attention(qkv[:n], new_k[i], new_v[i], tables, attend_to,
                                                             write_at)
        if chunk is not None:
            c_out = _chunk_layer_attention(c_q, c_k, c_v, new_k[i], new_v[i], chunk, cfg)
            out = jnp.concatenate([out.astype(h.dtype), c_out.astype(h.dtype)])
        return out.reshape(h.shape[0], shape.q_heads * hd).astype(h.dtype)

    residual, h = run_layers(x, layers, cfg, layer_attention, final_norm, last_rows)
    return residual, h, new_k, new_v


def budget_forward(
    params: Params,
    k_pool: list[jax.Array],
    v_pool: list[jax.Array],
    tokens: jax.Array,
    positions: jax.Array,
    tables: jax.Array,
    write: jax.Array,
    chunk: Chunk | None,
    cfg: ForwardConfig,
) -> tuple[jax.Array, list[jax.Array], list[jax.Array]]:
    """One token-budget step over a paged pool, in one forward pass: a token for each of the ``n``
    decode rows plus, when given, K prompt chunks (:func:`budget_layers`). Returns local logits
    [n + K, padded_vocab / tp] (row n + j: chunk j's last real position; [n, ...] without chunks)
    and the pools.
    """
    n = tokens.shape[0]
    all_tokens = tokens if chunk is None else jnp.concatenate([tokens, chunk.flat_tokens])
    # Logits are wanted for the decode rows and each chunk's last real position only.
    last_rows = None if chunk is None else jnp.concatenate([jnp.arange(n), chunk.last_rows(n)])
    _, h, new_k, new_v = budget_layers(embed(params["embed"], all_tokens), params["layers"], k_pool, v_pool,
                                       positions, tables, write, chunk, cfg, params["final_norm"], last_rows)
    logits = jnp.dot(h, params["lm_head"], preferred_element_type=jnp.float32)
    return logits, new_k, new_v
