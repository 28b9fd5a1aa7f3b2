"""The operator running for real: kopf over HTTP against the in-process API server
(tests/helpers/kube/apiserver.py, kmock plus the behaviour of a real API server), and kubectl against it."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys

import pytest
import yaml
from helpers import ROOT
from helpers.kube.harness import (
    H100_MIB,
    cluster,
    condition,
    decode_service,
    eventually,
    gpu_node,
    operator,
    start_operator,
)

DS_PATH = "/apis/switchyard.dev/v1alpha1/namespaces/default/decodeservices"
pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(90)]


def sts_template_hash(c, name: str = "llama") -> str:
    sts = next(s for s in c.objects("StatefulSet") if s["metadata"]["name"] == name)
    return sts["spec"]["template"]["metadata"]["annotations"]["switchyard.dev/config-hash"]


async def set_ready(c, name: str, ready: int) -> None:
    """What the StatefulSet controller does when its pods pass their readiness probes."""
    status, body = await c.request("PATCH", f"/apis/apps/v1/namespaces/default/statefulsets/{name}/status",
                                   {"status": {"replicas": ready, "readyReplicas": ready}})
    assert status == 200, body


async def test_create_plans_renders_and_reports(tmp_path):
    async with cluster(tmp_path, [gpu_node("h200-0")]) as c, operator(c):
        await c.api.apply_objects([decode_service()])
        await eventually(lambda: condition(c.ds(), "Planned"), what="Planned condition")
        ds = c.ds()
        st = ds["status"]
        assert st["layoutSummary"] == "TP4xPP1xDP2 NVIDIA-H200" and st["layout"]["tp"] == 4
        assert st["observedGeneration"] == 1 and st["estimate"]["msPerToken"] > 0
        assert condition(ds, "Planned")["status"] == "True"
        assert condition(ds, "Scheduled")["status"] == "True"
        assert condition(ds, "Ready")["status"] == "False" and st["ready"] == "0/2"
        assert sorted(c.names("Service")) == ["llama", "llama-headless"]
        assert c.names("StatefulSet") == ["llama"] and c.names("ConfigMap") == ["llama-layout"]
        assert c.names("PodDisruptionBudget") == ["llama"]
        uid = ds["metadata"]["uid"]
        for kind in ("StatefulSet", "ConfigMap", "Service", "PodDisruptionBudget"):
            for obj in c.objects(kind):
                assert obj["metadata"]["ownerReferences"][0]["uid"] == uid
        # kopf's bookkeeping went to annotations, never into the strict status.
        assert "kopf" not in st
        # Events for the decision, through the events API.
        events = await eventually(lambda: [e for e in c.objects("Event") if e["reason"] == "Planned"], what="event")
        assert "TP4xPP1xDP2" in events[0]["message"]
        # The StatefulSet controller reports the pod ready: readyReplicas and Ready follow.
        await set_ready(c, "llama", 2)
        await eventually(lambda: condition(c.ds(), "Ready")["status"] == "True", what="Ready")
        assert c.ds()["status"]["readyReplicas"] == 2 and c.ds()["status"]["ready"] == "2/2"
        # A pod lost later: Ready drops and Degraded says why.
        await set_ready(c, "llama", 0)
        await eventually(lambda: condition(c.ds(), "Degraded")["status"] == "True", what="Degraded")
        assert condition(c.ds(), "Degraded")["reason"] == "ReplicasUnavailable"


async def test_spec_edit_replans_and_rolls_then_scale_then_delete(tmp_path):
    async with cluster(tmp_path, [gpu_node("h200-0")]) as c, operator(c):
        await c.api.apply_objects([decode_service()])
        await eventually(lambda: c.names("StatefulSet"), what="statefulset")
        before = sts_template_hash(c)
        # Edit the spec: throughput → 8 replicas of TP=1, new pod template, new layout file.
        status, _ = await c.request("PATCH", f"{DS_PATH}/llama", {"spec": {"objective": "throughput"}})
        assert status == 200
        await eventually(lambda: c.ds()["status"].get("observedGeneration") == 2, what="re-plan")
        (sts,) = c.objects("StatefulSet")
        assert sts["spec"]["replicas"] == 8 and sts_template_hash(c) != before
        cm = c.objects("ConfigMap")[0]["data"]["layout.json"]
        assert '"tp": 1' in cm and '"dp": 8' in cm
        # Scale through the scale subresource, as `kubectl scale` does.
        status, scale = await c.request("PATCH", f"{DS_PATH}/llama/scale", {"spec": {"replicas": 3}})
        assert status == 200 and scale["kind"] == "Scale" and scale["spec"]["replicas"] == 3
        await eventually(lambda: c.ds()["status"]["replicas"] == 3, what="scaled status")
        layout = c.ds()["status"]["layout"]
        assert layout["dp"] == 3
        # Three replicas of whatever group size gives the most tokens/s; an earlier plan's objects are pruned.
        sets = c.objects("StatefulSet")
        if layout["pp"] == 1:
            assert [s["spec"]["replicas"] for s in sets] == [3]
        else:
            assert [s["metadata"]["name"] for s in sets] == ["llama-g0", "llama-g1", "llama-g2"]
            assert all(s["spec"]["replicas"] == layout["pp"] for s in sets)
            assert sorted(c.names("ConfigMap")) == ["llama-g0-layout", "llama-g1-layout", "llama-g2-layout"]
        status, scale = await c.request("GET", f"{DS_PATH}/llama/scale")
        assert scale["status"]["replicas"] == 3 and scale["status"]["selector"] == "switchyard.dev/service=llama"
        # Delete: the DecodeService goes, and the garbage collector takes everything it owned.
        status, _ = await c.request("DELETE", f"{DS_PATH}/llama")
        assert status in (200, 202)
        await eventually(lambda: c.ds() is None, what="deleted")
        await eventually(lambda: not c.objects("StatefulSet") and not c.objects("ConfigMap")
                         and not c.objects("Service") and not c.objects("PodDisruptionBudget"), what="gc")


async def test_operator_restart_mid_reconcile_converges_without_duplicates(tmp_path):
    async with cluster(tmp_path, [gpu_node("h200-0")]) as c:
        # The first operator dies while its StatefulSet request is in flight (the request is lost).
        gate = c.api.gate("POST", "statefulsets", fail=True)
        old = os.environ.get("KUBECONFIG")
        first = await start_operator(c, identity="operator-a")
        try:
            await c.api.apply_objects([decode_service()])
            await asyncio.wait_for(gate.reached.wait(), 20)
            assert c.names("StatefulSet") == [] and c.names("ConfigMap") == ["llama-layout"]
            first.stop.set()
            gate.release.set()
        finally:
            await first.close()
        assert c.names("StatefulSet") == [] and condition(c.ds(), "Planned") is None
        async with operator(c, identity="operator-b"):
            await eventually(lambda: c.names("StatefulSet") == ["llama"], what="statefulset")
            await eventually(lambda: condition(c.ds(), "Planned"), what="status")
        if old is not None:
            os.environ["KUBECONFIG"] = old
        assert c.names("ConfigMap") == ["llama-layout"] and sorted(c.names("Service")) == ["llama", "llama-headless"]
        creates = [(plural, name) for method, plural, name, _agent in c.api.writes if method == "POST"]
        for plural, name in (("configmaps", "llama-layout"), ("services", "llama"), ("statefulsets", "llama")):
            assert creates.count((plural, name)) == 1, (plural, name, creates)


async def test_lost_node_degrades_and_replans(tmp_path):
    model = {"name": "llama-3-70b", "preset": "llama3-70b", "source": {"pvc": {"claimName": "m"}}}
    async with cluster(tmp_path, [gpu_node("h200-0"), gpu_node("h200-1")]) as c, operator(c, replan_interval_s=0.3):
        await c.api.apply_objects([decode_service(model=model, parallelism={"tp": 8})])
        await eventually(lambda: (c.ds()["status"].get("layout") or {}).get("dp") == 2, what="two replicas")
        assert c.objects("StatefulSet")[0]["spec"]["replicas"] == 2
        status, _ = await c.request("DELETE", "/api/v1/nodes/h200-1")
        assert status == 200
        await eventually(lambda: condition(c.ds(), "Degraded")["reason"] == "CapacityLost", what="Degraded")
        ds = c.ds()
        assert ds["status"]["layout"]["dp"] == 1 and ds["status"]["layout"]["placement"] == [["h200-0"]]
        assert "h200-1" in condition(ds, "Degraded")["message"]
        await eventually(lambda: c.objects("StatefulSet")[0]["spec"]["replicas"] == 1, what="sts shrunk")
        await eventually(lambda: [e for e in c.objects("Event") if e["reason"] == "Replanned"], what="event")
        # The last node goes NotReady: nothing fits, no StatefulSet pods are left pending forever.
        status, _ = await c.request("PATCH", "/api/v1/nodes/h200-0/status",
                                    {"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
        assert status == 200
        await eventually(lambda: condition(c.ds(), "Planned")["reason"] == "NoGPUNodes", what="no nodes")
        assert c.objects("StatefulSet") == []


async def test_model_larger_than_the_cluster_creates_no_pods(tmp_path):
    model = {"name": "llama-405b", "preset": "llama3.1-405b", "source": {"pvc": {"claimName": "m"}}}
    nodes = [gpu_node("h100-0", "NVIDIA-H100-80GB-HBM3", mem_mib=H100_MIB)]
    async with cluster(tmp_path, nodes) as c, operator(c):
        await c.api.apply_objects([decode_service(model=model)])
        cond = await eventually(lambda: condition(c.ds(), "Planned"), what="Planned")
        assert cond["status"] == "False" and cond["reason"] == "DoesNotFit" and "does not fit" in cond["message"]
        assert condition(c.ds(), "Scheduled")["status"] == "False"
        assert c.objects("StatefulSet") == [] and c.objects("ConfigMap") == []
        assert c.ds()["status"]["alternatives"]
        await eventually(lambda: [e for e in c.objects("Event") if e["reason"] == "DoesNotFit"
                                  and e["type"] == "Warning"], what="warning event")


# ---- kubectl against the in-process API server ------------------------------------------------------
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")


async def kubectl(c, *args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        KUBECTL, *args, env={**os.environ, "KUBECONFIG": str(c.kubeconfig)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await proc.communicate()
    return proc.returncode, out.decode()


@needs_kubectl
async def test_kubectl_apply_examples(tmp_path):
    examples = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))
    nodes = [gpu_node("h200-0"), gpu_node("h200-1"), gpu_node("h100-0", "NVIDIA-H100-80GB-HBM3", mem_mib=H100_MIB)]
    for node in nodes:
        node["metadata"]["labels"]["node-role.example.com/inference"] = "true"
    async with cluster(tmp_path, nodes) as c, operator(c, replan_interval_s=0.3):
        rc, out = await kubectl(c, "apply", "--validate=false", *[a for p in examples for a in ("-f", str(p))])
        assert rc == 0, out
        names = [yaml.safe_load(p.read_text())["metadata"]["name"] for p in examples]
        for name in names:
            assert f"decodeservice.switchyard.dev/{name} created" in out
        rc, out = await kubectl(c, "get", "decodeservices", "-o", "name")
        assert rc == 0 and sorted(out.split()) == sorted(f"decodeservice.switchyard.dev/{n}" for n in names)
        # Every example gets a decision; the one whose config.json ConfigMap is missing says so, and
        # is planned once the ConfigMap appears (the periodic check retries).
        for name in names:
            await eventually(lambda name=name: condition(c.ds(name), "Planned"), what=f"{name} planned")
        cond = condition(c.ds("llama-3-70b"), "Planned")
        assert cond["reason"] == "InvalidModel" and "llama-3-70b-config" in cond["message"]
        config = tmp_path / "config.json"
        import json

        from switchyard.service.modelspec import preset
        config.write_text(json.dumps(preset("llama3-70b").to_config()))
        rc, out = await kubectl(c, "create", "configmap", "llama-3-70b-config", f"--from-file={config}")
        assert rc == 0, out
        await eventually(lambda: condition(c.ds("llama-3-70b"), "Planned")["status"] == "True", what="70b planned")
        trt = next(s for s in c.objects("StatefulSet") if s["metadata"]["name"] == "llama-3-8b-trtllm")
        assert trt["spec"]["template"]["spec"]["containers"][0]["command"][0] == "trtllm-serve"
        pinned = c.ds("llama-3-8b-pinned")["status"]["layout"]
        assert (pinned["tp"], pinned["dp"], pinned["strategy"]) == (2, 2, "twoshot")
        # The printer columns: layout, readiness, estimated ms/token, KV cache tokens per replica, age.
        rc, out = await kubectl(c, "get", "decodeservices")
        header, *rows = out.splitlines()
        assert header.split() == ["NAME", "LAYOUT", "READY", "MS/TOKEN", "KV", "TOKENS", "AGE"], out
        row = next(r for r in rows if r.startswith("llama-3-8b-pinned "))
        lay = c.ds("llama-3-8b-pinned")["status"]
        assert lay["layoutSummary"] in row and f"{lay['estimate']['msPerToken']:g}" in row and " 0/2 " in row
        assert f" {lay['layout']['kvTokens']} " in row and lay["layout"]["kvTokens"] >= lay["layout"]["maxSeqLen"]
        # Re-applying changes nothing; kubectl scale goes through the scale subresource.
        rc, out = await kubectl(c, "apply", "--validate=false", "-f", str(examples[0]))
        assert rc == 0 and "unchanged" in out, out
        rc, out = await kubectl(c, "scale", "decodeservice/llama-3-8b", "--replicas=2")
        assert rc == 0, out
        await eventually(lambda: c.ds("llama-3-8b")["status"]["replicas"] == 2, what="scaled")


@needs_kubectl
async def test_kubectl_bad_resource_is_rejected_by_the_api_server(tmp_path):
    bad = decode_service(objective="fastest")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    async with cluster(tmp_path, [gpu_node("h200-0")]) as c:
        rc, out = await kubectl(c, "apply", "--validate=false", "-f", str(path))
        assert rc != 0 and "spec.objective: 'fastest' is not one of" in out, out
        assert c.ds() is None


async def test_two_replicas_do_not_fight(tmp_path):
    async with cluster(tmp_path, [gpu_node("h200-0")]) as c:
        low = await start_operator(c, identity="replica-low", priority=100)
        high = await start_operator(c, identity="replica-high", priority=200)
        try:
            # Peering is eventually consistent: once both replicas are in the peering object and a
            # whole peering lifetime (2 s, so at least one keep-alive round of each) has passed, the
            # lower one has paused, however loaded the machine.
            peering = c.api.plural_of("kopf.dev/v1", "ClusterKopfPeering")
            await eventually(lambda: {"replica-low", "replica-high"} <= set(
                (c.api.stored(peering, None, "switchyard") or {}).get("status", {})), what="peers")
            await asyncio.sleep(2.5)
            await c.api.apply_objects([decode_service()])
            await eventually(lambda: condition(c.ds(), "Planned"), what="planned")
            await asyncio.sleep(1.5)  # give the paused replica every chance to interfere
            agents = {agent for *_, agent in c.api.writes if agent.startswith("switchyard-operator")}
            assert agents == {"switchyard-operator/replica-high"}, agents
            await high.close()
            # The remaining replica takes over once the leader has left the peering object.
            status, _ = await c.request("PATCH", f"{DS_PATH}/llama", {"spec": {"objective": "throughput"}})
            assert status == 200
            await eventually(lambda: c.ds()["status"].get("observedGeneration") == 2, what="re-plan by the other")
            assert any(agent == "switchyard-operator/replica-low" for *_, agent in c.api.writes)
        finally:
            await low.close()
            if high.thread.is_alive():
                await high.close()


async def test_switchyard_operator_command(tmp_path):
    """`switchyard operator` as the Deployment runs it: its own process, peering, liveness endpoint."""
    import signal
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with cluster(tmp_path, [gpu_node("h200-0")]) as c:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "switchyard.cli.main", "operator", "--replan-interval", "1",
            "--liveness", f"http://127.0.0.1:{port}/healthz",
            env={**os.environ, "KUBECONFIG": str(c.kubeconfig)},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            await c.api.apply_objects([decode_service()])
            await eventually(lambda: condition(c.ds(), "Planned"), timeout=30, what="planned by the command")
            assert c.names("StatefulSet") == ["llama"]
            import aiohttp

            async with aiohttp.ClientSession() as session, session.get(f"http://127.0.0.1:{port}/healthz") as response:
                assert response.status == 200
        finally:
            proc.send_signal(signal.SIGTERM)
            out, _ = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0, out.decode()[-2000:]
        assert "Planned" in out.decode() or "TP4xPP1xDP2" in out.decode()
