"""End to end against the test API server: what the operator does when the API server refuses an
object it renders, and when a node carries labels it cannot read."""

from __future__ import annotations

import pytest
from helpers.kube.harness import cluster, condition, decode_service, eventually, gpu_node, operator

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(90)]
DS_PATH = "/apis/switchyard.dev/v1alpha1/namespaces/default/decodeservices"
POLICY = "images must come from registry.internal"


def allowed_registry(sts: dict) -> list[str]:
    """An admission policy of the cluster: pod images from one registry only."""
    containers = sts["spec"]["template"]["spec"]["containers"]
    return [f"spec.template.spec.containers[{i}].image: {POLICY}" for i, c in enumerate(containers)
            if not c["image"].startswith("registry.internal/")]


async def test_a_refused_object_is_reported_in_a_condition_and_an_event(tmp_path):
    async with cluster(tmp_path, [gpu_node("h200-0")]) as c, operator(c):
        c.api.policies.append(("statefulsets", allowed_registry))
        await c.api.apply_objects([decode_service(image="registry.example.com/switchyard:1")])
        degraded = await eventually(
            lambda: (d := condition(c.ds(), "Degraded")) and d["reason"] == "ObjectRejected" and d,
            what="Degraded ObjectRejected")
        assert degraded["status"] == "True"
        assert "StatefulSet/llama" in degraded["message"] and POLICY in degraded["message"]
        assert "spec.template.spec.containers[0].image" in degraded["message"]
        assert condition(c.ds(), "Ready")["status"] == "False"
        events = await eventually(lambda: [e for e in c.objects("Event") if e["reason"] == "ObjectRejected"],
                                  what="ObjectRejected event")
        assert POLICY in events[0]["message"]
        # The objects the API server took are there; the refused one is not.
        assert c.names("StatefulSet") == [] and "llama" in c.names("Service")
        # An image the policy allows: the next reconcile creates the StatefulSet and clears the condition.
        status, body = await c.request("PATCH", f"{DS_PATH}/llama", {"spec": {"image": "registry.internal/s:1"}})
        assert status == 200, body
        await eventually(lambda: c.names("StatefulSet") == ["llama"], what="StatefulSet created")
        await eventually(lambda: condition(c.ds(), "Degraded")["reason"] != "ObjectRejected", what="cleared")


async def test_a_mislabelled_node_is_named_in_a_warning_and_the_others_serve(tmp_path):
    bad = gpu_node("hgx-bad-0")
    bad["metadata"]["labels"]["nvidia.com/gpu.memory"] = "Infinity"
    async with cluster(tmp_path, [bad, gpu_node("h200-0")]) as c, operator(c):
        await c.api.apply_objects([decode_service()])
        planned = await eventually(lambda: condition(c.ds(), "Planned"), what="Planned")
        assert planned["status"] == "True"
        assert c.ds()["status"]["layout"]["placement"] == [["h200-0"], ["h200-0"]]
        events = await eventually(lambda: [e for e in c.objects("Event") if e["reason"] == "BadNodeLabel"],
                                  what="BadNodeLabel event")
        assert "hgx-bad-0" in events[0]["message"] and "nvidia.com/gpu.memory" in events[0]["message"]
        assert events[0]["type"] == "Warning" and events[0]["involvedObject"]["kind"] == "DecodeService"
