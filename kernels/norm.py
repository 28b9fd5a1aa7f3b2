"""RMSNorm, and residual add + RMSNorm on one GPU in one kernel.

``residual_rmsnorm`` is what follows each row-parallel projection when nothing is to be summed
across GPUs (tensor parallelism 1): ``new_residual = residual + x`` and its RMSNorm. On GPUs where
the kernel library is loaded it runs as one launch of the fused all-reduce kernel without its
exchange (``csrc/fused_rmsnorm.cuh``); XLA's ops take two to four kernels for it. Elsewhere, and for
shapes the kernel does not take, the reference below runs, with the same semantics.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from switchyard.kernels import native

KERNEL_DTYPES = ("float32", "bfloat16", "float16")


def rmsnorm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as Llama computes it: statistics in float32, scaled in the input dtype."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def reference_residual_rmsnorm(
    x: jax.Array, residual: jax.Array, weight: jax.Array, eps: float
) -> tuple[jax.Array, jax.Array]:
    new_residual = residual + x.astype(residual.dtype)
    return new_residual, rmsnorm(new_residual, weight, eps)


def kernel_supports(x: jax.Array, residual: jax.Array, weight: jax.Array) -> bool:
    return (x.ndim >= 1 and x.size > 0 and residual.shape == x.shape and weight.shape == x.shape[-1:]
            and residual.dtype == x.dtype == weight.dtype and jnp.dtype(x.dtype).name in KERNEL_DTYPES)


def _kernel(x: jax.Array, residual: jax.Array, weight: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    out = jax.ShapeDtypeStruct(residual.shape, residual.dtype)
    # The kernel scales by ones (exact) and the weight multiply stays in XLA, as in the reference
    # (weight * normed.astype(dtype), the same rounding): XLA fuses it into the next GEMM.
    new_residual, scaled = jax.ffi.ffi_call("switchyard_residual_rmsnorm", (out, out))(
        x, residual, jnp.ones_like(weight), eps=np.float32(eps))
    return new_residual, weight * scaled


def residual_rmsnorm(
    x: jax.Array, residual: jax.Array, weight: jax.Array, eps: float, *, use_kernel: bool = True
) -> tuple[jax.Array, jax.Array]:
    """``residual + x`` and its RMSNorm, returned as ``(new_residual, normed)``; one kernel on GPU."""
    if not (use_kernel and kernel_supports(x, residual, weight) and native.local_kernels_ready()):
        return reference_residual_rmsnorm(x, residual, weight, eps)
    return jax.lax.platform_dependent(
        x, residual, weight, default=lambda *a: reference_residual_rmsnorm(*a, eps),
        cuda=lambda *a: _kernel(*a, eps))
