"""The layers every family's forward is built from, for one tensor-parallel shard (JAX): rotary
embeddings with their scalings, RMSNorm, the embedding lookup, the QKV projection (with a family's
bias and per-head q/k norm) and the SwiGLU MLP's activation.

A layer's parameters are the engine's tree (``service/engine/model.py``): matrices are weights
(``switchyard.kernels.weights``; ``x @ w`` is their product), vectors are arrays.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from switchyard.kernels import rmsnorm
from switchyard.service.modelspec import ModelSpec

__all__ = ["apply_rope", "embed", "qkv_projection", "rmsnorm", "rope_inv_freq", "swiglu"]

Layer = dict[str, Any]


# ---- rotary embeddings ---------------------------------------------------------------------------
def rope_inv_freq(spec: ModelSpec) -> np.ndarray:
    """Inverse frequencies with the model's rope scaling (default, linear, llama3), as Hugging Face
    computes them."""
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    rs = spec.rope_scaling
    if rs.rope_type == "linear":
        inv_freq = inv_freq / rs.factor
    elif rs.rope_type == "llama3":
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """x [..., tokens, heads, head_dim] with positions [..., tokens] (rotate-half convention)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [..., tokens, dim/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[..., None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[..., None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


# ---- embeddings, attention input, MLP ------------------------------------------------------------
def embed(table: jax.Array, tokens: jax.Array) -> jax.Array:
    """The rows of the (replicated) embedding table for ``tokens``."""
    return table[tokens]


def qkv_projection(h: jax.Array, layer: Layer, positions: jax.Array, inv_freq: jax.Array, spec: ModelSpec,
                   q_heads: int, kv_heads: int) -> jax.Array:
    """The shard's queries, keys and values of the rows ``h`` [n, hidden] at ``positions`` [n], packed
    as [n, q_heads + 2 kv_heads, head_dim] with RoPE applied to the query and key heads.

    Per the spec: the family's bias added (``bqkv``, the shard's [q | k | v] biases), each query and key
    head RMS-normed over head_dim (``q_norm`` / ``k_norm``) before RoPE. Every forward path reads q, k
    and v from this one array (attention kernels read it in place: no per-layer slice copies).
    """
    n, hd = h.shape[0], spec.head_dim
    qkv = h @ layer["wqkv"]
    if spec.attention_bias:
        qkv = qkv + layer["bqkv"]
    qkv = qkv.reshape(n, q_heads + 2 * kv_heads, hd)
    qk = q_heads + kv_heads
    if spec.qk_norm:
        eps = spec.rms_norm_eps
        qkv = jnp.concatenate([rmsnorm(qkv[:, :q_heads], layer["q_norm"], eps),
                               rmsnorm(qkv[:, q_heads:qk], layer["k_norm"], eps), qkv[:, qk:]], axis=1)
    # RoPE over every head in one elementwise pass, kept for the query and key heads only.
    roped = apply_rope(qkv[:, None], positions[:, None], inv_freq)[:, 0]
    is_qk = jnp.arange(qkv.shape[1]) < qk
    return jnp.where(is_qk[None, :, None], roped, qkv)


def swiglu(h: jax.Array, layer: Layer, inter: int) -> jax.Array:
    """SwiGLU's input to the down projection: silu(gate) * up, from the shard's [gate | up] columns
    (``wgu``, ``inter`` of each)."""
    gu = h @ layer["wgu"]
    gate, up = gu[..., :inter], gu[..., inter:]
    return (jax.nn.silu(gate.astype(jnp.float32)).astype(h.dtype)) * up
