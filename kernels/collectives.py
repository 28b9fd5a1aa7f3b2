"""Python API of the collectives, usable inside ``jax.shard_map``.

``all_reduce`` and ``all_reduce_residual_rmsnorm`` take a strategy: ``xla`` (psum; NCCL on GPU),
``oneshot``, ``twoshot`` or ``auto`` (see ``selection.py``). The custom kernels are per-device XLA
FFI custom calls placed inside the shard_map body; they are staged through
``lax.platform_dependent``, so the same traced program lowers to the pure-JAX reference on CPU
and to the kernels on CUDA. Where the kernels cannot run (no library, no peer access, an axis that
is not the registered GPU group, unsupported dtype, too large a message, ``check_vma=True``),
the reference path runs, with identical semantics.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from switchyard.kernels import native
from switchyard.kernels.selection import STRATEGIES, check_strategy, choose, choose_fused
from switchyard.kernels.weights import Weight, as_weight

__all__ = ["MAX_PARTIALS", "STRATEGIES", "all_reduce", "all_reduce_residual_rmsnorm", "plan", "rmsnorm",
           "split_product"]

MAX_PARTIALS = 4  # kMaxPartials in csrc/fused_rmsnorm.cuh


def split_product(x: jax.Array, w: Weight | jax.Array, splits: int) -> jax.Array:
    """``x @ w`` as ``splits`` float32 partial products over equal slices of K: [splits, ..., N].

    Their sum (rounded to x's dtype) is the product. The fused all-reduce takes them as they are: at
    decode sizes XLA runs its own split-K GEMM for ``x @ w`` and sums the partials in a kernel of
    their own in front of a custom call (benchmarks/NOTES.md); written this way, one batched GEMM.
    ``w``: a weight (``weights.py``) or a bare matrix.
    """
    return as_weight(w).split_product(x, splits)


def rmsnorm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as Llama computes it: statistics in float32, scaled in the input dtype."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def _reference_residual_rmsnorm(
    x: jax.Array, residual: jax.Array, weight: jax.Array, eps: float, axis: str
) -> tuple[jax.Array, jax.Array]:
    new_residual = residual + jax.lax.psum(x, axis).astype(residual.dtype)
    return new_residual, rmsnorm(new_residual, weight, eps)


def _vma_checked() -> bool:
    """True inside ``shard_map(check_vma=True)``: the kernels' outputs carry no replication type
    there, so the reference path (whose psum does) is used instead."""
    try:
        from jax._src import config as jax_config

        return bool(jax_config._check_vma.value)
    except (ImportError, AttributeError):
        return True


def plan(kind: str, strategy: str, x: jax.Array, axis: str) -> str:
    """The implementation that ``all_reduce`` (kind ``allreduce``) or the fused op (``fused``)
    will stage for ``x`` (the per-device shard) over ``axis``. Must run inside shard_map."""
    check_strategy(strategy)
    world = jax.lax.axis_size(axis)
    if strategy == "xla" or world == 1:  # a sum over one device moves nothing: no kernel, no workspace
        return "xla"
    nbytes = int(np.prod(x.shape, dtype=np.int64)) * jnp.dtype(x.dtype).itemsize
    cap = native.capability()
    if _vma_checked():
        return "xla"
    chooser = choose if kind == "allreduce" else choose_fused
    return chooser(strategy, nbytes, world, jnp.dtype(x.dtype).name, cap)


def _ffi_all_reduce(impl: str, x: jax.Array) -> jax.Array:
    return jax.ffi.ffi_call(f"switchyard_{impl}", jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


def _ffi_fused(x: jax.Array, residual: jax.Array, weight: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    out = jax.ShapeDtypeStruct(residual.shape, residual.dtype)
    new_residual, normed = jax.ffi.ffi_call("switchyard_fused_rmsnorm", (out, out))(
        x, residual, weight, eps=np.float32(eps)
    )
    return new_residual, normed


def _staged_all_reduce(impl: str, x: jax.Array, axis: str) -> jax.Array:
    if impl == "xla":
        return jax.lax.psum(x, axis)
    return jax.lax.platform_dependent(
        x, default=lambda v: jax.lax.psum(v, axis), cuda=lambda v: _ffi_all_reduce(impl, v)
    )


def all_reduce(x: jax.Array, axis: str, strategy: str = "xla") -> jax.Array:
    """Sum ``x`` over the mesh axis ``axis`` (inside ``jax.shard_map``)."""
    return _staged_all_reduce(plan("allreduce", strategy, x, axis), x, axis)


def all_reduce_residual_rmsnorm(
    x: jax.Array, residual: jax.Array, weight: jax.Array, eps: float, axis: str, strategy: str = "xla"
) -> tuple[jax.Array, jax.Array]:
    """``residual + all_reduce(x)`` and its RMSNorm: returns ``(new_residual, normed)``.

    ``x`` is this device's contribution, shaped like ``residual``, or up to ``MAX_PARTIALS`` float32
    partial products [S, ...residual shape] (``split_product``) whose sum, rounded to the residual's
    dtype, is the contribution: the fused kernel sums them as it loads them.
    The fused kernel needs x (or its sum), residual and weight of one dtype and ``weight.shape ==
    residual.shape[-1:]``; otherwise the all-reduce alone uses the custom kernel.
    """
    partials = x.ndim == residual.ndim + 1
    if partials and not (x.dtype == jnp.float32 and 1 <= x.shape[0] <= MAX_PARTIALS and x.shape[1:] == residual.shape):
        raise ValueError(f"partial products must be float32 [S <= {MAX_PARTIALS}, *{residual.shape}], "
                         f"got {x.dtype} {x.shape}")

    def contribution(v: jax.Array) -> jax.Array:
        return v.sum(0).astype(residual.dtype) if partials else v

    fusable = (
        residual.ndim >= 1
        and (partials or (residual.shape == x.shape and x.dtype == residual.dtype))
        and weight.shape == residual.shape[-1:]
        and residual.dtype == weight.dtype
    )
    impl = plan("fused", strategy, residual, axis) if fusable else plan("allreduce", strategy, residual, axis)
    if impl == "fused":

        def reference(x, residual, weight):
            return _reference_residual_rmsnorm(contribution(x), residual, weight, eps, axis)

        def kernel(x, residual, weight):
            return _ffi_fused(x, residual, weight, eps)

        return jax.lax.platform_dependent(x, residual, weight, default=reference, cuda=kernel)
    # Not fused: all-reduce (custom or psum), then residual add and RMSNorm in XLA.
    reduced = _staged_all_reduce(impl, contribution(x), axis)
    new_residual = residual + reduced.astype(residual.dtype)
    return new_residual, rmsnorm(new_residual, weight, eps)


# ---- the row-parallel product of a tensor-parallel layer, summed over the GPUs --------------------
# Partial products per row-parallel product for the fused kernel: 4 and 8 were equally fast, and 4
# keeps the kernel's loads per pack fewer (benchmarks/NOTES.md).
K_SPLITS = 4
# Rows from which the product is written as partial products. For one row XLA (jax 0.11.2, H100) runs
# the batched product as a float32 conversion and transpose of the whole weight shard plus a
# reduction: 61 + 48 us a layer at TP=2, where the plain product's GEMM took 39 (benchmarks/NOTES.md).
SPLIT_MIN_ROWS = 2


def row_parallel_residual_rmsnorm(
    a: jax.Array, w: Weight | jax.Array, residual: jax.Array, weight: jax.Array, eps: float, axis: str,
    strategy: str = "xla", *, k_splits: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``residual + all_reduce(a @ w)`` and its RMSNorm: returns ``(new_residual, normed)``.

    ``a @ w`` is this device's share of a row-parallel product (``w``, a weight or a bare matrix,
    holds rows of the weight). Where
    the fused kernel runs, the product is written as ``k_splits`` float32 partial products over
    slices of K (``split_product``, default ``K_SPLITS``), which the kernel sums as it loads them; with
    ``k_splits=1``, fewer than ``SPLIT_MIN_ROWS`` rows, a K that does not divide, or no fused kernel, it
    is a plain dot.
    """
    splits = K_SPLITS if k_splits is None else k_splits
    if not 1 <= splits <= MAX_PARTIALS:
        raise ValueError(f"k_splits must be 1..{MAX_PARTIALS}, got {splits}")
    rows = math.prod(a.shape[:-1])
    if (splits > 1 and rows >= SPLIT_MIN_ROWS and a.shape[-1] % splits == 0
            and plan("fused", strategy, residual, axis) == "fused"):
        return all_reduce_residual_rmsnorm(split_product(a, w, splits), residual, weight, eps, axis, strategy)
    return all_reduce_residual_rmsnorm(a @ w, residual, weight, eps, axis, strategy)


def row_parallel_residual(
    a: jax.Array, w: Weight | jax.Array, residual: jax.Array, axis: str, strategy: str = "xla"
) -> jax.Array:
    """``residual + all_reduce(a @ w)``, with no norm after it (a pipeline stage's last layer)."""
    return residual + all_reduce(a @ w, axis, strategy).astype(residual.dtype)


__all__ += ["K_SPLITS", "SPLIT_MIN_ROWS", "row_parallel_residual", "row_parallel_residual_rmsnorm"]
