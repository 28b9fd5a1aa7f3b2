"""The paged KV pool's two kinds, and the reads and writes every attention path makes of them.

A pool is one layer's K (or V): [num_blocks, kv_heads, block_size, head_dim]. Dense, it is an array
in the model's dtype. In FP8 (:class:`Fp8Pool`) it is e4m3 with a float32 scale per position and KV
head, so a position of a head takes ``head_dim + 4`` bytes instead of ``2 * head_dim``: 1.94 times
the tokens in the same memory at head_dim 128. A scale per position (not per layer) needs no
calibration and follows each token's own range, so no token is clipped and a small one keeps its
precision; it is written with the token and never changes.

The attention paths read and write a pool only through the functions here, which take either kind:
:func:`write` (scatter rows in; FP8 rounds them with their scales), :func:`read` (gather rows out,
dequantized) and :func:`stored` (rows as a pool would give them back, for a chunk's queries to see
its own keys as later steps will).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from switchyard.kernels.fp8 import FP8, dequantize, quantize_rows

KV_DTYPES = ("auto", "fp8")  # the pool in the model's dtype, or FP8 with its scales
FP8_SCALE_BYTES = 4  # one float32 per position and KV head


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Pool:
    """An FP8 pool: ``data`` e4m3 [num_blocks, kv, B, D] and ``scale`` float32 [num_blocks, kv, B]
    (position p of head h holds ``data[.., h, p, :] * scale[.., h, p]``). With a leading stage
    dimension (pipeline stages) both have it. In a tree of partition specs they hold theirs."""

    data: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def dtype(self) -> jnp.dtype:
        return self.data.dtype


Pool = jax.Array | Fp8Pool


def label(kv_dtype: str, dtype: str) -> str:
    """A pool's format for people (the start-up log, ModelInfo): ``dtype``, or FP8 with its scales."""
    return "fp8 e4m3 (float32 scale per position and KV head)" if kv_dtype == "fp8" else dtype


def is_fp8(pool: Any) -> bool:
    return isinstance(pool, Fp8Pool)


def zeros(shape: tuple[int, ...], kv_dtype: str, dtype: Any) -> Pool:
    """A pool of ``shape`` [blocks, kv, B, D] (or with a leading stage dimension): ``dtype`` when
    ``kv_dtype`` is ``auto``, FP8 with zero scales when ``fp8``."""
    if kv_dtype == "fp8":
        return Fp8Pool(jnp.zeros(shape, FP8), jnp.zeros(shape[:-1], jnp.float32))
    if kv_dtype != "auto":
        raise ValueError(f"kv_cache_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    return jnp.zeros(shape, dtype)


def spec_of(pool_spec: Any, kv_dtype: str) -> Any:
    """The partition spec tree of a pool whose data has ``pool_spec`` (the scale drops head_dim,
    which is never sharded)."""
    if kv_dtype != "fp8":
        return pool_spec
    return Fp8Pool(pool_spec, type(pool_spec)(*tuple(pool_spec)[:-1]))


def write(pool: Pool, index: tuple[Any, ...], rows: jax.Array) -> Pool:
    """``pool`` with ``rows`` [..., D] set at ``index`` (which addresses the dimensions before D);
    entries outside the pool are dropped. FP8: each row [D] rounded with a scale of its own."""
    if isinstance(pool, Fp8Pool):
        q, scale = quantize_rows(rows)
        return Fp8Pool(pool.data.at[index].set(q, mode="drop"),
                       pool.scale.at[index].set(scale[..., 0], mode="drop"))
    return pool.at[index].set(rows.astype(pool.dtype), mode="drop")


def read(pool: Pool, index: tuple[Any, ...], dtype: Any | None = None) -> jax.Array:
    """The rows of ``pool`` at ``index`` [..., D]: in the pool's dtype (dense, ``dtype`` None) or
    ``dtype``; FP8 dequantized (to ``dtype``, default float32)."""
    if isinstance(pool, Fp8Pool):
        return dequantize(pool.data[index], pool.scale[index][..., None], dtype or jnp.float32)
    rows = pool[index]
    return rows if dtype is None else rows.astype(dtype)


def stored(pool: Pool, rows: jax.Array) -> jax.Array:
    """``rows`` [..., D] as ``pool`` would give them back once written, in the rows' dtype."""
    if isinstance(pool, Fp8Pool):
        q, scale = quantize_rows(rows)
        return dequantize(q, scale, rows.dtype)
    return rows.astype(pool.dtype).astype(rows.dtype)


def map_pool(fn: Any, pool: Pool) -> Pool:
    """``fn`` applied to each array of ``pool`` (a stage slice, a stage dimension added)."""
    return jax.tree.map(fn, pool)
