"""Bad input the schema cannot stop: mislabelled nodes, degenerate but schema-valid models, a
ConfigMap's config.json, layer counts that once made the planner walk every integer."""

from __future__ import annotations

import json
import time

import pytest
from helpers.kube.harness import decode_service, gpu_node
from switchyard.operator import crd, inventory, planner, render
from switchyard.operator import spec as specmod
from switchyard.operator.rejections import ServiceRejection
from switchyard.service.modelspec import ModelSpec, ModelSpecError, preset

BAD_LABELS = [
    ("nvidia.com/gpu.memory", "inf"), ("nvidia.com/gpu.memory", "Infinity"), ("nvidia.com/gpu.memory", "1e308"),
    ("nvidia.com/gpu.memory", "nan"), ("nvidia.com/gpu.memory", "-81559"), ("nvidia.com/gpu.memory", "lots"),
    ("nvidia.com/gpu.memory", "81559.5"), ("nvidia.com/gpu.memory", "99999999999999999999999"),
    ("nvidia.com/gpu.count", "1e400"), ("nvidia.com/gpu.count", "-8"), ("nvidia.com/gpu.count", "eight"),
]


def labelled(name: str, label: str, value: str) -> dict:
    node = gpu_node(name)
    node["metadata"]["labels"][label] = value
    return node


@pytest.mark.parametrize(("label", "value"), BAD_LABELS)
def test_a_mislabelled_node_is_skipped_and_named_while_the_others_plan(label, value):
    inv = inventory.build([labelled("bad-0", label, value), gpu_node("good-0")])
    assert [n.name for n in inv.nodes] == ["good-0"]
    (skipped,) = inv.skipped
    assert (skipped.name, skipped.field) == ("bad-0", label)
    assert "bad-0" in skipped.message and label in skipped.message and value[:20] in skipped.message
    p = planner.plan(preset("llama3-8b"), inv, planner.Request(objective="latency"))
    assert p.status == "Planned" and set(p.layout.placement) == {("good-0",)}
    assert any("bad-0" in r and label in r for r in p.reasons)


@pytest.mark.parametrize("value", ["1e400", "inf", "-8", "8.5", "NaN"])
def test_an_unreadable_allocatable_skips_the_node(value):
    node = gpu_node("bad-0")
    node["status"]["allocatable"]["nvidia.com/gpu"] = value
    inv = inventory.build([node, gpu_node("good-0")])
    assert [n.name for n in inv.nodes] == ["good-0"]
    assert inv.skipped[0].field == "status.allocatable[nvidia.com/gpu]"


def test_only_bad_nodes_mean_no_gpu_nodes_not_an_exception():
    inv = inventory.build([labelled("bad-0", "nvidia.com/gpu.memory", "inf")])
    p = planner.plan(preset("llama3-8b"), inv, planner.Request())
    assert p.rejection is ServiceRejection.NO_GPU_NODES


def test_label_values_parse_strictly():
    assert inventory.strict_int("143771", inventory.MAX_GPU_MEMORY_MIB) == 143771
    assert inventory.strict_quantity("8000m", 1024) == 8 and inventory.strict_quantity(8, 1024) == 8
    for bad in ("", " ", "+8", "0x10", "1_000", "８", True, 8.0, None):
        with pytest.raises(inventory.BadValue):
            inventory.strict_int(bad, 1024)
    with pytest.raises(inventory.BadValue, match="above 1024"):
        inventory.strict_int("1025", 1024)
    assert inventory.parse_quantity("1e400") == 0 and inventory.parse_quantity("inf") == 0  # pods never raise


def test_divisors_by_trial_division():
    assert planner._divisors(1) == [1]
    assert planner._divisors(32) == [1, 2, 4, 8, 16, 32]
    assert planner._divisors(36) == [1, 2, 3, 4, 6, 9, 12, 18, 36]
    assert planner._divisors(97) == [1, 97]
    start = time.perf_counter()
    assert planner._divisors(10**12)[:4] == [1, 2, 4, 5] and planner._divisors(10**12)[-1] == 10**12
    assert time.perf_counter() - start < 1.0


def test_planning_a_model_of_the_most_layers_allowed_is_quick_and_more_are_refused():
    config = {"vocab_size": 32000, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 1024,
              "num_attention_heads": 8}
    model = ModelSpec.from_config(config, name="deep")
    start = time.perf_counter()
    p = planner.plan(model, inventory.build([gpu_node("h200-0")]), planner.Request())
    assert time.perf_counter() - start < 0.5
    assert p.rejection is not None or p.layout is not None
    for layers in (1025, 10**7, 2**63 - 1):
        with pytest.raises(ModelSpecError, match=rf"num_hidden_layers must be an integer in \[1, 1024\], got {layers}"):
            ModelSpec.from_config({**config, "num_hidden_layers": layers})


def test_a_model_too_small_to_measure_still_plans():
    model = ModelSpec.from_config({"vocab_size": 2, "hidden_size": 2, "intermediate_size": 1,
                                   "num_hidden_layers": 1, "num_attention_heads": 1}, name="speck")
    p = planner.plan(model, inventory.build([gpu_node("h200-0")]), planner.Request())
    assert p.status == "Planned" and p.layout.ms_per_token >= planner.MIN_MS_PER_TOKEN
    assert p.layout.tokens_per_s > 0


def test_a_one_token_context_is_refused_naming_the_field():
    with pytest.raises(ModelSpecError, match=r"max_position_embeddings must be an integer in \[2, "):
        ModelSpec.from_config({"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                               "num_hidden_layers": 32, "num_attention_heads": 32, "max_position_embeddings": 1})


@pytest.mark.parametrize(("field", "value", "words"), [
    ("max_position_embeddings", 1, r"must be an integer in \[2, "), ("num_hidden_layers", 10**7, "must be an integer"),
    ("vocab_size", 1, "must be an integer"), ("hidden_size", 1e400, "must be an integer"),
    ("rope_theta", float("inf"), r"must be a number in \(0, "), ("num_hidden_layers", "32", "must be an integer"),
    ("num_key_value_heads", 5, "must be a multiple of num_key_value_heads"),
])
def test_a_configmap_config_is_held_to_the_schema_bounds(field, value, words):
    config = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, field: value}
    spec = {"model": {"name": "m", "configMapRef": {"name": "cfg"}, "source": {"pvc": {"claimName": "c"}}}}
    with pytest.raises(specmod.SpecError, match=f"ConfigMap cfg key config.json: .*{words}") as raised:
        specmod.model_spec(spec, {"config.json": json.dumps(config)})
    assert field in str(raised.value)


def test_a_pinned_pp_that_does_not_divide_the_layers_says_so():
    spec = decode_service(parallelism={"pp": 3})["spec"]
    p = planner.plan(specmod.model_spec(spec), inventory.build([gpu_node("h200-0")]), specmod.request(spec))
    assert p.rejection is ServiceRejection.DOES_NOT_FIT
    assert "pp 3 does not divide the model's 32 layers" in p.message


def test_the_status_lists_fit_the_crd_however_many_gpu_pools():
    # 40 kinds of GPU: a model too big for all of them rejects 4 TP sizes on each.
    nodes = [gpu_node(f"n{i}", product=f"GPU-{i}", mem_mib=1024 + i) for i in range(40)]
    p = planner.plan(preset("llama3.1-405b"), inventory.build(nodes), planner.Request())
    assert len(p.alternatives) > render.MAX_STATUS_ITEMS
    status = render.plan_status(p, render.Owner("x", "default", "uid"))
    schema = crd.openapi_schema()["properties"]["status"]["properties"]
    assert len(status["alternatives"]) <= schema["alternatives"]["maxItems"] == render.MAX_STATUS_ITEMS
    assert len(status["reasons"]) <= schema["reasons"]["maxItems"]
