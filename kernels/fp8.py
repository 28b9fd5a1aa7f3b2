"""FP8 (e4m3) arithmetic shared by the weights, the KV pool and the loaders: rounding to e4m3 with a
scale chosen so that the largest magnitude lands on e4m3's largest finite value.

E4M3 (``float8_e4m3fn``: no infinities, one NaN) holds magnitudes up to 448 with 3 mantissa bits, so
a value rounds with a relative error of at most 2^-4. A scale per row (a token's activation, a
weight's output channel, a KV head's position) keeps every row's largest value at 448, where the
steps between representable values are relatively the finest.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

FP8 = jnp.float8_e4m3fn
NP_FP8 = ml_dtypes.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
# A scale never falls below this: a row of zeros gets a finite scale and quantizes to zeros.
MIN_SCALE = 1e-12
# Scales and roundings are products by reciprocals, not divisions: XLA rewrites a division by a
# broadcast value into a product by its reciprocal, so writing the products out is what makes the
# device, the host and a reference run the same float32 operations (each rounded once) and round every
# value alike. A division rounded once differs from that at ties, which bf16 inputs hit often.
INV_FP8_MAX = np.float32(1.0 / FP8_MAX)


def quantize_rows(x: jax.Array, axis: int = -1) -> tuple[jax.Array, jax.Array]:
    """``x`` as e4m3 with one float32 scale per slice along ``axis`` (kept as a dimension of 1):
    ``x ≈ q * scale``. The scale is the slice's largest magnitude over 448."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=axis, keepdims=True)
    scale = jnp.maximum(amax * INV_FP8_MAX, jnp.float32(MIN_SCALE))
    # The clip only guards the last rounding of the product: e4m3fn has no infinity to saturate to.
    q = jnp.clip(xf * (jnp.float32(1.0) / scale), -FP8_MAX, FP8_MAX).astype(FP8)
    return q, scale


def dequantize(q: jax.Array, scale: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """``q * scale`` in ``dtype`` (the product in float32, then rounded once)."""
    return (q.astype(jnp.float32) * scale).astype(dtype)


def quantize_rows_np(x: np.ndarray, axis: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """:func:`quantize_rows` on the host (NumPy), for checkpoints: the same scales and rounding."""
    xf = np.asarray(x, dtype=np.float32)
    amax = np.max(np.abs(xf), axis=axis, keepdims=True)
    scale = np.maximum(amax * INV_FP8_MAX, np.float32(MIN_SCALE)).astype(np.float32)
    q = np.clip(xf * (np.float32(1.0) / scale), -FP8_MAX, FP8_MAX).astype(NP_FP8)
    return q, scale
