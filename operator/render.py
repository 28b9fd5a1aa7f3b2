"""Kubernetes objects for a planned DecodeService, and its status. Pure: dicts in, dicts out.

Per DecodeService ``NAME``:

* ``pp == 1``: one StatefulSet ``NAME`` with ``dp`` pods (each pod a whole replica of ``tp`` GPUs) and
  one ConfigMap ``NAME-layout``;
* ``pp > 1``: one StatefulSet ``NAME-gI`` per pipeline group with ``pp`` pods (stage = pod ordinal,
  coordinator = pod 0) and a ConfigMap ``NAME-gI-layout`` each, so a group starts and stops as a unit;
* a headless Service ``NAME-headless`` (stable pod DNS for the pipeline coordinator), a ClusterIP
  Service ``NAME`` for gRPC and HTTP (the OpenAI-compatible API, ``/metrics``; stage-0 pods only),
  and a PodDisruptionBudget ``NAME``.

Everything carries an owner reference to the DecodeService (deletion cascades through the garbage
collector) and the label ``switchyard.dev/service=NAME``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import yaml
from switchyard.service.modelspec import DEFAULT_JOIN_TIMEOUT_S, GROUP_FORMATION_TIMEOUT_S, ServingLayout

from .crd import API_VERSION, KIND
from .inventory import GPU_RESOURCE, GPU_TOLERATION, PRODUCT_LABEL
from .planner import Plan
from .rejections import ServiceRejection
from .spec import ModelSource

SERVICE_LABEL = "switchyard.dev/service"
GROUP_LABEL = "switchyard.dev/group"
MANAGED_BY = "switchyard-operator"
# On switchyard-engine pods and their clients' Service (not the headless one: a second target per
# pod), which serve Prometheus text on /metrics of their "http" port: what the chart's PodMonitor and
# ServiceMonitor select. TensorRT-LLM pods go without: trtllm-serve's /metrics is JSON.
METRICS_LABEL = "switchyard.dev/metrics"
METRICS_FORMAT = "prometheus"
HASH_ANNOTATION = "switchyard.dev/config-hash"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"  # set on StatefulSet pods since Kubernetes 1.28
LAYOUT_DIR = "/etc/switchyard"
LAYOUT_FILE = f"{LAYOUT_DIR}/layout.json"
TRTLLM_OPTIONS = "trtllm-options.yaml"
STAGE_ENV = "SWITCHYARD_PIPELINE_STAGE"
COMPILE_CACHE_ENV = "SWITCHYARD_COMPILE_CACHE"
COMPILE_CACHE_MOUNT = "/var/cache/switchyard"
# TensorRT-LLM's allreduce_strategy names for our strategy settings.
# The CRD's maxItems of status.reasons and status.alternatives: a longer list would be refused.
MAX_STATUS_ITEMS = 64
TRTLLM_ALLREDUCE = {"auto": "AUTO", "xla": "NCCL", "oneshot": "ONESHOT", "twoshot": "TWOSHOT"}


@dataclasses.dataclass(frozen=True)
class RenderConfig:
    switchyard_image: str = "ghcr.io/switchyard/switchyard-service:0.1.0"
    trtllm_image: str = "nvcr.io/nvidia/tensorrt-llm/release:1.0.0"
    port: int = 8001
    # switchyard serve's HTTP port: the OpenAI-compatible API, /health (the probes) and /metrics
    http_port: int = 8000
    coordinator_port: int = 8476
    run_as_user: int = 1000
    shm_size: str = "16Gi"
    # Collector for serving pods whose DecodeService sets no spec.otlpEndpoint (the chart's otel.endpoint).
    otlp_endpoint: str = ""
    # The node's folder serving pods keep their compiled step programs in (the chart's
    # serving.compileCache.hostPath; empty: none), so a restart on that node loads them.
    compile_cache_path: str = ""


@dataclasses.dataclass(frozen=True)
class Owner:
    name: str
    namespace: str
    uid: str
    generation: int = 1


def owner_from_body(body: Mapping[str, Any]) -> Owner:
    meta = body["metadata"]
    return Owner(meta["name"], meta["namespace"], meta["uid"], int(meta.get("generation", 1)))


def labels(owner: Owner) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "switchyard",
        "app.kubernetes.io/instance": owner.name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        SERVICE_LABEL: owner.name,
    }


def selector(owner: Owner) -> dict[str, str]:
    return {SERVICE_LABEL: owner.name}


def selector_string(owner: Owner) -> str:
    return ",".join(f"{k}={v}" for k, v in selector(owner).items())


def _meta(owner: Owner, name: str, extra_labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": {**labels(owner), **(extra_labels or {})},
        "ownerReferences": [{
            "apiVersion": API_VERSION, "kind": KIND, "name": owner.name, "uid": owner.uid,
            "controller": True, "blockOwnerDeletion": True,
        }],
    }


def group_names(owner: Owner, pp: int, dp: int) -> list[str]:
    return [owner.name] if pp == 1 else [f"{owner.name}-g{i}" for i in range(dp)]


def headless_name(owner: Owner) -> str:
    return f"{owner.name}-headless"


def endpoint(owner: Owner, config: RenderConfig) -> str:
    return f"{owner.name}.{owner.namespace}.svc:{config.port}"


def serving_layout(owner: Owner, spec: Mapping[str, Any], plan: Plan, source: ModelSource,
                   group: str, config: RenderConfig) -> ServingLayout:
    lay = plan.layout
    assert lay is not None
    coordinator = ""
    if lay.pp > 1:
        coordinator = f"{group}-0.{headless_name(owner)}.{owner.namespace}.svc:{config.coordinator_port}"
    return ServingLayout(
        tp=lay.tp, pp=lay.pp, dp=max(lay.dp, 1), strategy=lay.strategy, batch_slots=lay.batch_slots,
        max_seq_len=lay.max_seq_len, model_name=spec["model"]["name"], model_path=source.path,
        pipeline_stage=0, coordinator=coordinator, kv_tokens=lay.kv_tokens,
        kv_memory_fraction=lay.kv_memory_fraction, step_tokens=lay.step_tokens,
        quantization=spec["model"]["quantization"],
        # A group's pods may start minutes apart (one of them pulling its image), so a later stage waits
        # for stage 0 as long as stage 0 waits for the group, instead of exiting into a restart back-off.
        join_timeout_s=GROUP_FORMATION_TIMEOUT_S if lay.pp > 1 else DEFAULT_JOIN_TIMEOUT_S,
        extra={
            "engine": spec["engine"],
            "objective": spec["objective"],
            "gpu_product": lay.product,
            # With pp > 1 every stage reads this one file; its stage comes from the pod ordinal.
            "pipeline_stage_env": STAGE_ENV if lay.pp > 1 else "",
            "estimate": {"ms_per_token": lay.ms_per_token, "tokens_per_s": lay.tokens_per_s,
                         "ttft_ms": lay.ttft_ms},
        },
    )


def render(body: Mapping[str, Any], spec: Mapping[str, Any], plan: Plan, source: ModelSource,
           config: RenderConfig = RenderConfig()) -> list[dict[str, Any]]:
    """Every object the DecodeService owns for this plan, from its spec with the schema's defaults
    applied (``spec.normalized``). Empty groups are never rendered: with no layout, or ``dp == 0``,
    only the Services and the PDB exist (gang safety)."""
    owner = owner_from_body(body)
    objs: list[dict[str, Any]] = [_headless(owner, config), _service(owner, spec, plan, config), _pdb(owner)]
    lay = plan.layout
    if lay is None or lay.dp == 0:
        return objs
    for index, group in enumerate(group_names(owner, lay.pp, lay.dp)):
        cm = _configmap(owner, spec, plan, source, group, config)
        objs.append(cm)
        nodes = sorted({n for g in (lay.placement if lay.pp == 1 else lay.placement[index:index + 1]) for n in g})
        objs.append(_statefulset(owner, spec, plan, source, config, group, index, cm, nodes))
    return objs


def _configmap(owner: Owner, spec: Mapping[str, Any], plan: Plan, source: ModelSource, group: str,
               config: RenderConfig) -> dict[str, Any]:
    lay = plan.layout
    assert lay is not None
    data = {"layout.json": serving_layout(owner, spec, plan, source, group, config).to_json() + "\n"}
    if spec.get("engine") == "tensorrt-llm":
        data[TRTLLM_OPTIONS] = yaml.safe_dump({
            "allreduce_strategy": TRTLLM_ALLREDUCE[lay.strategy],
            "kv_cache_config": {"free_gpu_memory_fraction": lay.kv_memory_fraction},
        }, sort_keys=True)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(owner, f"{group}-layout"), "data": data}


def _container(owner: Owner, spec: Mapping[str, Any], plan: Plan, source: ModelSource,
               config: RenderConfig) -> dict[str, Any]:
    lay = plan.layout
    assert lay is not None
    trt = spec.get("engine") == "tensorrt-llm"
    if trt:
        command = ["trtllm-serve", source.path, "--host", "0.0.0.0", "--port", str(config.port),
                   "--backend", "pytorch", "--tp_size", str(lay.tp), "--pp_size", str(lay.pp),
                   "--max_batch_size", str(lay.batch_slots), "--max_seq_len", str(lay.max_seq_len),
                   "--extra_llm_api_options", f"{LAYOUT_DIR}/{TRTLLM_OPTIONS}"]
        probe: dict[str, Any] = {"httpGet": {"path": "/health", "port": config.port}}
        image = spec.get("image") or config.trtllm_image
    else:
        command = ["switchyard", "serve", "--layout", LAYOUT_FILE, "--model-path", source.path,
                   "--port", str(config.port), "--http-port", str(config.http_port)]
        # 200 while serving; 503 while loading, draining or failed (every pipeline stage answers it)
        probe = {"httpGet": {"path": "/health", "port": config.http_port}}
        image = spec.get("image") or config.switchyard_image
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "OTEL_SERVICE_NAME", "value": owner.name},
        {"name": "OTEL_RESOURCE_ATTRIBUTES",
         "value": "k8s.namespace.name=$(POD_NAMESPACE),k8s.pod.name=$(POD_NAME),service.instance.id=$(POD_NAME)"},
    ]
    otlp_endpoint = spec.get("otlpEndpoint") or config.otlp_endpoint
    if otlp_endpoint:
        env += [{"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": otlp_endpoint},
                {"name": "OTEL_TRACES_EXPORTER", "value": "otlp"},
                {"name": "OTEL_METRICS_EXPORTER", "value": "otlp"}]
    else:
        env += [{"name": "OTEL_TRACES_EXPORTER", "value": "none"},
                {"name": "OTEL_METRICS_EXPORTER", "value": "none"}]
    if keeps_compile_cache(spec, config):
        env.append({"name": COMPILE_CACHE_ENV, "value": COMPILE_CACHE_MOUNT})
    if lay.pp > 1:
        env.append({"name": STAGE_ENV,
                    "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}}})
    user = spec.get("resources", {})
    requests = {**user.get("requests", {}), GPU_RESOURCE: str(lay.tp)}
    limits = {**user.get("limits", {}), GPU_RESOURCE: str(lay.tp)}
    ports = ([{"name": "http", "containerPort": config.port, "protocol": "TCP"}] if trt else
             [{"name": "grpc", "containerPort": config.port, "protocol": "TCP"},
              {"name": "http", "containerPort": config.http_port, "protocol": "TCP"}])
    if lay.pp > 1:
        ports.append({"name": "coordinator", "containerPort": config.coordinator_port, "protocol": "TCP"})
    mounts = [{"name": "layout", "mountPath": LAYOUT_DIR, "readOnly": True},
              {"name": "dshm", "mountPath": "/dev/shm"},
              {"name": "tmp", "mountPath": "/tmp"}]
    if keeps_compile_cache(spec, config):
        mounts.append({"name": "compile-cache", "mountPath": COMPILE_CACHE_MOUNT})
    if source.kind != "image":
        mount: dict[str, Any] = {"name": "model", "mountPath": source.path, "readOnly": True}
        if source.sub_path:
            mount["subPath"] = source.sub_path
        mounts.append(mount)
    container: dict[str, Any] = {
        "name": "server",
        "image": image,
        "command": command,
        "ports": ports,
        "env": env,
        "resources": {"requests": requests, "limits": limits},
        # Loading and sharding a large checkpoint takes minutes: the startup probe allows 30.
        "startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": 180},
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 3},
        "volumeMounts": mounts,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    if spec.get("imagePullPolicy"):
        container["imagePullPolicy"] = spec["imagePullPolicy"]
    return container


def keeps_compile_cache(spec: Mapping[str, Any], config: RenderConfig) -> bool:
    """Whether the pods keep their compile cache on the node: a folder is configured, and the engine
    is ours (TensorRT-LLM keeps no such cache)."""
    return bool(config.compile_cache_path) and spec.get("engine") != "tensorrt-llm"


def _compile_cache_owner(spec: Mapping[str, Any], config: RenderConfig) -> dict[str, Any]:
    """An init container that gives the node's compile-cache folder to the serving user: the kubelet
    creates a missing hostPath folder as root, and the server runs as ``run_as_user``. It may change
    the folder's owner and nothing else."""
    uid = config.run_as_user
    return {
        "name": "compile-cache-owner",
        "image": spec.get("image") or config.switchyard_image,
        "command": ["chown", f"{uid}:{uid}", COMPILE_CACHE_MOUNT],
        "volumeMounts": [{"name": "compile-cache", "mountPath": COMPILE_CACHE_MOUNT}],
        "securityContext": {
            "runAsUser": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]},
        },
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
    }


def _statefulset(owner: Owner, spec: Mapping[str, Any], plan: Plan, source: ModelSource, config: RenderConfig,
                 group: str, index: int, cm: Mapping[str, Any], nodes: Sequence[str]) -> dict[str, Any]:
    lay = plan.layout
    assert lay is not None
    group_labels = {GROUP_LABEL: str(index)} if lay.pp > 1 else {}
    pod_labels = {**labels(owner), **group_labels, **_metrics_labels(spec)}
    volumes: list[dict[str, Any]] = [
        {"name": "layout", "configMap": {"name": cm["metadata"]["name"]}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": config.shm_size}},
        {"name": "tmp", "emptyDir": {}},
    ]
    if source.kind == "pvc":
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": source.claim_name, "readOnly": True}})
    elif source.kind == "hostPath":
        volumes.append({"name": "model", "hostPath": {"path": source.host_path, "type": "Directory"}})
    init_containers = []
    if keeps_compile_cache(spec, config):
        volumes.append({"name": "compile-cache",
                        "hostPath": {"path": config.compile_cache_path, "type": "DirectoryOrCreate"}})
        init_containers.append(_compile_cache_owner(spec, config))
    match_fields = [{"key": "metadata.name", "operator": "In", "values": list(nodes)}] if nodes else []
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # the server never talks to the API
        "terminationGracePeriodSeconds": 30,
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": config.run_as_user, "runAsGroup": config.run_as_user,
            "fsGroup": config.run_as_user, "seccompProfile": {"type": "RuntimeDefault"},
        },
        **({"initContainers": init_containers} if init_containers else {}),
        "containers": [_container(owner, spec, plan, source, config)],
        "volumes": volumes,
        "tolerations": [*spec.get("tolerations", []), GPU_TOLERATION],
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{
            "matchExpressions": [{"key": PRODUCT_LABEL, "operator": "In", "values": [lay.product]}],
            **({"matchFields": match_fields} if match_fields else {}),
        }]}}},
    }
    if spec.get("nodeSelector"):
        pod_spec["nodeSelector"] = dict(spec["nodeSelector"])
    template = {"metadata": {"labels": pod_labels}, "spec": pod_spec}
    # Pods roll when anything they run with changes, the mounted layout file included.
    digest = hashlib.sha256(json.dumps([template, cm["data"]], sort_keys=True).encode()).hexdigest()[:16]
    template["metadata"]["annotations"] = {HASH_ANNOTATION: digest}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {**_meta(owner, group, group_labels), "annotations": {HASH_ANNOTATION: digest}},
        "spec": {
            "replicas": lay.dp if lay.pp == 1 else lay.pp,
            "serviceName": headless_name(owner),
            # All pods of a group start together (a pipeline needs every stage); no ordered ramp.
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate"},
            "selector": {"matchLabels": {**selector(owner), **group_labels}},
            "template": template,
        },
    }


def _headless(owner: Owner, config: RenderConfig) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(owner, headless_name(owner)),
        "spec": {
            "clusterIP": "None",
            # Pipeline stages find their coordinator before they are ready.
            "publishNotReadyAddresses": True,
            "selector": selector(owner),
            "ports": [{"name": "grpc", "port": config.port, "targetPort": config.port, "protocol": "TCP"},
                      {"name": "http", "port": config.http_port, "targetPort": config.http_port, "protocol": "TCP"},
                      {"name": "coordinator", "port": config.coordinator_port,
                       "targetPort": config.coordinator_port, "protocol": "TCP"}],
        },
    }


def _service(owner: Owner, spec: Mapping[str, Any], plan: Plan, config: RenderConfig) -> dict[str, Any]:
    sel = selector(owner)
    if plan.layout is not None and plan.layout.pp > 1:
        sel = {**sel, POD_INDEX_LABEL: "0"}  # only the first stage serves clients
    trt = spec.get("engine") == "tensorrt-llm"
    ports = [{"name": "http" if trt else "grpc", "port": config.port, "targetPort": config.port,
              "protocol": "TCP", "appProtocol": "http" if trt else "grpc"}]
    if not trt:  # the OpenAI-compatible API and /metrics beside gRPC
        ports.append({"name": "http", "port": config.http_port, "targetPort": config.http_port, "protocol": "TCP",
                      "appProtocol": "http"})
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(owner, owner.name, _metrics_labels(spec)),
        "spec": {"type": "ClusterIP", "selector": sel, "ports": ports},
    }


def _metrics_labels(spec: Mapping[str, Any]) -> dict[str, str]:
    return {} if spec.get("engine") == "tensorrt-llm" else {METRICS_LABEL: METRICS_FORMAT}


def _pdb(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(owner, owner.name),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(owner)}},
    }


# ---- status ------------------------------------------------------------------------------------------
def plan_status(plan: Plan, owner: Owner, config: RenderConfig = RenderConfig()) -> dict[str, Any]:
    """The status fields a plan decides (conditions are added by :func:`conditions`)."""
    status: dict[str, Any] = {
        "observedGeneration": owner.generation,
        "reasons": list(plan.reasons)[:MAX_STATUS_ITEMS],
        "alternatives": [
            {k: v for k, v in {"layout": a.layout, "msPerToken": a.ms_per_token, "tokensPerSecond": a.tokens_per_s,
                               "rejected": a.rejected}.items() if v is not None}
            for a in plan.alternatives[:MAX_STATUS_ITEMS]
        ],
        "selector": selector_string(owner),
        "endpoint": endpoint(owner, config),
    }
    lay = plan.layout
    if lay is None:
        status.update({"replicas": 0, "layoutSummary": plan.status, "layout": None, "estimate": None})
        return status
    status.update({
        "replicas": lay.dp,
        "layoutSummary": lay.summary,
        "layout": {
            "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "gpusPerReplica": lay.gpus_per_replica,
            "strategy": lay.strategy, "batchSlots": lay.batch_slots, "maxSeqLen": lay.max_seq_len,
            "kvTokens": lay.kv_tokens, "kvBytesPerGPU": lay.kv_bytes_per_gpu,
            "kvMemoryFraction": lay.kv_memory_fraction, "stepTokens": lay.step_tokens,
            "gpuProduct": lay.product, "domain": "nvswitch" if lay.nvswitch else "pcie",
            "placement": [list(g) for g in lay.placement],
        },
        "estimate": {
            "msPerToken": lay.ms_per_token, "tokensPerSecond": lay.tokens_per_s, "timeToFirstTokenMs": lay.ttft_ms,
            "memoryPerGPUBytes": lay.memory_per_gpu_bytes, "weightBytesPerGPU": lay.weight_bytes_per_gpu,
            "model": "calibrated decode model (switchyard.operator.planner; calibration.json provenance in reasons)",
        },
    })
    return status


def condition(ctype: str, ok: bool | None, reason: str, message: str, generation: int,
              previous: Sequence[Mapping[str, Any]] = (), now: str = "") -> dict[str, Any]:
    """One condition; ``lastTransitionTime`` only moves when the status flips."""
    status = "Unknown" if ok is None else ("True" if ok else "False")
    old = next((c for c in previous if c.get("type") == ctype), None)
    when = old["lastTransitionTime"] if old and old.get("status") == status and old.get("lastTransitionTime") else now
    return {"type": ctype, "status": status, "reason": reason, "message": message[:1000],
            "observedGeneration": generation, "lastTransitionTime": when}


def merge_conditions(previous: Sequence[Mapping[str, Any]], new: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    by_type = {c["type"]: dict(c) for c in previous}
    for c in new:
        by_type[c["type"]] = dict(c)
    order = ["Planned", "Scheduled", "Ready", "Degraded"]
    return [by_type[t] for t in order if t in by_type]


def readiness(statefulsets: Sequence[Mapping[str, Any]], pp: int) -> int:
    """Ready replicas: with pp == 1 the StatefulSet's ready pods; with pp > 1 the groups whose every
    stage is ready (a half-ready pipeline serves nothing)."""
    if pp == 1:
        return sum(int(s.get("status", {}).get("readyReplicas", 0) or 0) for s in statefulsets)
    return sum(1 for s in statefulsets if int(s.get("status", {}).get("readyReplicas", 0) or 0) >= pp)


def conditions_for(plan: Plan | None, ready: int, generation: int, previous: Sequence[Mapping[str, Any]],
                   now: str, planning_error: tuple[str, str] | None = None,
                   degraded: tuple[str, str] | None = None) -> list[dict[str, Any]]:
    """Planned, Scheduled, Ready and Degraded for a (re)plan. Pure."""
    def cond(ctype: str, ok: bool | None, reason: str, message: str) -> dict[str, Any]:
        return condition(ctype, ok, reason, message, generation, previous, now)

    if plan is None:
        reason, message = planning_error or ("Unknown", "not planned")
        return merge_conditions(previous, [
            cond("Planned", False, reason, message),
            cond("Scheduled", False, reason, "nothing to schedule"),
            cond("Ready", False, "NotPlanned", message),
            cond("Degraded", False, "NotPlanned", "no replicas exist"),
        ])
    lay = plan.layout
    planned_ok = lay is not None
    out = [cond("Planned", planned_ok, plan.status if not planned_ok else "Planned", plan.message)]
    dp = lay.dp if lay else 0
    if not planned_ok:
        out.append(cond("Scheduled", False, plan.status, "no pipeline group is created: " + plan.message))
    elif plan.rejection is ServiceRejection.INSUFFICIENT_CAPACITY:
        out.append(cond("Scheduled", False, "InsufficientCapacity", plan.message))
    else:
        out.append(cond("Scheduled", True, "AllGroupsPlaced",
                        f"{dp} pipeline group(s) of {lay.pp} pod(s) x {lay.tp} GPU(s) placed whole"))
    if dp == 0:
        out.append(cond("Ready", False, "NoReplicas", "no replicas are planned"))
    elif ready >= dp:
        out.append(cond("Ready", True, "AllReplicasReady", f"{ready}/{dp} replicas ready"))
    else:
        out.append(cond("Ready", False, "ReplicasNotReady", f"{ready}/{dp} replicas ready"))
    if degraded is not None:
        out.append(cond("Degraded", True, *degraded))
    elif planned_ok and plan.rejection is ServiceRejection.INSUFFICIENT_CAPACITY:
        out.append(cond("Degraded", True, "InsufficientCapacity", plan.message))
    elif planned_ok and not plan.slo_met:
        out.append(cond("Degraded", True, "SLONotMet", plan.slo_miss))
    else:
        out.append(cond("Degraded", False, "AsPlanned", "running the planned layout"))
    return merge_conditions(previous, out)


def readiness_status(body: Mapping[str, Any], statefulsets: Sequence[Mapping[str, Any]],
                     now: str) -> dict[str, Any]:
    """Status fields that follow the owned StatefulSets (no re-plan): readyReplicas, ready, and the
    Ready/Degraded conditions."""
    status = body.get("status") or {}
    layout = status.get("layout") or {}
    replicas = int(status.get("replicas") or 0)
    pp = int(layout.get("pp") or 1)
    ready = readiness(statefulsets, pp)
    generation = int(status.get("observedGeneration") or body["metadata"].get("generation", 1))
    previous = status.get("conditions") or []
    was_ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in previous)
    new = []
    if replicas == 0:
        new.append(condition("Ready", False, "NoReplicas", "no replicas are planned", generation, previous, now))
    elif ready >= replicas:
        new.append(condition("Ready", True, "AllReplicasReady", f"{ready}/{replicas} replicas ready",
                             generation, previous, now))
        old = next((c for c in previous if c.get("type") == "Degraded"), None)
        if old and old.get("reason") in ("ReplicasUnavailable", "CapacityLost"):
            new.append(condition("Degraded", False, "AsPlanned", "all replicas ready again", generation, previous, now))
    else:
        new.append(condition("Ready", False, "ReplicasNotReady", f"{ready}/{replicas} replicas ready",
                             generation, previous, now))
        if was_ready:
            new.append(condition("Degraded", True, "ReplicasUnavailable",
                                 f"{replicas - ready} of {replicas} replicas became unavailable", generation,
                                 previous, now))
    return {"readyReplicas": ready, "ready": f"{ready}/{replicas}",
            "conditions": merge_conditions(previous, new)}
