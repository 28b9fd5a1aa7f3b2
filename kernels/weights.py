"""The weight type that the model's products and the row-parallel kernels take.

A weight is a JAX pytree (a registered dataclass) holding its arrays, so a parameter tree of weights
shards, donates and jits as a tree of arrays does, and adds nothing to a traced program. A weight
knows its products with activations: ``x @ w`` (``__rmatmul__``, so model code reads as it would on an
array) and ``w.split_product(x, splits)`` (float32 partial products over slices of K, which the fused
all-reduce sums as it loads them). Two kinds: dense (a matrix in the model's dtype) and FP8 (e4m3
with float32 scales, :class:`Fp8Weight`), each a dataclass with the same two products and the same
place in the tree, so neither the families nor the calls that take a weight change.

It lives in the kernels package, not the model layer, because the kernels consume it: the
row-parallel product is theirs to write (a quantized product is a kernel's business), and the kernels
may import only jax and numpy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from switchyard.kernels.fp8 import dequantize, quantize_rows


class Weight(Protocol):
    """What the model and the kernels ask of a weight [in, out] (a shard's rows or columns of it)."""

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        """``x @ w`` in x's dtype."""
        ...

    def split_product(self, x: jax.Array, splits: int) -> jax.Array:
        """``x @ w`` as ``splits`` float32 partial products over equal slices of K: [splits, ..., N]."""
        ...


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DenseWeight:
    """A dense matrix [in, out] in the model's dtype. In a tree of shapes or of partition specs (the
    engine's ``param_shapes`` / ``param_specs``) ``w`` holds the matrix's shape or spec instead."""

    w: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.w.shape

    @property
    def dtype(self) -> jnp.dtype:
        return self.w.dtype

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        return x @ self.w

    def split_product(self, x: jax.Array, splits: int) -> jax.Array:
        *lead, k = x.shape
        if splits < 1 or k % splits:
            raise ValueError(f"cannot split K = {k} into {splits} equal slices")
        xs = x.reshape(*lead, splits, k // splits)
        ws = self.w.reshape(splits, k // splits, self.w.shape[-1])
        return jnp.einsum("...sk,skn->s...n", xs, ws, preferred_element_type=jnp.float32)


def _dot_nt(x: jax.Array, w: jax.Array, out_dtype: Any = jnp.float32) -> jax.Array:
    """``x [..., K] . w [N, K]^T`` in ``out_dtype``: the weight as the checkpoints store it ([out, in], K
    contiguous), the layout cuBLASLt's FP8 GEMM takes (no transpose of the weight in the step)."""
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=out_dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    """An FP8 matrix [in, out] with its scales, stored as FP8 checkpoints store it: ``w`` e4m3 [out,
    in] and ``scale`` float32 [out, groups]: column n, rows ``g * block_k .. (g + 1) * block_k - 1``
    of the matrix are ``w[n, k] * scale[n, g]``. ``block_k`` 0: one group over all of K (a scale per
    output channel; a per-tensor scale is one repeated). Block-wise checkpoints (128 x 128 blocks)
    have their block scales repeated over each block's output channels, so that any slice of the
    output channels is a weight of its own (the column-parallel shards).

    Two products, chosen per call by the rows of the activation (static when traced):

    * fewer than ``w8a8_min_rows`` rows (or ``w8a8_min_rows`` 0, or block scales): W8A16, the
      weight converted to the activation's dtype in the program (the weight is only ever held in
      FP8; whether XLA fuses the conversion into the GEMM's operand load or writes the converted
      weight first is what benchmarks/fp8.py measures), the per-channel scale applied to the float32
      result, or the block scales to the converted weight;
    * from ``w8a8_min_rows`` rows on: W8A8, the activation quantized to e4m3 with a scale per token
      and an e4m3 x e4m3 dot (cuBLASLt's FP8 GEMM on Hopper) writing the activation's dtype, both
      scales applied to that in float32. Block-scaled weights never take it: a scale per block of K
      would need the scales inside the GEMM's K loop, which XLA's FP8 GEMM does not do.

    In a tree of shapes or of partition specs ``w`` and ``scale`` hold theirs."""

    w: jax.Array
    scale: jax.Array
    block_k: int = dataclasses.field(default=0, metadata={"static": True})
    w8a8_min_rows: int = dataclasses.field(default=0, metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        """The matrix's shape [in, out] (the product's view, as a dense weight's)."""
        return (self.w.shape[1], self.w.shape[0])

    @property
    def dtype(self) -> jnp.dtype:
        return self.w.dtype

    def dequantized(self, dtype: Any) -> jax.Array:
        """The matrix [out, in] in ``dtype``: each e4m3 value times its scale (in float32, rounded once)."""
        if not self.block_k:
            return dequantize(self.w, self.scale, dtype)
        k = self.w.shape[1]
        return dequantize(self.w, jnp.repeat(self.scale, self.block_k, axis=1)[:, :k], dtype)

    def runs_w8a8(self, x: jax.Array) -> bool:
        """Whether ``x @ w`` runs FP8 x FP8 (class docstring)."""
        rows = math.prod(x.shape[:-1])
        return self.w8a8_min_rows > 0 and rows >= self.w8a8_min_rows and not self.block_k

    def _product(self, x: jax.Array) -> jax.Array:
        if self.runs_w8a8(x):
            # The GEMM writes the activation's dtype: half float32's bytes, written and read again by
            # the scaling (a 4096-token prompt 12% faster on an H200, benchmarks/NOTES.md).
            xq, x_scale = quantize_rows(x)
            return _dot_nt(xq, self.w, x.dtype).astype(jnp.float32) * x_scale * self.scale[:, 0]
        if self.block_k:
            return _dot_nt(x, self.dequantized(x.dtype))
        return _dot_nt(x, self.w.astype(x.dtype)) * self.scale[:, 0]

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        return self._product(x).astype(x.dtype)

    def split_product(self, x: jax.Array, splits: int) -> jax.Array:
        *lead, k = x.shape
        if splits < 1 or k % splits:
            raise ValueError(f"cannot split K = {k} into {splits} equal slices")
        n = self.w.shape[0]

        def partials(a: jax.Array, w: jax.Array) -> jax.Array:
            return jnp.einsum("...sk,nsk->s...n", a.reshape(*lead, splits, k // splits),
                              w.reshape(n, splits, k // splits), preferred_element_type=jnp.float32)

        if self.runs_w8a8(x):
            # One scale per token over the whole of K, so the slices' sum is the whole product's.
            xq, x_scale = quantize_rows(x)
            return partials(xq, self.w) * x_scale * self.scale[:, 0]
        if self.block_k:
            return partials(x, self.dequantized(x.dtype))
        return partials(x, self.w.astype(x.dtype)) * self.scale[:, 0]


def quantize_weight(w: jax.Array, w8a8_min_rows: int = 0) -> Fp8Weight:
    """A dense matrix [in, out] as an FP8 weight with a scale per output channel (quantize on load)."""
    q, scale = quantize_rows(w.T, axis=-1)
    return Fp8Weight(q, scale, 0, w8a8_min_rows)


def with_w8a8_min_rows(tree: Any, rows: int) -> Any:
    """``tree`` (a parameter tree, or one of its shapes or specs) with every FP8 weight's product
    policy set to ``rows`` (``Fp8Weight.w8a8_min_rows``); the arrays are shared."""
    return jax.tree.map(lambda w: dataclasses.replace(w, w8a8_min_rows=rows) if isinstance(w, Fp8Weight) else w,
                        tree, is_leaf=lambda w: isinstance(w, Fp8Weight))


def as_weight(w: Weight | jax.Array | np.ndarray) -> Weight:
    """``w`` as a weight: a bare matrix becomes a dense one (callers that hold arrays keep working)."""
    return DenseWeight(w) if isinstance(w, (jax.Array, np.ndarray)) else w
