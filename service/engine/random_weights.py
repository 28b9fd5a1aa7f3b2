"""Random weights of a model's shape, made on the devices already sharded (benchmarks and tests)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from switchyard.kernels.weights import Fp8Weight, quantize_weight
from switchyard.service.engine import param_formats
from switchyard.service.engine.checkpoint import NP_DTYPES
from switchyard.service.engine.model import ShardShape, param_shapes, param_specs
from switchyard.service.engine.param_formats import LayerFormats
from switchyard.service.modelspec import ModelSpec


def random_weights(spec: ModelSpec, mesh: Mesh, dtype: str, seed: int, quantization: str = "auto") -> dict:
    """Random weights for ``mesh`` (a tensor-parallel group, or pipeline stages of them: each stage's
    layers made on its own devices); with ``quantization`` ``fp8`` every layer matrix in FP8 with a
    scale per output channel (each made dense and quantized on the devices, one at a time)."""
    from switchyard.service.engine.pipeline import PP, stage_param_shapes, stage_param_specs

    fmt = param_formats.FP8_PER_CHANNEL if quantization == "fp8" else param_formats.DENSE
    formats: Sequence[LayerFormats] = param_formats.uniform(spec.num_layers, fmt)
    tp, pp = mesh.shape["tp"], dict(mesh.shape).get(PP, 1)
    if pp == 1:
        return random_params(param_shapes(ShardShape(spec, tp), formats), param_specs(spec, formats), mesh, dtype,
                             seed)
    if spec.num_layers % pp:
        raise ValueError(f"{pp} pipeline stages must divide the {spec.num_layers} layers")
    return random_params(stage_param_shapes(spec, tp, pp, formats), stage_param_specs(spec, pp, formats), mesh,
                         dtype, seed)


def _is_weight_or_shape(x: Any) -> bool:
    return isinstance(x, (tuple, Fp8Weight)) and not isinstance(x, P)


def random_params(shapes: Any, specs: Any, mesh: Mesh, dtype: str, seed: int) -> Any:
    """A parameter tree of random tensors (scaled like a trained model's), each made on the devices
    already sharded, so no host or single device ever holds a whole tensor. An FP8 weight is made
    dense in ``dtype`` and quantized, on the devices."""
    jdtype = jnp.dtype(NP_DTYPES[dtype])
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=_is_weight_or_shape)
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, (P, Fp8Weight)))
    arrays, inits = [], {}
    for n, ((path, shp), ps) in enumerate(zip(leaves, spec_leaves, strict=True)):
        is_norm = str(getattr(path[-1], "key", "")).endswith("norm")
        key = (shp, ps, is_norm)
        if key not in inits:  # one compile per distinct shape, not per layer
            if isinstance(shp, Fp8Weight):
                out = jax.tree.map(lambda s: NamedSharding(mesh, s), ps)
                # [.., out, in] held; made as the dense [.., in, out] it stands for (a stage dimension first).
                dense = (*shp.w[:-2], shp.w[-1], shp.w[-2])
                inits[key] = jax.jit(functools.partial(_random_fp8, shape=dense, dtype=jdtype, block_k=shp.block_k),
                                     out_shardings=out)
            else:
                inits[key] = jax.jit(functools.partial(_random_tensor, shape=shp, dtype=jdtype, is_norm=is_norm),
                                     out_shardings=NamedSharding(mesh, ps))
        arrays.append(inits[key](jax.random.fold_in(jax.random.PRNGKey(seed), n)))
    return jax.tree.unflatten(treedef, arrays)


def _random_tensor(key: jax.Array, *, shape: tuple[int, ...], dtype: Any, is_norm: bool) -> jax.Array:
    if is_norm:
        return (1.0 + 0.1 * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(dtype)


def _random_fp8(key: jax.Array, *, shape: tuple[int, ...], dtype: Any, block_k: int) -> Fp8Weight:
    if block_k:
        raise ValueError("random FP8 weights have a scale per output channel")
    w = _random_tensor(key, shape=shape, dtype=dtype, is_norm=False)
    if len(shape) == 2:
        return quantize_weight(w)
    # Stage-stacked: one weight per stage, quantized alike.
    weights = jax.vmap(quantize_weight)(w)
    return Fp8Weight(weights.w, weights.scale)
