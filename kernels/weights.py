"""The weight type that the model's products and the row-parallel kernels take.

A weight is a JAX pytree (a registered dataclass) holding its arrays, so a parameter tree of weights
shards, donates and jits as a tree of arrays does, and adds nothing to a traced program. A weight
knows its products with activations: ``x @ w`` (``__rmatmul__``, so model code reads as it would on an
array) and ``w.split_product(x, splits)`` (float32 partial products over slices of K, which the fused
all-reduce sums as it loads them). Dense is the only kind today; a quantized weight (FP8 with its
scales) is another dataclass with the same two products and the same place in the tree, so neither
the families nor the calls that take a weight change.

It lives in the kernels package, not the model layer, because the kernels consume it: the
row-parallel product is theirs to write (a quantized product is a kernel's business), and the kernels
may import only jax and numpy.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np


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


def as_weight(w: Weight | jax.Array | np.ndarray) -> Weight:
    """``w`` as a weight: a bare matrix becomes a dense one (callers that hold arrays keep working)."""
    return DenseWeight(w) if isinstance(w, (jax.Array, np.ndarray)) else w
