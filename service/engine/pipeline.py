"""Pipeline stages: the model's layers split over a (pp, tp) device mesh, the same step on every stage.

Stage s holds layers [s * L/pp, (s+1) * L/pp) (tensor-parallel over its tp devices) and their share of
the KV pool. A step runs the stages one after another in one SPMD program: stage s runs its layers on
the residual stream while the others wait, then hands it on (every stage receives it, so the next
stage's input and, after the last, the final norm are everyone's); the LM head's vocabulary is split
over all the devices, which sample together. A pipeline thus serves a model too large for one
tensor-parallel group's memory, with one stage's devices busy at a time; its tokens are those of one
device.

Parameter layout: each layer array has a leading stage dimension sharded over ``pp`` (entry j of
``layers`` holds, on stage s, layer ``s * L/pp + j``); each local layer's K and V pools likewise
[pp, blocks, kv_heads, block_size, head_dim].
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from switchyard.kernels import kv_cache, rmsnorm
from switchyard.service.engine import param_formats
from switchyard.service.engine.model import (
    AXIS,
    Chunk,
    ForwardConfig,
    ShardShape,
    budget_layers,
    embed,
    param_shapes,
    param_specs,
    stage_stacked,
)
from switchyard.service.engine.param_formats import LayerFormats
from switchyard.service.modelspec import ModelSpec

PP = "pp"
VOCAB_AXES = (PP, AXIS)
STAGE_POOL_SPEC = P(PP, None, AXIS, None, None)  # [stages, blocks, kv_heads, block_size, head_dim]


def make_pipeline_mesh(pp: int, tp: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    devices = list(devices if devices is not None else jax.devices())
    if pp * tp > len(devices):
        raise ValueError(f"pp={pp} x tp={tp} needs {pp * tp} devices; {len(devices)} are visible")
    # Stage s takes devices [s*tp, (s+1)*tp): with one process per stage these are that process's own.
    return Mesh(np.array(devices[: pp * tp]).reshape(pp, tp), (PP, AXIS))


def check_stage_formats(formats: Sequence[LayerFormats] | None, pp: int) -> None:
    """Stages stack their layers, so layer j of every stage must hold its matrices alike (a checkpoint
    with some layers left dense, as FBGEMM's FP8 releases leave the first and last, cannot be split
    into stages)."""
    if formats is None:
        return
    per_stage = len(formats) // pp
    for i, fmt in enumerate(formats):
        if fmt != formats[i % per_stage]:
            raise ValueError(f"pipeline stages need layer {i} to hold its weights as layer {i % per_stage} does "
                             f"({param_formats.summary([fmt])} vs {param_formats.summary([formats[i % per_stage]])}); "
                             "serve this checkpoint with one stage, or with --quantization fp8 or none")


def stage_param_shapes(spec: ModelSpec, tp: int, pp: int,
                       formats: Sequence[LayerFormats] | None = None) -> dict[str, Any]:
    """Global shapes of a pipeline's parameters: each stage's layers stacked on a leading stage axis."""
    check_stage_formats(formats, pp)
    shapes = param_shapes(ShardShape(spec, tp, vocab_shards=pp * tp), formats)
    specs = param_specs(spec, formats)
    per_stage = spec.num_layers // pp
    shapes["layers"] = [stage_stacked(shp, ps, pp, PP)[0]
                        for shp, ps in zip(shapes["layers"][:per_stage], specs["layers"][:per_stage], strict=True)]
    return shapes


def stage_param_specs(spec: ModelSpec, pp: int, formats: Sequence[LayerFormats] | None = None) -> dict[str, Any]:
    check_stage_formats(formats, pp)
    specs = param_specs(spec, formats)
    per_stage = spec.num_layers // pp
    specs["layers"] = [jax.tree.map(lambda ps: P(PP, *ps), layer) for layer in specs["layers"][:per_stage]]
    specs["lm_head"] = P(None, VOCAB_AXES)
    return specs


def pipeline_forward(params: dict, k_pool: list[jax.Array], v_pool: list[jax.Array], tokens: jax.Array,
                     positions: jax.Array, tables: jax.Array, write: jax.Array, chunk: Chunk | None,
                     cfg: ForwardConfig, pp: int) -> tuple[jax.Array, list[jax.Array], list[jax.Array]]:
    """``model.budget_forward`` over the stages (module docstring), inside ``shard_map`` over
    (pp, tp): local logits [n (+ K: each chunk's last position), padded_vocab / (pp * tp)] and the
    stage's pools."""
    stage = jax.lax.axis_index(PP)
    layers = [jax.tree.map(lambda a: a[0], layer) for layer in params["layers"]]
    def unstack(pool: kv_cache.Pool) -> kv_cache.Pool:  # this stage's pool, without the stage dimension
        return kv_cache.map_pool(lambda a: a[0], pool)

    def restack(pool: kv_cache.Pool) -> kv_cache.Pool:
        return kv_cache.map_pool(lambda a: a[None], pool)

    ks, vs = [unstack(p) for p in k_pool], [unstack(p) for p in v_pool]
    all_tokens = tokens if chunk is None else jnp.concatenate([tokens, chunk.flat_tokens])
    x = embed(params["embed"], all_tokens)
    for i in range(pp):
        def run(x: jax.Array, ks: list[jax.Array], vs: list[jax.Array]) -> tuple[jax.Array, list, list]:
            residual, _, ks, vs = budget_layers(x, layers, ks, vs, positions, tables, write, chunk, cfg,
                                                final_norm=None)
            return residual, ks, vs

        def wait(x: jax.Array, ks: list[jax.Array], vs: list[jax.Array]) -> tuple[jax.Array, list, list]:
            return x, ks, vs

        y, ks, vs = jax.lax.cond(stage == i, run, wait, x, ks, vs)
        x = jax.lax.psum(jnp.where(stage == i, y, jnp.zeros_like(y)), PP)
    n = tokens.shape[0]
    rows = jnp.arange(n) if chunk is None else jnp.concatenate([jnp.arange(n), chunk.last_rows(n)])
    h = rmsnorm(x[rows], params["final_norm"], cfg.shape.spec.rms_norm_eps)
    logits = jnp.dot(h, params["lm_head"], preferred_element_type=jnp.float32)
    return logits, [restack(p) for p in ks], [restack(p) for p in vs]
