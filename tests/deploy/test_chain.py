"""Install to generate, on CPU: the chart's objects and a fake HGX inventory go into the in-process
Kubernetes API server (tests/helpers/kube/apiserver.py), the operator runs exactly as the chart's
Deployment starts it (`switchyard operator` + its args, in its own process), the tiny example
DecodeService is applied, and `switchyard serve` runs with exactly the command, args, env and
mounted layout file of the StatefulSet the operator wrote. Generate goes through the port the
Service names, the trace is read back with `switchyard trace`, and the span reaches the OTLP
collector that the chart's otel.endpoint named.

What is substituted, because it cannot exist here, is listed in tests/helpers/chain_pod.py; besides that,
JAX runs on CPU (JAX_PLATFORMS=cpu, one CPU device per planned GPU) and the operator authenticates
with a kubeconfig instead of its mounted service-account token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import kmock
import pytest
import yaml
from helpers import HELPERS
from helpers.chain_pod import Localizer, container_env, pod_of, volume_sources
from helpers.chart_helpers import ROOT, one, template
from helpers.kube.apiserver import ApiServer
from helpers.kube.harness import Cluster, condition, eventually

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(150)]
BIN = Path(sys.executable).parent  # where `switchyard` is installed next to this Python
EXAMPLE = ROOT / "manifests" / "examples" / "tiny.yaml"
NODES = HELPERS / "kube" / "nodes-hgx.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(home: Path) -> dict[str, str]:
    """A clean process environment (not this test runner's, whose XLA_FLAGS fake 4 devices)."""
    return {"PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}", "HOME": str(home),
            "PYTHONUNBUFFERED": "1", "LANG": "C.UTF-8"}


@contextlib.asynccontextmanager
async def api_server(tmp_path: Path):
    """The operator tests' API server on a TCP port, empty: nothing is pre-installed."""
    async with ApiServer() as api, kmock.Server(api) as server:
        url = f"http://{server.host}:{server.port}"
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": url}}],
            "users": [{"name": "test", "user": {"token": "test-token"}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}]}))
        try:
            yield Cluster(api, url, kubeconfig)
        finally:
            for task in list(api.gc_tasks):
                task.cancel()


@contextlib.contextmanager
def otlp_collector():
    """A real OTLP/gRPC receiver for traces and metrics, on a localhost port."""
    from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received: list[Any] = []

    class Traces(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
        def Export(self, request, context):
            return metrics_service_pb2.ExportMetricsServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield port, received
    finally:
        server.stop(0)


async def run(*argv: str, env: dict[str, str], timeout: float = 60) -> str:
    proc = await asyncio.create_subprocess_exec(*argv, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    text = out.decode()
    assert proc.returncode == 0, f"{' '.join(argv)} exited {proc.returncode}:\n{text}"
    return text


@contextlib.asynccontextmanager
async def process(argv: list[str], env: dict[str, str], log: Path):
    """A long-running process; SIGTERM at the end (as the kubelet stops a container), exit code 0."""
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise AssertionError(f"{argv[:2]} ignored SIGTERM:\n{log.read_text()[-3000:]}") from None
    assert proc.returncode == 0, f"{argv[:2]} exited {proc.returncode}:\n{log.read_text()[-3000:]}"


async def until_http_ok(url: str, proc: subprocess.Popen, log: Path, timeout: float = 30) -> None:
    """What the Deployment's startupProbe does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"{url} never answered:\n{log.read_text()[-3000:]}")


def post_json(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


async def until_serving(target: str, proc: subprocess.Popen, log: Path, timeout: float = 90) -> None:
    """What the StatefulSet's grpc readiness probe does: grpc.health.v1 Check of the server ("")."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"serve exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            try:
                if stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status == 1:
                    return
            except grpc.RpcError:
                pass
            await asyncio.sleep(0.2)
    raise AssertionError(f"serve never became SERVING:\n{log.read_text()[-3000:]}")


def layout_summary(ds: dict[str, Any]) -> str:
    return ds["status"]["layoutSummary"].split()[0]


def covered(rules: list[dict[str, Any]], verb: str, group: str, res: str) -> bool:
    return any(verb in r["verbs"] and group in r["apiGroups"] and res in r["resources"] for r in rules)


async def test_install_apply_generate_trace(tmp_path):
    health_port = free_port()
    with otlp_collector() as (otlp_port, spans_received):
        # 1. The chart, as `helm install` would render it (in-cluster the collector is a Service's name).
        chart = template(f"operator.healthPort={health_port}", f"otel.endpoint=http://127.0.0.1:{otlp_port}",
                         "operator.replicas=2")
        async with api_server(tmp_path) as c:
            namespace = one(chart, "Deployment")["metadata"]["namespace"]
            # kmock cannot parse a POST to /api/v1/namespaces; seeded as the server seeds "default".
            c.api.seed({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
            await c.api.apply_objects(chart)  # CRDs first: helm template --include-crds lists them first
            await c.api.apply_objects(yaml.safe_load(NODES.read_text())["items"])

            # 2. The operator: two replicas, each started as the Deployment starts its pods. Peering
            #    lets exactly one of them act (each draws its own priority from the same arguments).
            deployment = one(chart, "Deployment")
            container = deployment["spec"]["template"]["spec"]["containers"][0]
            probe = container["livenessProbe"]["httpGet"]
            port = next(p["containerPort"] for p in container["ports"] if p["name"] == probe["port"])
            assert deployment["spec"]["replicas"] == 2
            async with contextlib.AsyncExitStack() as stack:
                for i, health in enumerate((port, free_port())):
                    op_pod = {"metadata": {"name": f"switchyard-operator-{i}", "namespace": namespace}}
                    op_env = {**base_env(tmp_path), **container_env(container, op_pod),
                              "KUBECONFIG": str(c.kubeconfig)}  # instead of the service-account token
                    # Each pod has its own network namespace; here the second replica's port moves.
                    argv = [a.replace(f":{port}/", f":{health}/") for a in container["command"] + container["args"]]
                    op_log = tmp_path / f"operator-{i}.log"
                    op = await stack.enter_async_context(process(argv, op_env, op_log))
                    await until_http_ok(f"http://127.0.0.1:{health}{probe['path']}", op, op_log)

                # Peering is eventually consistent: until each replica has seen the other's record,
                # both act. As a rollout would, wait until both are in the peering object and a
                # keep-alive round has passed, so that "created exactly once" below is about peering.
                peering_name = next(a.split("=", 1)[1] for a in container["args"] if a.startswith("--peering="))
                peering = c.api.plural_of("kopf.dev/v1", "ClusterKopfPeering")
                await eventually(lambda: len((c.api.stored(peering, None, peering_name) or {}).get("status", {})) >= 2,
                                 what="both replicas in the peering object")
                await asyncio.sleep(1.0)

                # 3. The tiny example, then the StatefulSet the operator plans for it.
                example = yaml.safe_load(EXAMPLE.read_text())
                name, ns = example["metadata"]["name"], example["metadata"]["namespace"]
                await c.api.apply_objects([example])
                try:
                    await eventually(lambda: condition(c.ds(name, ns), "Planned"), timeout=30, what="Planned")
                except AssertionError as err:  # say what the operators were doing
                    logs = "\n".join(f"--- operator-{i}.log\n{(tmp_path / f'operator-{i}.log').read_text()[-3000:]}"
                                      for i in range(2))
                    raise AssertionError(f"{err}\n{logs}") from None
                ds = c.ds(name, ns)
                assert condition(ds, "Planned")["status"] == "True", ds["status"]
                sts = await eventually(lambda: next(s for s in c.objects("StatefulSet", ns)
                                                    if s["metadata"]["name"] == name), what="StatefulSet")
                layout = ds["status"]["layout"]
                assert layout["pp"] == 1 and sts["spec"]["replicas"] == layout["dp"]
                await serve_like_the_pod(c, tmp_path, sts, name, ns, layout, spans_received)

                # The operator only asked for what the chart's ClusterRole grants.
                rules = one(chart, "ClusterRole")["rules"]
                asked = {(verb, group, res) for agent, verb, group, res in c.api.verbs
                         if agent.startswith(("kopf/", "switchyard-operator"))}
                assert asked, "no requests by the operator were recorded"
                assert not [a for a in asked if not covered(rules, *a)], asked
                # One replica acted, the other stood by: every object was created exactly once.
                creates = [(plural, n) for method, plural, n, *_ in c.api.writes if method == "POST"
                           and plural in ("statefulsets", "configmaps", "services", "poddisruptionbudgets")]
                assert sorted(creates) == sorted(set(creates)) and ("statefulsets", name) in creates, creates
        # What `kubectl logs` of the operator shows: its decision, at the chart's log level.
        logs = "".join((tmp_path / f"operator-{i}.log").read_text() for i in range(2))
        assert layout_summary(ds) in logs, logs[-3000:]


async def serve_like_the_pod(c: Cluster, tmp_path: Path, sts: dict[str, Any], name: str, ns: str,
                             layout: dict[str, Any], spans_received: list[Any]) -> None:
    pod = pod_of(sts)
    spec = pod["spec"]
    (container,) = spec["containers"]
    volumes = volume_sources(spec)

    # Mounted volumes → local folders: the layout ConfigMap's files as written by the operator, and
    # a tiny checkpoint where the model volume is mounted.
    mounts: dict[str, Path] = {}
    for mount in container["volumeMounts"]:
        if "emptyDir" in volumes[mount["name"]]:
            continue  # scratch space (/tmp, /dev/shm): the machine's own
        local = tmp_path / "pod" / mount["mountPath"].strip("/").replace("/", "_")
        local.mkdir(parents=True)
        mounts[mount["mountPath"]] = local
    # Each port of the DecodeService's Service → the container port it targets → a free host port.
    service = next(s for s in c.objects("Service", ns) if s["metadata"]["name"] == name)
    host_ports: dict[int, int] = {}
    by_name: dict[str, int] = {}
    for svc_port in service["spec"]["ports"]:
        container_port = next(p["containerPort"] for p in container["ports"]
                              if svc_port["targetPort"] in (p["containerPort"], p["name"]))
        host_ports[container_port] = by_name[svc_port["name"]] = free_port()
    assert set(by_name) == {"grpc", "http"}, by_name
    local = Localizer(mounts, host_ports)
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "emptyDir" in volume:
            continue
        if "configMap" in volume:
            cm = next(m for m in c.objects("ConfigMap", ns) if m["metadata"]["name"] == volume["configMap"]["name"])
            for key, text in cm["data"].items():
                (mounts[mount["mountPath"]] / key).write_text(local.text(text))
        elif mount["name"] == "model":
            assert "hostPath" in volume or "persistentVolumeClaim" in volume, volume
            await run(str(BIN / "switchyard"), "make-checkpoint", "--preset", "tiny",
                      "--out", str(mounts[mount["mountPath"]]), env=base_env(tmp_path))

    # The layout file the pod reads is the one the operator planned.
    layout_file = json.loads(Path(local.path("/etc/switchyard/layout.json")).read_text())
    assert (layout_file["tp"], layout_file["batch_slots"]) == (layout["tp"], layout["batchSlots"])

    env = {**base_env(tmp_path), **{k: local.path(v) for k, v in container_env(container, pod).items()},
           # No GPU here: the CPU stands in, one device per planned GPU of the pod.
           "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={layout['tp']}"}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith("http://127.0.0.1:")  # the chart's otel.endpoint
    argv = local.argv(container["command"] + container.get("args", []))
    assert argv[:2] == ["switchyard", "serve"] and argv != container["command"]  # only paths/port differ
    target, http = f"127.0.0.1:{by_name['grpc']}", f"http://127.0.0.1:{by_name['http']}"
    log = tmp_path / "serve.log"
    async with process(argv, env, log) as proc:
        # What the kubelet's probes ask before the pod is Ready, then gRPC health as clients see it.
        probe = container["readinessProbe"]["httpGet"]
        assert container["startupProbe"]["httpGet"] == container["livenessProbe"]["httpGet"] == probe
        await until_http_ok(f"http://127.0.0.1:{host_ports[probe['port']]}{probe['path']}", proc, log, timeout=90)
        await until_serving(target, proc, log)
        # The StatefulSet controller reports the ready pod; the DecodeService follows.
        status = {"status": {"replicas": sts["spec"]["replicas"], "readyReplicas": sts["spec"]["replicas"]}}
        code, body = await c.request("PATCH", f"/apis/apps/v1/namespaces/{ns}/statefulsets/{name}/status", status)
        assert code == 200, body
        await eventually(lambda: condition(c.ds(name, ns), "Ready")["status"] == "True", what="Ready")

        out = await run("switchyard", "generate", "--target", target, "--max-tokens", "12",
                        "--request-id", "chain-1", "Hello from the chain", env=base_env(tmp_path))
        (tmp_path / "generate.out").write_text(out)
        m = re.search(r"request chain-1: (\d+) tokens, finish (length|stop)", out)
        assert m and 1 <= int(m.group(1)) <= 12, out
        png = tmp_path / "trace.png"
        out = await run("switchyard", "trace", "--target", target, "--request", "chain-1", "--png", str(png),
                        env=base_env(tmp_path))
        (tmp_path / "trace.out").write_text(out)
        assert "chain-1" in out, out
        assert png.stat().st_size > 0
        # The OpenAI-compatible API and /metrics through the Service's HTTP port.
        answer = await asyncio.to_thread(post_json, http + "/v1/completions",
                                         {"prompt": "Hello from the chain", "max_tokens": 4})
        assert answer["object"] == "text_completion" and answer["usage"]["completion_tokens"] >= 1, answer
        with urllib.request.urlopen(http + "/metrics", timeout=10) as response:
            metrics = response.read().decode()
        assert "vllm:num_requests_waiting" in metrics and "switchyard_time_to_first_token_seconds" in metrics
    # SIGTERM flushed the exporter: the span reached the collector, named as the pod's env says.
    spans = [(rs.resource, s) for r in spans_received for rs in r.resource_spans for ss in rs.scope_spans
             for s in ss.spans]
    assert spans, f"no span reached the OTLP collector:\n{log.read_text()[-3000:]}"
    resource = {kv.key: kv.value.string_value for kv in spans[-1][0].attributes}
    assert resource["service.name"] == name and resource["k8s.pod.name"] == f"{name}-0"
    assert resource["k8s.namespace.name"] == ns
