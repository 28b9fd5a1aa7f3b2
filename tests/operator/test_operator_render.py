"""Rendered Kubernetes objects: validated offline against the Kubernetes schemas (kubernetes-validate,
strict), and checked for what the service and the scheduler rely on."""

from __future__ import annotations

import copy
import json

import kubernetes_validate
import pytest
import yaml
from helpers.kube.harness import H100_MIB, decode_service, gpu_node
from switchyard.operator import inventory, planner, render
from switchyard.operator import spec as specmod
from switchyard.service.modelspec import GROUP_FORMATION_TIMEOUT_S, ServingLayout

K8S_VERSION = "1.31"


def build(body: dict, nodes: list[dict], pods: list[dict] | None = None) -> tuple[planner.Plan, list[dict]]:
    body = copy.deepcopy(body)
    body["metadata"].update(uid="0f1e2d3c-uid", generation=3)
    spec = specmod.normalized(body["spec"])
    p = planner.plan(specmod.model_spec(spec), inventory.build(nodes, pods or []), specmod.request(spec))
    return p, render.render(body, spec, p, specmod.model_source(spec))


def by_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def validate_all(objs: list[dict]) -> None:
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as err:
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']}: {err.message} at {list(err.path)}")


def test_latency_llama3_8b_renders_valid_objects_with_the_service_command():
    p, objs = build(decode_service(otlpEndpoint="http://collector.obs:4317"), [gpu_node("h200-0")])
    validate_all(objs)
    assert sorted((o["kind"], o["metadata"]["name"]) for o in objs) == [
        ("ConfigMap", "llama-layout"), ("PodDisruptionBudget", "llama"), ("Service", "llama"),
        ("Service", "llama-headless"), ("StatefulSet", "llama")]
    for obj in objs:
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": "switchyard.dev/v1alpha1", "kind": "DecodeService", "name": "llama",
                       "uid": "0f1e2d3c-uid", "controller": True, "blockOwnerDeletion": True}
        assert obj["metadata"]["labels"]["switchyard.dev/service"] == "llama"
    (sts,) = by_kind(objs, "StatefulSet")
    assert sts["spec"]["replicas"] == p.layout.dp == 2
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    pod = sts["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["switchyard", "serve", "--layout", "/etc/switchyard/layout.json",
                            "--model-path", "/models/llama-3-8b", "--port", "8001", "--http-port", "8000"]
    assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"] == "4"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": 8000}
    assert {(p["name"], p["containerPort"]) for p in c["ports"]} == {("grpc", 8001), ("http", 8000)}
    assert pod["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["allowPrivilegeEscalation"] is False
    vols = {v["name"]: v for v in pod["volumes"]}
    assert vols["dshm"]["emptyDir"]["medium"] == "Memory"
    assert vols["model"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector.obs:4317" and env["OTEL_SERVICE_NAME"] == "llama"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    term = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term["matchExpressions"][0] == {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H200"]}
    assert term["matchFields"][0]["values"] == ["h200-0"]
    # The layout file is what `switchyard serve --layout` parses.
    (cm,) = by_kind(objs, "ConfigMap")
    layout = ServingLayout.from_json(cm["data"]["layout.json"])
    assert (layout.tp, layout.pp, layout.dp, layout.strategy) == (4, 1, 2, "auto")
    assert layout.join_timeout_s == 30.0  # one stage: no group to join
    assert layout.batch_slots == p.layout.batch_slots and layout.max_seq_len == 1280
    assert layout.model_path == "/models/llama-3-8b"
    # The planned KV pool and step size reach the engine through the file, and the status shows them.
    assert layout.kv_tokens == p.layout.kv_tokens >= layout.max_seq_len and layout.kv_tokens % 64 == 0
    assert (layout.kv_memory_fraction, layout.step_tokens) == (0.9, 256)
    status = render.plan_status(p, render.owner_from_body({"metadata": {"name": "llama", "namespace": "d",
                                                                        "uid": "u"}}))["layout"]
    assert (status["kvTokens"], status["stepTokens"], status["kvMemoryFraction"]) == (layout.kv_tokens, 256, 0.9)
    assert status["kvBytesPerGPU"] == layout.kv_tokens * 2 * 32 * 2 * 128 * 2  # two KV heads per GPU at TP4
    svc = next(o for o in objs if o["metadata"]["name"] == "llama" and o["kind"] == "Service")
    assert [(p["name"], p["port"], p["appProtocol"]) for p in svc["spec"]["ports"]] == [
        ("grpc", 8001, "grpc"), ("http", 8000, "http")]
    assert svc["spec"]["selector"] == {"switchyard.dev/service": "llama"}
    # Prometheus (the chart's monitors) scrapes the pods and the clients' Service, not the headless
    # one as well (each pod twice).
    metrics = {render.METRICS_LABEL: render.METRICS_FORMAT}
    assert metrics.items() <= sts["spec"]["template"]["metadata"]["labels"].items()
    assert metrics.items() <= svc["metadata"]["labels"].items()
    (headless,) = [o for o in by_kind(objs, "Service") if o["metadata"]["name"] == "llama-headless"]
    assert render.METRICS_LABEL not in headless["metadata"]["labels"]


def test_throughput_renders_one_statefulset_with_dp_pods():
    p, objs = build(decode_service(objective="throughput"), [gpu_node("h200-0")])
    validate_all(objs)
    (sts,) = by_kind(objs, "StatefulSet")
    assert sts["spec"]["replicas"] == p.layout.dp == 8
    assert sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_pipeline_groups_are_statefulsets_of_pp_pods():
    body = decode_service(model={"name": "llama-405b", "preset": "llama3.1-405b",
                                 "source": {"hostPath": {"path": "/mnt/405b"}}}, objective="throughput",
                          parallelism={"tp": 8, "pp": 2})
    p, objs = build(body, [gpu_node(f"h200-{i}") for i in range(8)])
    validate_all(objs)
    lay = p.layout
    assert lay.pp > 1
    sets = by_kind(objs, "StatefulSet")
    assert [s["metadata"]["name"] for s in sets] == [f"llama-g{i}" for i in range(lay.dp)]
    for i, sts in enumerate(sets):
        assert sts["spec"]["replicas"] == lay.pp
        assert sts["spec"]["selector"]["matchLabels"] == {"switchyard.dev/service": "llama",
                                                          "switchyard.dev/group": str(i)}
        c = sts["spec"]["template"]["spec"]["containers"][0]
        stage = next(e for e in c["env"] if e["name"] == "SWITCHYARD_PIPELINE_STAGE")
        assert stage["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
        cm = next(o for o in objs if o["metadata"]["name"] == f"llama-g{i}-layout")
        layout = ServingLayout.from_json(cm["data"]["layout.json"])
        assert layout.coordinator == f"llama-g{i}-0.llama-headless.default.svc:8476" and layout.pp == lay.pp
        # pods of a group start apart: a later stage waits for stage 0 as long as stage 0 for the group
        assert layout.join_timeout_s == GROUP_FORMATION_TIMEOUT_S == 300
        nodes = sts["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]["matchFields"][0]["values"]
        assert nodes == sorted(set(lay.placement[i]))
    svc = next(o for o in objs if o["metadata"]["name"] == "llama" and o["kind"] == "Service")
    assert svc["spec"]["selector"]["apps.kubernetes.io/pod-index"] == "0"
    vols = {v["name"]: v for v in sets[0]["spec"]["template"]["spec"]["volumes"]}
    assert vols["model"]["hostPath"] == {"path": "/mnt/405b", "type": "Directory"}


def test_gang_safety_no_group_without_room():
    busy = [{"metadata": {"name": "x", "namespace": "ml"}, "status": {"phase": "Running"},
             "spec": {"nodeName": "h100-0", "containers": [{"resources": {"limits": {"nvidia.com/gpu": "7"}}}]}}]
    body = decode_service(model={"name": "llama-70b", "preset": "llama3-70b", "source": {"pvc": {"claimName": "m"}}})
    p, objs = build(body, [gpu_node("h100-0", "NVIDIA-H100-80GB-HBM3", mem_mib=H100_MIB)], busy)
    assert p.status == "InsufficientCapacity"
    assert by_kind(objs, "StatefulSet") == [] and by_kind(objs, "ConfigMap") == []
    p, objs = build(decode_service(model={"name": "big", "preset": "llama3.1-405b",
                                          "source": {"pvc": {"claimName": "m"}}}),
                    [gpu_node("h100-0", "NVIDIA-H100-80GB-HBM3", mem_mib=H100_MIB)])
    assert p.layout is None and by_kind(objs, "StatefulSet") == []


def test_tensorrt_llm_engine_renders_trtllm_serve_with_the_same_layout():
    body = decode_service(engine="tensorrt-llm", allReduce="oneshot",
                          model={"name": "llama-3-8b", "preset": "llama3-8b",
                                 "source": {"image": {"path": "/opt/model"}}})
    p, objs = build(body, [gpu_node("h200-0")])
    validate_all(objs)
    (sts,) = by_kind(objs, "StatefulSet")
    c = sts["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][:2] == ["trtllm-serve", "/opt/model"]
    args = dict(zip(c["command"][2::2], c["command"][3::2], strict=False))
    assert args["--tp_size"] == str(p.layout.tp) and args["--pp_size"] == "1"
    assert args["--max_batch_size"] == str(p.layout.batch_slots)
    assert c["image"].startswith("nvcr.io/nvidia/tensorrt-llm/")
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8001}
    # trtllm-serve's /metrics is JSON: the chart's Prometheus monitors leave its pods and Service out.
    for obj in (sts["spec"]["template"]["metadata"], *(o["metadata"] for o in by_kind(objs, "Service"))):
        assert render.METRICS_LABEL not in obj["labels"]
    (cm,) = by_kind(objs, "ConfigMap")
    options = yaml.safe_load(cm["data"]["trtllm-options.yaml"])
    assert options["allreduce_strategy"] == "ONESHOT"
    assert options["kv_cache_config"] == {"free_gpu_memory_fraction": 0.9}
    assert "model" not in {v["name"] for v in sts["spec"]["template"]["spec"]["volumes"]}


def test_spec_kv_memory_fraction_and_step_tokens_reach_the_layout_file():
    body = decode_service(kvMemoryFraction=0.5, stepTokens=1024)
    p, objs = build(body, [gpu_node("h200-0")])
    quarter, _ = build(decode_service(kvMemoryFraction=0.25), [gpu_node("h200-0")])
    (cm,) = by_kind(objs, "ConfigMap")
    layout = ServingLayout.from_json(cm["data"]["layout.json"])
    assert (layout.kv_memory_fraction, layout.step_tokens) == (0.5, 1024)
    # Same layout, a pool of about twice the tokens (block rounding aside).
    assert (p.layout.tp, p.layout.pp) == (quarter.layout.tp, quarter.layout.pp)
    assert abs(layout.kv_tokens - quarter.layout.kv_tokens * 2) <= 2 * 64
    _, objs = build({**body, "spec": {**body["spec"], "engine": "tensorrt-llm"}}, [gpu_node("h200-0")])
    (cm,) = by_kind(objs, "ConfigMap")
    assert yaml.safe_load(cm["data"]["trtllm-options.yaml"])["kv_cache_config"] == {"free_gpu_memory_fraction": 0.5}


def test_spec_changes_roll_the_pods():
    _, a = build(decode_service(), [gpu_node("h200-0")])
    _, b = build(decode_service(otlpEndpoint="http://other:4317"), [gpu_node("h200-0")])
    _, c = build(decode_service(), [gpu_node("h200-0")])

    def digest(objs: list[dict]) -> str:
        template = by_kind(objs, "StatefulSet")[0]["spec"]["template"]
        return template["metadata"]["annotations"]["switchyard.dev/config-hash"]
    assert digest(a) == digest(c) != digest(b)


def test_model_from_configmap_and_bad_configs():
    body = decode_service(model={"name": "m", "configMapRef": {"name": "cfg"}, "source": {"pvc": {"claimName": "x"}}})
    spec = specmod.normalized(body["spec"])
    assert specmod.config_map_ref(spec) == ("cfg", "config.json")
    config = {"vocab_size": 1000, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
              "num_attention_heads": 8, "num_key_value_heads": 2}
    model = specmod.model_spec(spec, {"config.json": json.dumps(config)})
    assert (model.name, model.num_layers, model.num_kv_heads) == ("m", 4, 2)
    with pytest.raises(specmod.SpecError, match="has no key"):
        specmod.model_spec(spec, {})
    with pytest.raises(specmod.SpecError, match="does not exist"):
        specmod.model_spec(spec, None)
    with pytest.raises(specmod.SpecError, match="not JSON"):
        specmod.model_spec(spec, {"config.json": "{"})
    with pytest.raises(specmod.SpecError, match="must be a multiple"):
        specmod.model_spec(spec, {"config.json": json.dumps({**config, "num_key_value_heads": 3})})


def test_status_of_every_scenario_fits_the_crd_status_schema():
    from openapi_schema_validator import OAS30Validator
    from switchyard.operator import crd

    schema = crd.openapi_schema()["properties"]["status"]
    owner = render.Owner("llama", "default", "uid", 2)
    cases = [build(decode_service(objective=o), [gpu_node("h200-0")])[0] for o in ("latency", "throughput")]
    cases.append(build(decode_service(model={"name": "x", "preset": "llama3.1-405b",
                                             "source": {"pvc": {"claimName": "m"}}}),
                       [gpu_node("h100-0", "NVIDIA-H100-80GB-HBM3", mem_mib=H100_MIB)])[0])
    assert cases[-1].layout is None
    for p in cases:
        status = render.plan_status(p, owner)
        status["conditions"] = render.conditions_for(p, 0, 2, [], "2026-01-01T00:00:00Z")
        stored = {k: v for k, v in status.items() if v is not None}  # merge-patch nulls delete
        errors = [e.message for e in OAS30Validator(schema).iter_errors(stored)]
        assert errors == [], errors
        assert {c["type"] for c in status["conditions"]} == {"Planned", "Scheduled", "Ready", "Degraded"}


def test_a_node_compile_cache_is_mounted_owned_by_the_server_and_named_to_it():
    body = decode_service()
    spec = specmod.normalized(copy.deepcopy(body["spec"]))
    p, _ = build(body, [gpu_node("h200-0")])
    body["metadata"].update(uid="0f1e2d3c-uid", generation=3)
    config = render.RenderConfig(compile_cache_path="/var/cache/switchyard-test")
    objs = render.render(body, spec, p, specmod.model_source(spec), config)
    validate_all(objs)
    (sts,) = by_kind(objs, "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "compile-cache"]
    assert volume["hostPath"] == {"path": "/var/cache/switchyard-test", "type": "DirectoryOrCreate"}
    server = pod["containers"][0]
    assert {"name": "compile-cache", "mountPath": render.COMPILE_CACHE_MOUNT} in server["volumeMounts"]
    assert {"name": "SWITCHYARD_COMPILE_CACHE", "value": render.COMPILE_CACHE_MOUNT} in server["env"]
    # The kubelet makes a missing folder as root; an init container hands it to the serving user and
    # may do nothing else.
    (owner,) = pod["initContainers"]
    assert owner["command"] == ["chown", "1000:1000", render.COMPILE_CACHE_MOUNT]
    assert owner["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert owner["securityContext"]["allowPrivilegeEscalation"] is False
    # Without a path (or for TensorRT-LLM, which keeps no such cache) nothing of it is rendered.
    (plain,) = by_kind(render.render(body, spec, p, specmod.model_source(spec)), "StatefulSet")
    assert "initContainers" not in plain["spec"]["template"]["spec"]
    assert "compile-cache" not in json.dumps(plain)
    trt_body = decode_service(engine="tensorrt-llm", model={"name": "llama-3-8b", "preset": "llama3-8b",
                                                             "source": {"image": {"path": "/opt/model"}}})
    trt_body["metadata"].update(uid="0f1e2d3c-uid", generation=3)
    trt_spec = specmod.normalized(trt_body["spec"])
    trt_plan = planner.plan(specmod.model_spec(trt_spec), inventory.build([gpu_node("h200-0")], []),
                            specmod.request(trt_spec))
    trt = render.render(trt_body, trt_spec, trt_plan, specmod.model_source(trt_spec), config)
    assert "compile-cache" not in json.dumps(trt)
