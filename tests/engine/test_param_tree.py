"""The engine's parameter tree: matrices are weights (the traced step is the one bare arrays give),
each family's extra tensors have their place and sharding, and pipeline stages stack all of them."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from switchyard.kernels.weights import DenseWeight
from switchyard.service.engine.checkpoint import load_params, write_checkpoint
from switchyard.service.engine.engine import make_mesh
from switchyard.service.engine.model import (
    AXIS,
    Chunk,
    ForwardConfig,
    ShardShape,
    budget_forward,
    is_shape,
    param_shapes,
    param_specs,
)
from switchyard.service.engine.pipeline import make_pipeline_mesh
from switchyard.service.engine.random_weights import random_weights
from switchyard.service.modelspec import preset

POOL = P(None, AXIS, None, None)


def bare(tree):
    """The tree with each weight replaced by its matrix (or its matrix's shape or spec)."""
    return jax.tree.map(lambda x: x.w if isinstance(x, DenseWeight) else x, tree,
                        is_leaf=lambda x: isinstance(x, DenseWeight))


def lowered_step(spec, tp: int, unwrap: bool) -> str:
    """The token-budget step (4 decode rows and an 8-token chunk) lowered for CPU, its parameters as
    the engine holds them or, with ``unwrap``, as bare arrays."""
    mesh = make_mesh(tp)
    shape = ShardShape(spec, tp)
    cfg = ForwardConfig.make(shape, "xla")
    dtype = jnp.bfloat16
    shapes, specs = param_shapes(shape), param_specs(spec)
    if unwrap:
        shapes, specs = bare(shapes), bare(specs)
    params = jax.tree.map(lambda shp, ps: jax.ShapeDtypeStruct(shp, dtype, sharding=NamedSharding(mesh, ps)),
                          shapes, specs, is_leaf=is_shape)
    pool = jax.ShapeDtypeStruct((8, spec.num_kv_heads, 4, spec.head_dim), dtype, sharding=NamedSharding(mesh, POOL))
    pools = [pool] * spec.num_layers
    rows, m = 4, 8
    ints = [jax.ShapeDtypeStruct(s, jnp.int32) for s in ((rows,), (rows,), (rows, m), (1, 8), (1,), (1,), (1, m))]
    write = jax.ShapeDtypeStruct((rows,), jnp.bool_)

    def body(params, k, v, tokens, positions, tables, write, c_tokens, c_start, c_len, c_table):
        chunk = Chunk(c_tokens, c_start, c_len, c_table, kv_len=16, block_aligned=True)
        return budget_forward(params, k, v, tokens, positions, tables, write, chunk, cfg)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, [POOL] * spec.num_layers, [POOL] * spec.num_layers)
                               + (P(),) * 8, out_specs=(P(None, AXIS), [POOL] * spec.num_layers,
                                                        [POOL] * spec.num_layers), check_vma=False))
    tokens, positions, tables, c_tokens, c_start, c_len, c_table = ints
    return fn.trace(params, pools, pools, tokens, positions, tables, write, c_tokens, c_start, c_len,
                    c_table).lower(lowering_platforms=("cpu",)).as_text()


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen3"])
def test_a_step_over_dense_weights_is_the_program_of_bare_arrays(name):
    spec = dataclasses.replace(preset(name), num_layers=2, dtype="bfloat16")
    ours = lowered_step(spec, 2, unwrap=False)
    assert ours == lowered_step(spec, 2, unwrap=True)
    assert ours.count("stablehlo.dot_general") >= 4 * spec.num_layers


@pytest.mark.parametrize("name", ["tiny", "tiny-qwen2", "tiny-qwen3"])
def test_each_family_has_its_extra_tensors_sharded(name):
    spec = preset(name)
    params = random_weights(spec, make_mesh(2), "float32", seed=0)
    layer = params["layers"][1]
    extras = {"tiny": set(), "tiny-qwen2": {"bqkv"}, "tiny-qwen3": {"q_norm", "k_norm"}}[name]
    assert set(layer) == {"attn_norm", "wqkv", "wo", "mlp_norm", "wgu", "wdown"} | extras
    qkv_cols = layer["wqkv"].shape[1]
    if "bqkv" in layer:  # sharded like wqkv's columns: shard r holds [q_r | k_r | v_r]
        assert layer["bqkv"].shape == (qkv_cols,) and layer["bqkv"].sharding.spec == P(AXIS)
        assert float(jnp.abs(layer["bqkv"]).mean()) < 0.1
    for norm in extras - {"bqkv"}:
        assert layer[norm].shape == (spec.head_dim,) and layer[norm].sharding.spec == P()
        assert abs(float(layer[norm].mean()) - 1.0) < 0.2  # norms start near one


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen3"])
def test_pipeline_stages_stack_every_tensor_of_the_family(tmp_path, name):
    """Loaded for two stages of TP=2, entry j of the layers holds on stage s exactly what a TP=2 load
    holds for layer 2s + j, the family's biases and norms included."""
    spec = preset(name)
    folder = write_checkpoint(spec, tmp_path / name, seed=2, progress=False)
    flat = load_params(folder, spec, make_mesh(2), "float32", progress=False)
    staged = load_params(folder, spec, make_pipeline_mesh(2, 2), "float32", progress=False, stages=2)
    per_stage = spec.num_layers // 2
    assert len(staged["layers"]) == per_stage
    for j, layer in enumerate(staged["layers"]):
        for stage in range(2):
            ours = jax.tree.leaves(jax.tree.map(lambda a, s=stage: np.asarray(a)[s], layer))
            theirs = jax.tree.leaves(jax.tree.map(np.asarray, flat["layers"][stage * per_stage + j]))
            assert len(ours) == len(theirs) == len(jax.tree.leaves(param_specs(spec)["layers"][0]))
            for a, b in zip(ours, theirs, strict=True):
                np.testing.assert_array_equal(a, b)
