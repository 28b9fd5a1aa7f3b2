"""Rejections carry their kind as data: the plan its ServiceRejection (the condition and Event reason),
each rejected layout its LayoutRejection, a SpecError INVALID_MODEL; code that tells them apart
compares kinds, never message texts."""

from __future__ import annotations

import itertools

import pytest
from helpers.kube.harness import H100_MIB, decode_service, gpu_node
from switchyard.operator import inventory, planner, render
from switchyard.operator import spec as specmod
from switchyard.operator.planner import Alternative
from switchyard.operator.rejections import LayoutRejection, ServiceRejection
from switchyard.service.modelspec import ModelSpec, preset

# A model without grouped-query attention: its KV cache outgrows the GPUs long before its weights do.
MHA = ModelSpec.from_config({"vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
                             "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 64,
                             "max_position_embeddings": 131072}, name="mha-70b")
LONG = {"input_tokens": 120000, "output_tokens": 8000}
# What each kind's message says, for people.
TEXTS = {
    LayoutRejection.HEADS_DO_NOT_SPLIT: ("do not split",),
    LayoutRejection.NODE_TOO_SMALL: ("GPUs in one NVSwitch domain; nodes have",),
    LayoutRejection.NEEDS_NVSWITCH: ("needs an NVSwitch domain",),
    LayoutRejection.WEIGHTS_TOO_LARGE: ("per GPU exceed the",),
    LayoutRejection.NO_KV_ROOM: ("no room for the KV cache",),
    LayoutRejection.GROUP_NEVER_FITS: ("even when empty",),
    LayoutRejection.NO_ALLREDUCE_FIGURE: ("no calibrated figure",),
    LayoutRejection.SHORT_OF_REPLICAS: ("replicas can be placed",),
    LayoutRejection.SLO_NOT_MET: ("SLO not met", "tokens/s needs"),
    LayoutRejection.RANKED_LOWER: ("slower:", "fewer tokens/s:", "tokens/s per GPU vs"),
}


def h200(n: int, prefix: str = "h200", **kw) -> list[dict]:
    return [gpu_node(f"{prefix}-{i}", **kw) for i in range(n)]


def h100(n: int, gpus: int = 8) -> list[dict]:
    return [gpu_node(f"h100-{i}", "NVIDIA-H100-80GB-HBM3", gpus=gpus, mem_mib=H100_MIB) for i in range(n)]


def plan(model: str | ModelSpec, nodes: list[dict], pods: list[dict] | None = None, **request) -> planner.Plan:
    spec = preset(model) if isinstance(model, str) else model
    return planner.plan(spec, inventory.build(nodes, pods or []), planner.Request(**request))


def test_a_plan_carries_its_rejection_and_the_reason_it_gives():
    cases = {
        None: plan("llama3-8b", h200(1), objective="latency"),
        ServiceRejection.NO_GPU_NODES: plan("llama3-8b", []),
        ServiceRejection.DOES_NOT_FIT: plan("llama3.1-405b", h100(1)),
        ServiceRejection.INSUFFICIENT_CAPACITY: plan("llama3-70b", h100(1), objective="latency", tp=8, replicas=3),
    }
    for rejection, p in cases.items():
        assert p.rejection is rejection
        assert p.status == (rejection.value if rejection else "Planned") and type(p.status) is str
    assert [r.value for r in ServiceRejection] == ["InvalidModel", "NoGPUNodes", "DoesNotFit", "InsufficientCapacity"]
    assert specmod.SpecError("bad config.json").kind is ServiceRejection.INVALID_MODEL


SCENARIOS = [
    *[("tiny", nodes, req) for nodes, req in itertools.product(
        [h200(1), [gpu_node("s-0", gpus=1)], [gpu_node("p-0", "NVIDIA-L40S", gpus=4, mem_mib=46068)]],
        [{}, {"objective": "throughput"}, {"max_tpot_ms": 0.01}, {"replicas": 5}, {"tp": 4, "strategy": "oneshot"},
         {"tp": 2, "pp": 4}, {"pp": 2}])],
    *[(m, nodes, req) for m, nodes, req in itertools.product(
        ["llama3-8b", "llama3-70b", "llama3.1-405b"], [h200(1), h200(2), h100(1)],
        [{}, {"objective": "latency"}, {"max_tpot_ms": 5}, {"max_tpot_ms": 3}, {"target_tokens_per_s": 1e7},
         {"pp": 2}])],
    (MHA, h100(1, gpus=4), LONG),
    (MHA, h200(1), {**LONG, "tp": 2, "pp": 2}),
]


def test_every_rejected_layout_carries_the_kind_its_message_states():
    seen = set()
    for model, nodes, request in SCENARIOS:
        for alt in plan(model, nodes, **request).alternatives:
            assert any(text in alt.rejected for text in TEXTS[alt.kind]), (alt.kind, alt.rejected)
            seen.add(alt.kind)
    # Every kind but the all-reduce one (the calibration has a figure for every size) shows up.
    assert seen == set(LayoutRejection) - {LayoutRejection.NO_ALLREDUCE_FIGURE}


def test_groups_that_never_fit_are_told_apart_by_kind_not_by_text():
    # Texts swapped on purpose: the memory miss is preferred because of its kind.
    never = Alternative("TP8xPP2 X", None, None, "weights 1 GiB per GPU exceed", LayoutRejection.GROUP_NEVER_FITS)
    memory = Alternative("TP8xPP4 X", None, None, "does not fit even when empty", LayoutRejection.WEIGHTS_TOO_LARGE)
    assert planner._closest_misses([never, memory]) == [memory]
    # Once a layout is found, groups that fit no node set say nothing; when none is, they explain why.
    planned = plan("tiny", [gpu_node("s-0", gpus=1)])
    assert planned.layout is not None and planned.alternatives
    assert LayoutRejection.GROUP_NEVER_FITS not in {a.kind for a in planned.alternatives}
    pinned = plan("tiny", [gpu_node("s-0", gpus=1)], pp=2)
    assert pinned.rejection is ServiceRejection.DOES_NOT_FIT
    assert [a.kind for a in pinned.alternatives] == [
        LayoutRejection.NODE_TOO_SMALL, LayoutRejection.NODE_TOO_SMALL, LayoutRejection.HEADS_DO_NOT_SPLIT,
        LayoutRejection.GROUP_NEVER_FITS]


@pytest.mark.parametrize("name", ["llama-3-8b", "target-8b"])
def test_the_slo_condition_states_the_miss_the_plan_carries(name):
    # A model name that reads like an SLO message does not stand in for the miss.
    body = decode_service(model={"name": name, "preset": "llama3-8b", "source": {"pvc": {"claimName": "m"}}},
                          slo={"maxTimePerOutputTokenMs": 0.5})
    spec = specmod.normalized(body["spec"])
    p = planner.plan(specmod.model_spec(spec), inventory.build(h200(1)), specmod.request(spec))
    assert not p.slo_met and p.slo_miss.startswith("SLO not met: even one sequence per replica takes")
    assert p.slo_miss in p.reasons
    (degraded,) = [c for c in render.conditions_for(p, 0, 1, [], "T") if c["type"] == "Degraded"]
    assert (degraded["status"], degraded["reason"], degraded["message"]) == ("True", "SLONotMet", p.slo_miss)
    met = plan("llama3-8b", h200(1))
    assert met.slo_met and met.slo_miss == ""
