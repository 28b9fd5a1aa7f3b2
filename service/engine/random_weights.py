"""Random weights of a model's shape, made on the devices already sharded (benchmarks and tests)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from switchyard.service.engine.checkpoint import NP_DTYPES
from switchyard.service.engine.model import ShardShape, param_shapes, param_specs
from switchyard.service.modelspec import ModelSpec


def random_weights(spec: ModelSpec, mesh: Mesh, dtype: str, seed: int) -> dict:
    """Random weights for ``mesh`` (a tensor-parallel group, or pipeline stages of them: each stage's
    layers made on its own devices)."""
    from switchyard.service.engine.pipeline import PP, stage_param_shapes, stage_param_specs

    tp, pp = mesh.shape["tp"], dict(mesh.shape).get(PP, 1)
    if pp == 1:
        return random_params(param_shapes(ShardShape(spec, tp)), param_specs(spec), mesh, dtype, seed)
    if spec.num_layers % pp:
        raise ValueError(f"{pp} pipeline stages must divide the {spec.num_layers} layers")
    return random_params(stage_param_shapes(spec, tp, pp), stage_param_specs(spec, pp), mesh, dtype, seed)


def random_params(shapes: Any, specs: Any, mesh: Mesh, dtype: str, seed: int) -> Any:
    """A parameter tree of random tensors (scaled like a trained model's), each made on the devices
    already sharded, so no host or single device ever holds a whole tensor."""
    jdtype = jnp.dtype(NP_DTYPES[dtype])
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    arrays, inits = [], {}
    for n, ((path, shp), ps) in enumerate(zip(leaves, spec_leaves, strict=True)):
        is_norm = str(getattr(path[-1], "key", "")).endswith("norm")
        if (shp, ps, is_norm) not in inits:  # one compile per distinct shape, not per layer
            inits[shp, ps, is_norm] = jax.jit(
                functools.partial(_random_tensor, shape=shp, dtype=jdtype, is_norm=is_norm),
                out_shardings=NamedSharding(mesh, ps))
        arrays.append(inits[shp, ps, is_norm](jax.random.fold_in(jax.random.PRNGKey(seed), n)))
    return jax.tree.unflatten(treedef, arrays)


def _random_tensor(key: jax.Array, *, shape: tuple[int, ...], dtype: Any, is_norm: bool) -> jax.Array:
    if is_norm:
        return (1.0 + 0.1 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(dtype)
