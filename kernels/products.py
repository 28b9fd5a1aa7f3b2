"""Decode products for the engine: ``x @ w`` (+ a residual) for a few rows, one pass over the weights.

``decode_product`` runs the CUDA kernel of ``csrc/decode_product.cuh`` on GPUs where the kernel
library is loaded and the shapes fit it (1 to 8 rows, bf16/fp16, K a multiple of 512, N of 32),
and otherwise the pure-JAX reference below, with the same semantics: float32 accumulation, the
residual added in float32, one rounding to the input dtype. Called inside ``jax.shard_map`` on one
device's shard, or outside it on one device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from switchyard.kernels import native

KERNEL_DTYPES = ("bfloat16", "float16")
MAX_ROWS = 8  # kProductMaxRows in csrc/decode_product.cuh
K_MULTIPLE = 512  # 8 rows of K per step x 64 K ranges per block
N_MULTIPLE = 32  # columns per block


def reference_decode_product(x: jax.Array, w: jax.Array, residual: jax.Array | None = None) -> jax.Array:
    """``T(residual + x @ w)`` (x [..., K], w [K, N]) with the product and the sum in float32 (T = x's dtype)."""
    y = jnp.dot(x, w, preferred_element_type=jnp.float32)
    if residual is not None:
        y = residual.astype(jnp.float32) + y
    return y.astype(x.dtype)


def kernel_supports(x: jax.Array, w: jax.Array, residual: jax.Array | None = None) -> bool:
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        return False
    n, k = x.shape
    dtypes = {x.dtype, w.dtype} | ({residual.dtype} if residual is not None else set())
    return (1 <= n <= MAX_ROWS and k % K_MULTIPLE == 0 and w.shape[1] % N_MULTIPLE == 0 and len(dtypes) == 1
            and jnp.dtype(x.dtype).name in KERNEL_DTYPES
            and (residual is None or residual.shape == (n, w.shape[1])))


def _kernel(x, w, *residual):
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype)
    target = "switchyard_decode_product_residual" if residual else "switchyard_decode_product"
    return jax.ffi.ffi_call(target, out)(x, w, *residual)


def decode_product(x: jax.Array, w: jax.Array, residual: jax.Array | None = None, *,
                   use_kernel: bool = True) -> jax.Array:
    """As :func:`reference_decode_product`; on CUDA with the kernel library, one kernel."""
    if w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"decode product: x [..., K] and w [K, N], got {x.shape} and {w.shape}")
    if residual is not None and residual.shape != (*x.shape[:-1], w.shape[1]):
        raise ValueError(f"decode product: residual must be {(*x.shape[:-1], w.shape[1])}, got {residual.shape}")
    args = (x, w) if residual is None else (x, w, residual)
    if not (use_kernel and kernel_supports(x, w, residual) and native.attention_ready()):
        return reference_decode_product(*args)
    return jax.lax.platform_dependent(*args, default=reference_decode_product, cuda=_kernel)
