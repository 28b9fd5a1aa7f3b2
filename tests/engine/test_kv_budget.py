"""The KV token budget the operator plans is the pool the engine allocates, and a budget the devices
cannot hold is refused in one line."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.engine_fixtures import tiny_engine
from helpers.kube.harness import decode_service, gpu_node
from switchyard.operator import inventory, planner, render
from switchyard.operator import spec as specmod
from switchyard.service.engine.engine import EngineConfig, pool_tokens
from switchyard.service.modelspec import KV_BLOCK_TOKENS, ModelSpecError, ServingLayout, preset


def planned_layout(body: dict) -> tuple[planner.Plan, ServingLayout]:
    """The layout file the operator writes into the ConfigMap, read back as ``switchyard serve`` reads it."""
    body["metadata"].update(uid="0f1e2d3c-uid", generation=1)
    spec = specmod.normalized(body["spec"])
    p = planner.plan(specmod.model_spec(spec), inventory.build([gpu_node("h200-0")], []), specmod.request(spec))
    configmap = next(o for o in render.render(body, spec, p, specmod.model_source(spec)) if o["kind"] == "ConfigMap")
    return p, ServingLayout.from_json(configmap["data"]["layout.json"])


@pytest.mark.parametrize("fraction", [0.9, 0.5])
def test_the_planned_budget_is_what_the_engine_is_built_with(fraction):
    body = decode_service(kvMemoryFraction=fraction)
    plan, layout = planned_layout(body)
    assert plan.layout is not None and layout.kv_tokens == plan.layout.kv_tokens > 0
    assert layout.kv_tokens % KV_BLOCK_TOKENS == 0
    assert render.plan_status(plan, render.owner_from_body(body))["layout"]["kvTokens"] == layout.kv_tokens
    config = EngineConfig.from_layout(layout)
    assert config.kv_tokens == layout.kv_tokens and config.step_tokens == layout.step_tokens


def test_the_engine_allocates_exactly_the_budget_it_is_given(tiny_checkpoint_dir):
    layout = dataclasses.replace(ServingLayout(batch_slots=4, max_seq_len=128), kv_tokens=5 * KV_BLOCK_TOKENS,
                                 step_tokens=32)
    engine = tiny_engine(tiny_checkpoint_dir, slots=4, max_seq_len=128, block_size=KV_BLOCK_TOKENS,
                         kv_tokens=layout.kv_tokens, step_tokens=layout.step_tokens)
    assert engine.kv_tokens == layout.kv_tokens and engine.step_tokens == 32
    pool = engine._state["k"][0]
    assert pool.shape[0] == layout.kv_tokens // KV_BLOCK_TOKENS + 1  # and the null block
    assert pool.shape[2] == KV_BLOCK_TOKENS


def test_a_budget_larger_than_the_free_memory_is_refused_in_one_line():
    spec, bs = preset("tiny"), KV_BLOCK_TOKENS
    tokens = 6 * bs
    config = EngineConfig(batch_slots=2, max_seq_len=128, kv_tokens=tokens, step_tokens=32, block_size=bs)
    need = (tokens + bs) * spec.kv_bytes_per_token_per_gpu(1, 1)  # the pool and its null block
    with pytest.raises(ModelSpecError, match=rf"^layout.kv_tokens {tokens} needs .* GiB of KV cache per GPU, but "
                                             r"only .* GiB is free after the weights; lower kv_tokens"):
        pool_tokens(spec, config, 1, 1, spec.dtype, need - 1)
    assert pool_tokens(spec, config, 1, 1, spec.dtype, need) == tokens


def test_an_unsized_pool_takes_its_share_of_the_free_memory_and_host_devices_every_context():
    spec, bs = preset("tiny"), KV_BLOCK_TOKENS
    config = EngineConfig(batch_slots=2, max_seq_len=128, block_size=bs, kv_memory_fraction=0.5)
    per_token = spec.kv_bytes_per_token_per_gpu(2, 1)
    assert pool_tokens(spec, config, 2, 1, spec.dtype, 1000 * per_token) == 500 // bs * bs
    assert pool_tokens(spec, config, 2, 1, spec.dtype, None) == 2 * 128
    # Where XLA's compiler is not told the allocator's limit, the pool also stays inside its room.
    assert pool_tokens(spec, config, 2, 1, spec.dtype, 1000 * per_token, room=300 * per_token) == 300 // bs * bs
    assert pool_tokens(spec, config, 2, 1, spec.dtype, 1000 * per_token, room=900 * per_token) == 500 // bs * bs
    with pytest.raises(ModelSpecError, match="fewer than one sequence of max_seq_len 128"):
        pool_tokens(spec, config, 2, 1, spec.dtype, 100 * per_token)
