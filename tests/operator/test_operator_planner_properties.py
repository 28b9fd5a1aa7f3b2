"""Property tests of the planner: over DecodeServices generated from the CRD schema (every field
within its schema bounds) and node labels that are any string, planning never raises and each plan
takes under a second. Seeded (derandomized) and bounded, so a run is repeatable."""

from __future__ import annotations

import time
from typing import Any

from helpers.kube import crschema
from helpers.kube.harness import gpu_node
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from switchyard.operator import crd, inventory, planner
from switchyard.operator import spec as specmod
from switchyard.service.modelspec import KV_BLOCK_TOKENS, ServingLayout

PLAN_SECONDS = 1.0
SETTINGS = settings(derandomize=True, max_examples=150, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def from_schema(schema: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values valid under one CRD schema node: enums, bounded integers and numbers, booleans, and
    objects with their required properties and any of the others (strings here are all enums)."""
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "integer":
        step = schema.get("multipleOf", 1)
        return st.integers(-(-schema.get("minimum", 0) // step), schema["maximum"] // step).map(lambda n: n * step)
    if kind == "number":
        return st.floats(schema.get("minimum"), schema["maximum"], allow_nan=False, allow_infinity=False,
                         exclude_min=bool(schema.get("exclusiveMinimum")))
    if kind == "boolean":
        return st.booleans()
    if kind == "object":
        props = schema["properties"]
        required = {k: from_schema(props[k]) for k in schema.get("required", [])}
        optional = {k: from_schema(v) for k, v in props.items() if k not in required}
        return st.fixed_dictionaries(required, optional=optional)
    raise AssertionError(f"no strategy for {schema}")


def spec_part(path: str) -> st.SearchStrategy[Any]:
    return from_schema(crd.spec_schema(path))


models = st.one_of(
    st.fixed_dictionaries({"preset": spec_part("model.preset")}),
    st.fixed_dictionaries({"config": spec_part("model.config")}),
)


@st.composite
def decode_services(draw: st.DrawFn) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": {"name": "m", "source": {"pvc": {"claimName": "models"}}, **draw(models)}}
    for field in ("replicas", "objective", "slo", "workload", "parallelism", "allReduce", "engine",
                  "kvMemoryFraction", "stepTokens"):
        if draw(st.booleans()):
            spec[field] = draw(spec_part(field))
    return spec


# Any string, and the numbers GPU Feature Discovery would write, for every value the inventory reads.
any_label = st.one_of(st.text(max_size=40), st.integers(-10, 2**70).map(str),
                      st.sampled_from(["inf", "-inf", "nan", "Infinity", "1e308", "1e400", "8", "143771", "81559"]))


@st.composite
def nodes(draw: st.DrawFn) -> list[dict[str, Any]]:
    out = []
    for i in range(draw(st.integers(1, 3))):
        node = gpu_node(f"n{i}", product=draw(st.sampled_from(["NVIDIA-H200", "NVIDIA-H100-80GB-HBM3"])))
        labels = node["metadata"]["labels"]
        for key in ("nvidia.com/gpu.memory", "nvidia.com/gpu.count", "nvidia.com/gpu.product"):
            if draw(st.booleans()):
                labels[key] = draw(any_label)
        if draw(st.booleans()):
            node["status"]["allocatable"]["nvidia.com/gpu"] = draw(any_label)
        out.append(node)
    return out


@SETTINGS
@given(spec=decode_services(), node_list=nodes())
def test_planning_a_schema_valid_service_never_raises_and_is_quick(spec, node_list):
    obj = {"apiVersion": "switchyard.dev/v1alpha1", "kind": "DecodeService",
           "metadata": {"name": "p", "namespace": "default"}, "spec": spec}
    stored, errors = crschema.admit(crd.openapi_schema(), obj)
    # The generator keeps within every bound; only the CEL rules between numbers (heads against KV
    # heads, an even head size) may refuse what it makes, as the API server would.
    assert all('Invalid value: "object"' in e for e in errors), errors
    if errors:
        return
    try:
        model = specmod.model_spec(stored["spec"])
    except specmod.SpecError:
        return  # a clean InvalidModel condition (e.g. heads that do not divide the hidden size)
    start = time.perf_counter()
    plan = planner.plan(model, inventory.build(node_list), specmod.request(stored["spec"]))
    elapsed = time.perf_counter() - start
    assert elapsed < PLAN_SECONDS, f"planning took {elapsed:.2f} s"
    assert plan.message
    if plan.layout is not None:
        lay = plan.layout
        assert lay.ms_per_token > 0 and lay.max_seq_len >= 2
        # The pool holds a full-length sequence in whole blocks: a layout file the engine accepts.
        assert lay.kv_tokens >= lay.max_seq_len and lay.kv_tokens % KV_BLOCK_TOKENS == 0
        ServingLayout(tp=lay.tp, pp=lay.pp, batch_slots=lay.batch_slots, max_seq_len=lay.max_seq_len,
                      kv_tokens=lay.kv_tokens, kv_memory_fraction=lay.kv_memory_fraction,
                      step_tokens=lay.step_tokens)


@SETTINGS
@given(node_list=nodes())
def test_node_values_never_break_the_inventory(node_list):
    inv = inventory.build(node_list)
    assert len(inv.nodes) + len(inv.skipped) == len(node_list)
    for node in inv.nodes:
        assert 0 <= node.free <= node.gpus <= inventory.MAX_GPUS_PER_NODE
        assert 0 <= node.memory_bytes <= inventory.MAX_GPU_MEMORY_MIB * 2**20
