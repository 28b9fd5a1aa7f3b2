"""Test harness: the in-process API server on a TCP port, a kubeconfig pointing at it, the real
operator (kopf over HTTP) started and stopped at will, fake HGX nodes, and polling helpers."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import os
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kmock
import kopf
from switchyard.operator import crd
from switchyard.operator.handlers import OperatorConfig, register
from switchyard.operator.kube import USER_AGENT, Kube
from switchyard.operator.render import RenderConfig

from helpers.kube.apiserver import ApiServer

DS = ("switchyard.dev", "v1alpha1", "decodeservices")
H200_MIB = 143771
H100_MIB = 81559


def gpu_node(name: str, product: str = "NVIDIA-H200", gpus: int = 8, mem_mib: int = H200_MIB,
             ready: bool = True, taints: list[dict[str, str]] | None = None) -> dict[str, Any]:
    """A Node as GPU Feature Discovery and the device plugin publish it on an HGX board."""
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": {
            "kubernetes.io/hostname": name, "nvidia.com/gpu.product": product,
            "nvidia.com/gpu.count": str(gpus), "nvidia.com/gpu.memory": str(mem_mib),
            "nvidia.com/gpu.present": "true"}},
        "spec": {"taints": taints if taints is not None else
                 [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}]},
        "status": {"capacity": {"nvidia.com/gpu": str(gpus), "cpu": "192", "memory": "2Ti"},
                   "allocatable": {"nvidia.com/gpu": str(gpus), "cpu": "190", "memory": "2000Gi"},
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def decode_service(name: str = "llama", namespace: str = "default", **spec: Any) -> dict[str, Any]:
    body = {"model": {"name": "llama-3-8b", "preset": "llama3-8b", "source": {"pvc": {"claimName": "models"}}},
            "objective": "latency"}
    body.update(spec)
    return {"apiVersion": "switchyard.dev/v1alpha1", "kind": "DecodeService",
            "metadata": {"name": name, "namespace": namespace}, "spec": body}


@dataclasses.dataclass
class Cluster:
    api: ApiServer
    url: str
    kubeconfig: Path

    def ds(self, name: str = "llama", namespace: str = "default") -> dict[str, Any] | None:
        return self.api.stored(self.api.plural_of("switchyard.dev/v1alpha1", "DecodeService"), namespace, name)

    def objects(self, kind: str, namespace: str | None = "default") -> list[dict[str, Any]]:
        api_version = {"StatefulSet": "apps/v1", "PodDisruptionBudget": "policy/v1"}.get(kind, "v1")
        return self.api.all(self.api.plural_of(api_version, kind), namespace)

    def names(self, kind: str, namespace: str | None = "default") -> list[str]:
        return [o["metadata"]["name"] for o in self.objects(kind, namespace)]

    async def request(self, method: str, path: str, body: Any = None,
                      content_type: str = "application/merge-patch+json") -> tuple[int, Any]:
        async with self.api.request(method, path, json=body, headers={"Content-Type": content_type}) as response:
            return response.status, await response.json()


@contextlib.asynccontextmanager
async def cluster(tmp_path: Path, nodes: list[dict[str, Any]]) -> AsyncIterator[Cluster]:
    async with ApiServer() as api, kmock.Server(api) as server:
        url = f"http://{server.host}:{server.port}"
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters: [{{name: test, cluster: {{server: '{url}'}}}}]\n"
            "users: [{name: test, user: {token: test-token}}]\n"
            "contexts: [{name: test, context: {cluster: test, user: test, namespace: default}}]\n"
            "current-context: test\n")
        # What the chart installs: the CRDs and the peering object.
        await api.apply_objects([crd.load_crd(), crd.load_peering_crd(), *copy.deepcopy(nodes)])
        await api.apply_objects([{"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering",
                                  "metadata": {"name": "switchyard"}}])
        try:
            yield Cluster(api, url, kubeconfig)
        finally:
            await api.close_watches()
            for task in list(api.gc_tasks):
                task.cancel()
        uncovered = rbac_uncovered(api.verbs)
        assert not uncovered, f"operator requests that operator/rbac.yaml does not allow: {uncovered}"


def rbac_uncovered(verbs: set[tuple[str, str, str, str]]) -> list[tuple[str, str, str]]:
    """Requests by the operator (kopf or its own client) that operator/rbac.yaml does not allow."""
    allowed = {(verb, group, res) for rule in crd.load_rbac_rules() for group in rule["apiGroups"]
               for res in rule["resources"] for verb in rule["verbs"]}
    operator_agents = ("kopf/", USER_AGENT)
    return sorted({(verb, group, res) for agent, verb, group, res in verbs
                   if agent.startswith(operator_agents) and (verb, group, res) not in allowed})


@dataclasses.dataclass
class Operator:
    """The real operator: our handlers in kopf, talking HTTP to the API server. It runs in its own
    thread and event loop, as in its own process: kopf treats every task of its loop as its own."""

    thread: threading.Thread
    stop: threading.Event
    kube: Kube

    async def close(self, timeout: float = 15.0) -> None:
        self.stop.set()
        await asyncio.to_thread(self.thread.join, timeout)
        assert not self.thread.is_alive(), "the operator did not stop"
        self.kube.api.close()


async def start_operator(c: Cluster, replan_interval_s: float = 0.5, identity: str = "operator-1",
                         priority: int = 0) -> Operator:
    os.environ["KUBECONFIG"] = str(c.kubeconfig)
    kube = Kube.from_environment()
    kube.api.user_agent = f"{USER_AGENT}/{identity}"  # which replica wrote what
    registry = kopf.OperatorRegistry()
    # A short peering lifetime: a replica that dies mid-reconcile holds the others back for 2 s,
    # not kopf's default minute.
    register(registry, OperatorConfig(render=RenderConfig(), replan_interval_s=replan_interval_s,
                                      peering_name="switchyard", peering_lifetime_s=2, retry_delay_s=1), kube)
    stop, ready = threading.Event(), threading.Event()

    def main() -> None:
        asyncio.run(kopf.operator(
            registry=registry, clusterwide=True, peering_name="switchyard", standalone=False,
            identity=identity, priority=priority, stop_flag=stop, ready_flag=ready))

    thread = threading.Thread(target=main, name=f"kopf-{identity}", daemon=True)
    thread.start()
    if not await asyncio.to_thread(ready.wait, 20):
        raise AssertionError("the operator did not start")
    return Operator(thread, stop, kube)


@contextlib.asynccontextmanager
async def operator(c: Cluster, replan_interval_s: float = 0.5, identity: str = "operator-1") -> AsyncIterator[Operator]:
    old = os.environ.get("KUBECONFIG")
    try:
        op = await start_operator(c, replan_interval_s, identity)
        try:
            yield op
        finally:
            await op.close()
    finally:
        if old is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = old


async def eventually(check: Callable[[], Any], timeout: float = 20.0, what: str = "") -> Any:
    """Poll until ``check()`` returns something truthy (the operator works asynchronously)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (KeyError, TypeError, IndexError, StopIteration) as err:
            last = err
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what or check}: last {last!r}")


def condition(ds: dict[str, Any] | None, ctype: str) -> dict[str, Any] | None:
    for c in ((ds or {}).get("status") or {}).get("conditions", []):
        if c["type"] == ctype:
            return c
    return None
