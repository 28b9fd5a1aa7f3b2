"""The KV token budget the operator plans is the pool the engine allocates."""

from __future__ import annotations

import dataclasses

import pytest
from helpers.engine_fixtures import tiny_paged_engine
from helpers.kube.harness import decode_service, gpu_node
from switchyard.operator import inventory, planner, render
from switchyard.operator import spec as specmod
from switchyard.service.engine.paged import PagedEngine
from switchyard.service.modelspec import KV_BLOCK_TOKENS, ServingLayout


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
    arguments = PagedEngine.layout_arguments(layout)
    assert arguments["kv_tokens"] == layout.kv_tokens and arguments["step_tokens"] == layout.step_tokens


def test_the_engine_allocates_exactly_the_budget_it_is_given(tiny_checkpoint_dir):
    layout = dataclasses.replace(ServingLayout(batch_slots=4, max_seq_len=128), kv_tokens=5 * KV_BLOCK_TOKENS,
                                 step_tokens=32)
    engine = tiny_paged_engine(tiny_checkpoint_dir, slots=4, max_seq_len=128, block_size=KV_BLOCK_TOKENS,
                               **{k: v for k, v in PagedEngine.layout_arguments(layout).items()
                                  if k in ("kv_tokens", "step_tokens")})
    assert engine.kv_tokens == layout.kv_tokens and engine.step_tokens == 32
    pool = engine._state["k"][0]
    assert pool.shape[0] == layout.kv_tokens // KV_BLOCK_TOKENS + 1  # and the null block
    assert pool.shape[2] == KV_BLOCK_TOKENS


class _EngineOnDevicesWith(PagedEngine):
    """The engine on devices that report ``free`` bytes left (host devices report no memory)."""

    free = 0

    def _free_memory(self) -> int | None:
        return self.free


def test_a_budget_larger_than_the_free_memory_is_refused_in_one_line(tiny_checkpoint_dir):
    from switchyard.service.engine.checkpoint import load_params
    from switchyard.service.engine.tensor_parallel import make_mesh
    from switchyard.service.modelspec import ModelSpec, ModelSpecError

    spec = ModelSpec.from_file(tiny_checkpoint_dir)
    mesh = make_mesh(1)
    params = load_params(tiny_checkpoint_dir, spec, mesh, spec.dtype, progress=False)
    tokens, bs = 6 * KV_BLOCK_TOKENS, KV_BLOCK_TOKENS
    need = (tokens + bs) * spec.kv_bytes_per_token_per_gpu(1, 1)  # the pool and its null block

    def build(free: int) -> PagedEngine:
        _EngineOnDevicesWith.free = free
        return _EngineOnDevicesWith(spec, params, mesh, batch_slots=2, max_seq_len=128, kv_tokens=tokens,
                                    step_tokens=32, block_size=bs)

    with pytest.raises(ModelSpecError, match=rf"^layout.kv_tokens {tokens} needs .* GiB of KV cache per GPU, but "
                                             r"only .* GiB is free after the weights; lower kv_tokens"):
        build(need - 1)
    assert build(need).kv_tokens == tokens
