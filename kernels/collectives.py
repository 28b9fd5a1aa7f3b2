"""Python API of the collectives, usable inside ``jax.shard_map``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

STRATEGIES = ("xla", "oneshot", "twoshot", "auto")


def _check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown all-reduce strategy {strategy!r} (choose from {', '.join(STRATEGIES)})")


def rmsnorm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as Llama computes it: statistics in float32, scaled in the input dtype."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def all_reduce(x: jax.Array, axis: str, strategy: str = "xla") -> jax.Array:
    """Sum ``x`` over the mesh axis ``axis``."""
    _check_strategy(strategy)
    return jax.lax.psum(x, axis)


def all_reduce_residual_rmsnorm(
    x: jax.Array, residual: jax.Array, weight: jax.Array, eps: float, axis: str, strategy: str = "xla"
) -> tuple[jax.Array, jax.Array]:
    """``residual + all_reduce(x)`` and its RMSNorm: returns ``(new_residual, normed)``."""
    new_residual = residual + all_reduce(x, axis, strategy).astype(residual.dtype)
    return new_residual, rmsnorm(new_residual, weight, eps)
