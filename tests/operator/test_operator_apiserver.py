"""The in-process API server behaves like a real one where the operator tests rely on it (each
behaviour the fixture adds to kmock, checked over HTTP)."""

from __future__ import annotations

import asyncio
import json

import pytest
from helpers.kube.harness import cluster, decode_service, gpu_node

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]
CM = "/api/v1/namespaces/default/configmaps"
DS = "/apis/switchyard.dev/v1alpha1/namespaces/default/decodeservices"


async def test_create_metadata_conflicts_and_optimistic_concurrency(tmp_path):
    async with cluster(tmp_path, []) as c:
        status, obj = await c.request("POST", CM, {"apiVersion": "v1", "kind": "ConfigMap",
                                                   "metadata": {"name": "a"}, "data": {"k": "v"}})
        assert status == 201
        meta = obj["metadata"]
        assert meta["uid"] and meta["creationTimestamp"] and meta["namespace"] == "default"
        assert int(meta["resourceVersion"]) > 0
        status, err = await c.request("POST", CM, {"metadata": {"name": "a"}})
        assert status == 409 and err["reason"] == "AlreadyExists"
        status, err = await c.request("POST", "/api/v1/namespaces/nowhere/configmaps", {"metadata": {"name": "a"}})
        assert status == 404 and 'namespaces "nowhere" not found' in err["message"]
        # A write carrying an old resourceVersion loses.
        status, new = await c.request("PATCH", f"{CM}/a", {"data": {"k": "w"}})
        assert status == 200 and int(new["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])
        status, err = await c.request("PUT", f"{CM}/a", {**obj, "data": {"k": "x"}})
        assert status == 409 and err["reason"] == "Conflict"
        status, err = await c.request("PATCH", f"{CM}/a", {"metadata": {"resourceVersion": meta["resourceVersion"]}})
        assert status == 409
        status, _ = await c.request("PATCH", f"{CM}/a", {"x": 1}, content_type="application/apply-patch+yaml")
        assert status == 415
        status, lst = await c.request("GET", CM)
        assert lst["kind"] == "ConfigMapList" and lst["apiVersion"] == "v1" and lst["metadata"]["resourceVersion"]
        status, core = await c.request("GET", "/api/v1")
        assert status == 200 and core["kind"] == "APIResourceList"
        kinds = {r["name"]: r["kind"] for r in core["resources"]}
        assert kinds["pods"] == "Pod" and kinds["nodes"] == "Node" and kinds["configmaps"] == "ConfigMap"
        status, version = await c.request("GET", "/version")
        assert (version["major"], version["minor"]) == ("1", "31")


async def test_crd_serves_its_resource_with_status_and_scale_subresources(tmp_path):
    async with cluster(tmp_path, []) as c:
        status, disc = await c.request("GET", "/apis/switchyard.dev/v1alpha1")
        names = {r["name"] for r in disc["resources"]}
        assert {"decodeservices", "decodeservices/status", "decodeservices/scale"} <= names
        status, obj = await c.request("POST", DS, {**decode_service(), "status": {"replicas": 9}})
        assert status == 201 and "status" not in obj  # status only through /status
        assert obj["spec"]["objective"] == "latency" and obj["spec"]["engine"] == "switchyard"  # defaults
        assert obj["metadata"]["generation"] == 1
        # /status changes only the status; the main resource ignores status.
        status, obj = await c.request("PATCH", f"{DS}/llama/status",
                                      {"status": {"replicas": 2}, "spec": {"replicas": 7}})
        assert obj["status"] == {"replicas": 2} and "replicas" not in obj["spec"] and obj["metadata"]["generation"] == 1
        status, obj = await c.request("PATCH", f"{DS}/llama", {"status": {"replicas": 5}, "spec": {"replicas": 4}})
        assert obj["status"] == {"replicas": 2} and obj["spec"]["replicas"] == 4 and obj["metadata"]["generation"] == 2
        # Schema admission: a bad value is rejected with the field; unknown fields are pruned.
        status, err = await c.request("PATCH", f"{DS}/llama", {"spec": {"objective": "fastest"}})
        assert status == 422 and "spec.objective: 'fastest' is not one of" in err["message"]
        status, obj = await c.request("PATCH", f"{DS}/llama", {"spec": {"gpus": 8}})
        assert status == 200 and "gpus" not in obj["spec"]
        status, scale = await c.request("GET", f"{DS}/llama/scale")
        assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 4 and scale["status"]["replicas"] == 2


async def test_watch_resumes_from_a_resource_version_without_losing_events(tmp_path):
    async with cluster(tmp_path, []) as c:
        _, first = await c.request("POST", CM, {"metadata": {"name": "a"}})
        since = first["metadata"]["resourceVersion"]
        # Changes while nobody watches.
        await c.request("PATCH", f"{CM}/a", {"data": {"k": "1"}})
        await c.request("POST", CM, {"metadata": {"name": "b"}})
        await c.request("DELETE", f"{CM}/a")
        events = []
        async with c.api.get(f"{CM}?watch=true&resourceVersion={since}&timeoutSeconds=1") as response:
            async for line in response.content:
                if line.strip():
                    events.append(json.loads(line))
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
            ("MODIFIED", "a"), ("ADDED", "b"), ("DELETED", "a")]


async def test_finalizers_and_garbage_collection(tmp_path):
    async with cluster(tmp_path, [gpu_node("n")]) as c:
        _, owner = await c.request("POST", DS, {**decode_service(), "metadata": {
            "name": "llama", "finalizers": ["example.com/hold"]}})
        ref = {"apiVersion": "switchyard.dev/v1alpha1", "kind": "DecodeService", "name": "llama",
               "uid": owner["metadata"]["uid"], "controller": True}
        await c.request("POST", CM, {"metadata": {"name": "owned", "ownerReferences": [ref]}})
        await c.request("POST", CM, {"metadata": {"name": "free"}})
        status, obj = await c.request("DELETE", f"{DS}/llama")
        assert status == 202 and obj["metadata"]["deletionTimestamp"]
        assert c.ds() is not None and "owned" in c.names("ConfigMap")
        await c.request("PATCH", f"{DS}/llama", {"metadata": {"finalizers": None}})
        assert c.ds() is None
        for _ in range(50):
            if "owned" not in c.names("ConfigMap"):
                break
            await asyncio.sleep(0.02)
        assert c.names("ConfigMap") == ["free"]
