"""The KV pools are updated in place by every step program: a compiled step holds no copy of a pool.

A step that carries prompt chunks writes each layer's pools twice (the decode rows' K/V, the chunks')
and reads them for both attentions. Were a read free to run before a write, XLA would copy the whole
pool to keep what the read sees (two copies a layer per step, each the size of a layer's pool)."""

from __future__ import annotations

import re

import jax
import pytest
from helpers.engine_fixtures import kernel_sized_spec, tiny_checkpoint, tiny_engine
from helpers.hf_reference import hf_model, save_hf
from switchyard.service.engine.step_policy import StepShape

# An array of the pools' shape, copied: `%copy.12 = f32[33,4,16,16]{3,2,1,0} copy(%param)`.
COPY = re.compile(r"= (\w+)\[([\d,]*)\]\S* copy\(")


def pool_copies(engine, shape: StepShape) -> list[str]:
    """The copies, in ``shape``'s compiled step, of arrays shaped as a pool's (or an FP8 pool's scales)."""
    # As one device holds them (a pipeline stage's without its stage dimension, too).
    shards = [tuple(a.sharding.shard_shape(a.shape)) for a in jax.tree.leaves(engine._state["k"][0])]
    pools = {*shards, *(s[1:] for s in shards if engine.pp > 1)}
    step = engine._program("step", shape)
    text = step.lower(engine.params, engine._state, engine._io).compile().as_text()
    return [m.group(0) for m in COPY.finditer(text)
            if tuple(int(d) for d in m.group(2).split(",") if d) in pools]


def chunk_shapes(engine) -> list[StepShape]:
    """A decode-only step, and each kind of step with chunks (one chunk, several side by side)."""
    shapes = engine.policy.shapes()
    single = next(s for s in shapes if s.with_chunk and s.chunks == 1)
    packed = [s for s in shapes if s.chunks > 1][:1]
    return [shapes[0], single, *packed]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("step_tokens", [64, 24])  # chunks written by whole blocks; position by position
def test_no_step_copies_a_pool(checkpoint, kv_cache_dtype, step_tokens):
    engine = tiny_engine(checkpoint, slots=4, max_seq_len=128, kv_tokens=512, step_tokens=step_tokens,
                         block_size=16, kv_cache_dtype=kv_cache_dtype)
    assert engine.policy.chunks_block_aligned == (step_tokens == 64)
    shapes = chunk_shapes(engine)
    assert shapes[1].chunk_tokens and len(shapes) == (3 if step_tokens == 64 else 2)
    for shape in shapes:
        assert pool_copies(engine, shape) == [], shape


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_no_step_copies_a_pool_shard(checkpoint, tp, pp):
    engine = tiny_engine(checkpoint, tp=tp, pp=pp, slots=4, max_seq_len=128, kv_tokens=512, step_tokens=64,
                         block_size=16)
    for shape in chunk_shapes(engine):
        assert pool_copies(engine, shape) == [], shape


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 2])
def test_no_step_copies_a_pool_on_gpu(tmp_path, tp):
    """With the paged decode kernel and cuDNN's attention in the step, as served (at TP=2 with the
    all-reduce kernels, where two GPUs are present)."""
    if len(jax.devices("gpu")) < tp:
        pytest.skip(f"needs {tp} GPUs")
    path = save_hf(hf_model(kernel_sized_spec(), seed=3), tmp_path)
    engine = tiny_engine(path, tp=tp, slots=4, max_seq_len=512, kv_tokens=4 * 512, step_tokens=64, block_size=64,
                         dtype="bfloat16")
    for shape in chunk_shapes(engine):
        assert pool_copies(engine, shape) == [], shape
