"""The Helm chart with a real Helm: lint, render, offline validation of what it renders, its generated
copies (CRDs, RBAC rules, install bundle) against their sources, and its values schema."""

from __future__ import annotations

import json
from pathlib import Path
from urllib.parse import urlparse

import kubernetes_validate
import pytest
import yaml
from helpers.chart_helpers import CHART, ROOT, one, run_helm, sync_chart, template
from switchyard.cli import operator as operator_main
from switchyard.cli.main import build_parser
from switchyard.operator import crd

# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and a current one.
K8S_VERSIONS = ["1.29.0", "1.33.0"]


def test_lint_strict():
    proc = run_helm("lint", "--strict", str(CHART))
    assert "1 chart(s) linted, 0 chart(s) failed" in proc.stdout, proc.stdout


def test_lint_strict_with_every_option_set():
    proc = run_helm("lint", "--strict", str(CHART), "--set", "operator.replicas=2",
                    "--set", "otel.endpoint=http://otel-collector.observability.svc:4317",
                    "--set", "serviceAccount.create=false", "--set", "serviceAccount.name=existing",
                    "--set", "operator.nodeSelector.role=system",
                    "--set", "operator.imagePullSecrets[0].name=registry",
                    "--set", "metrics.podMonitor.enabled=true", "--set", "metrics.serviceMonitor.enabled=true",
                    "--set", "inferencePool.enabled=true", "--set", "inferencePool.decodeService=llama",
                    "--set", "inferencePool.endpointPicker.service=llama-epp")
    assert "0 chart(s) failed" in proc.stdout, proc.stdout


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_rendered_objects_validate_strictly(version):
    objs = template("operator.replicas=2", "otel.endpoint=http://collector:4317")
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == ["ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "CustomResourceDefinition",
                     "Deployment", "ServiceAccount"]
    for obj in objs:
        # strict: unknown fields are errors, not silently dropped by the API server.
        kubernetes_validate.validate(obj, version, strict=True)


def test_validation_catches_a_bad_object():
    # The offline validator above is not a rubber stamp.
    deployment = one(template(), "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readOnlyRootFs"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[0], strict=True)


def test_generated_copies_match_their_sources():
    for path, data in sync_chart.chart_copies().items():
        assert path.exists() and path.read_bytes() == data, (
            f"{path.relative_to(ROOT)} drifted from its source: run python scripts/sync_chart.py")
    # Nothing else in crds/: Helm would install it.
    expected = {p.name for p in sync_chart.chart_copies() if p.parent.name == "crds"}
    assert {p.name for p in (CHART / "crds").iterdir()} == expected


def test_rendered_crds_are_the_operators():
    rendered = [o for o in template() if o["kind"] == "CustomResourceDefinition"]
    assert sorted(rendered, key=lambda o: o["metadata"]["name"]) == sorted(
        [crd.load_crd(), crd.load_peering_crd()], key=lambda o: o["metadata"]["name"])


def test_install_bundle_is_the_rendered_chart():
    bundle = ROOT / "manifests" / "install.yaml"
    from helpers.chart_helpers import helm

    assert bundle.read_text() == sync_chart.install_bundle(helm()), (
        "manifests/install.yaml drifted from the chart: run python scripts/sync_chart.py")
    docs = [d for d in yaml.safe_load_all(bundle.read_text()) if d]
    # kubectl applies in file order: the namespace and CRDs before what lives in them.
    assert docs[0]["kind"] == "Namespace" and docs[0]["metadata"]["name"] == sync_chart.NAMESPACE
    assert [d["kind"] for d in docs[1:3]] == ["CustomResourceDefinition"] * 2
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSIONS[0], strict=True)
        if doc["kind"] in ("Deployment", "ServiceAccount"):
            assert doc["metadata"]["namespace"] == sync_chart.NAMESPACE


def test_cluster_role_is_exactly_the_operators_rules():
    objs = template()
    role = one(objs, "ClusterRole")
    assert role["rules"] == crd.load_rbac_rules()
    for rule in role["rules"]:
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[key], rule
    binding = one(objs, "ClusterRoleBinding")
    account = one(objs, "ServiceAccount")
    deployment = one(objs, "Deployment")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": "switchyard-system"}]
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]


def operator_container(*sets: str) -> dict:
    return one(template(*sets), "Deployment")["spec"]["template"]["spec"]["containers"][0]


def test_operator_command_is_what_the_cli_parses():
    container = operator_container("serving.image.tag=9.9.9", "operator.replanInterval=30")
    argv = container["command"] + container["args"]
    assert argv[:2] == ["switchyard", "operator"]
    args = build_parser().parse_args(argv[1:])
    assert args._run is operator_main.run
    config = operator_main.config_from_args(args)
    assert config.peering_name == "switchyard" and config.replan_interval_s == 30
    assert config.render.switchyard_image == "ghcr.io/switchyard/switchyard-service:9.9.9"
    assert config.render.trtllm_image == "nvcr.io/nvidia/tensorrt-llm/release:1.0.0"
    assert config.render.otlp_endpoint == ""
    assert config.render.compile_cache_path == "/var/cache/switchyard"  # the chart's default
    # Replicas share these arguments; each draws its own peering priority.
    assert args.priority > 0 and build_parser().parse_args(argv[1:]).priority != args.priority


def test_probes_point_at_kopfs_liveness_endpoint():
    container = operator_container("operator.healthPort=9090")
    args = build_parser().parse_args((container["command"] + container["args"])[1:])
    url = urlparse(args.liveness)
    (port,) = container["ports"]
    assert (url.port, url.path) == (9090, "/healthz") and port == {"name": "health", "containerPort": 9090,
                                                                   "protocol": "TCP"}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}


def test_operator_runs_locked_down():
    pod = one(template(), "Deployment")["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                            "capabilities": {"drop": ["ALL"]}}
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    # A read-only root needs somewhere writable for Python's temporary files.
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


def test_otel_endpoint_reaches_the_serving_pods_config():
    container = operator_container("otel.endpoint=http://otel-collector.observability.svc:4317")
    args = build_parser().parse_args((container["command"] + container["args"])[1:])
    assert operator_main.config_from_args(args).render.otlp_endpoint == "http://otel-collector.observability.svc:4317"


def test_the_serving_compile_cache_folder_is_the_charts_or_none():
    def path(*sets: str) -> str:
        container = operator_container(*sets)
        args = build_parser().parse_args((container["command"] + container["args"])[1:])
        return operator_main.config_from_args(args).render.compile_cache_path

    assert path("serving.compileCache.hostPath=/mnt/nvme/switchyard") == "/mnt/nvme/switchyard"
    assert path("serving.compileCache.hostPath=") == ""


def test_replicas_and_existing_service_account():
    objs = template("operator.replicas=3", "serviceAccount.create=false", "serviceAccount.name=mine")
    assert one(objs, "Deployment")["spec"]["replicas"] == 3
    assert "ServiceAccount" not in [o["kind"] for o in objs]
    assert one(objs, "ClusterRoleBinding")["subjects"][0]["name"] == "mine"


@pytest.mark.parametrize(("value", "message"), [
    ("operator.replicas=two", "operator.replicas: Invalid type. Expected: integer, given: string"),
    ("operator.replica=2", "Additional property replica is not allowed"),
    ("operator.healthPort=80", "operator.healthPort: Must be greater than or equal to 1024"),
    ("operator.image.pullPolicy=Sometimes", "operator.image.pullPolicy: operator.image.pullPolicy must be one of"),
    ("otel.endpoint=collector:4317", "otel.endpoint: Does not match pattern"),
    ("operator.resources.limits.memory=lots", "operator.resources.limits.memory"),
    ("operator.peering.name=Not_A_Name", "operator.peering.name: Does not match pattern"),
    ("serving.compileCache.hostPath=var/cache", "serving.compileCache.hostPath: Does not match pattern"),
])
def test_bad_values_fail_with_a_message(value, message):
    proc = run_helm("template", "x", str(CHART), "--set", value, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_missing_service_account_name_fails_with_a_message():
    proc = run_helm("template", "x", str(CHART), "--set", "serviceAccount.create=false", check=False)
    assert proc.returncode != 0
    assert "serviceAccount.name is required when serviceAccount.create is false" in proc.stderr


def test_values_schema_covers_every_default():
    # Every key in values.yaml is described by the schema (additionalProperties: false catches typos
    # only where the schema lists the real names).
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(value, node, where):
        if isinstance(value, dict) and node.get("additionalProperties") is False:
            for key, sub in value.items():
                assert key in node["properties"], f"{where}{key} is not in values.schema.json"
                target = node["properties"][key]
                if "$ref" in target:
                    target = schema["definitions"][target["$ref"].split("/")[-1]]
                walk(sub, target, f"{where}{key}.")

    walk(values, schema, "")


def test_chart_metadata():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"], "the chart's appVersion is the images' tag"
    assert chart["apiVersion"] == "v2" and Path(CHART / "templates" / "NOTES.txt").exists()


def operator_objects(**spec) -> list[dict]:
    """What the operator renders for a DecodeService named llama in namespace models."""
    from helpers.kube.harness import decode_service, gpu_node
    from switchyard.operator import inventory, planner, render
    from switchyard.operator import spec as specmod

    body = decode_service(**spec)
    body["metadata"].update(name="llama", namespace="models", uid="uid")
    normal = specmod.normalized(body["spec"])
    plan = planner.plan(specmod.model_spec(normal), inventory.build([gpu_node("h200-0")], []),
                        specmod.request(normal))
    return render.render(body, normal, plan, specmod.model_source(normal))


def selected(match_labels: dict, objs: list[dict], kind: str) -> list[str]:
    """Names of the objects of ``kind`` (pod templates for "Pod") whose labels the selector matches."""
    found = []
    for obj in objs:
        if kind == "Pod" and obj["kind"] == "StatefulSet":
            meta = {**obj["spec"]["template"]["metadata"], "name": obj["metadata"]["name"]}
        elif obj["kind"] == kind:
            meta = obj["metadata"]
        else:
            continue
        if match_labels.items() <= meta["labels"].items():
            found.append(meta["name"])
    return found


def test_monitors_scrape_the_serving_pods_metrics_port():
    objs = template("metrics.podMonitor.enabled=true", "metrics.serviceMonitor.enabled=true",
                    "metrics.podMonitor.labels.release=prometheus", "metrics.serviceMonitor.namespaces[0]=models",
                    include_crds=False)
    pod_monitor, service_monitor = one(objs, "PodMonitor"), one(objs, "ServiceMonitor")
    assert pod_monitor["apiVersion"] == service_monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert pod_monitor["metadata"]["labels"]["release"] == "prometheus"
    assert pod_monitor["metadata"]["labels"]["app.kubernetes.io/component"] == "monitoring"
    assert "release" not in service_monitor["metadata"]["labels"]
    assert pod_monitor["spec"]["namespaceSelector"] == {"any": True}
    assert service_monitor["spec"]["namespaceSelector"] == {"matchNames": ["models"]}
    assert pod_monitor["spec"]["podMetricsEndpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    assert service_monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    # What they select is what the operator renders: switchyard's pods, whose "http" port serves
    # /metrics, and only the Service clients use (the headless one would be a second target per pod);
    # trtllm-serve's JSON /metrics is left out.
    served = operator_objects()
    pods, services = pod_monitor["spec"]["selector"]["matchLabels"], service_monitor["spec"]["selector"]["matchLabels"]
    assert selected(pods, served, "Pod") == ["llama"]
    assert selected(services, served, "Service") == ["llama"]
    sts = one(served, "StatefulSet")
    assert "http" in [p["name"] for p in sts["spec"]["template"]["spec"]["containers"][0]["ports"]]
    assert "http" in [p["name"] for p in one([o for o in served if o["metadata"]["name"] == "llama"],
                                             "Service")["spec"]["ports"]]
    trt = operator_objects(engine="tensorrt-llm", model={"name": "llama-3-8b", "preset": "llama3-8b",
                                                         "source": {"image": {"path": "/opt/model"}}})
    assert one(trt, "StatefulSet") and selected(pods, trt, "Pod") == selected(services, trt, "Service") == []
    assert not [o for o in template(include_crds=False) if o["kind"] in ("PodMonitor", "ServiceMonitor")]


def test_inference_pool_routes_to_a_decode_services_http_port():
    from switchyard.operator import render

    assert not [o for o in template(include_crds=False) if o["kind"] == "InferencePool"]
    objs = template("inferencePool.enabled=true", "inferencePool.decodeService=llama",
                    "inferencePool.namespace=models", "inferencePool.endpointPicker.service=llama-epp",
                    include_crds=False)
    pool = one(objs, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert (pool["metadata"]["name"], pool["metadata"]["namespace"]) == ("llama", "models")
    assert pool["metadata"]["labels"]["app.kubernetes.io/component"] == "inference-pool"
    served = operator_objects()
    assert selected(pool["spec"]["selector"]["matchLabels"], served, "Pod") == ["llama"]
    # The pool's port is the one the operator's pods serve the OpenAI API on.
    container = one(served, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    http_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "http")
    assert http_port == render.RenderConfig().http_port
    assert pool["spec"]["targetPorts"] == [{"number": http_port}]
    assert pool["spec"]["endpointPickerRef"] == {"name": "llama-epp", "port": {"number": 9002},
                                                 "failureMode": "FailClose"}
    named = one(template("inferencePool.enabled=true", "inferencePool.decodeService=llama",
                         "inferencePool.name=llama-pool", "inferencePool.endpointPicker.service=epp",
                         "inferencePool.endpointPicker.port=9010", "inferencePool.endpointPicker.failureMode=FailOpen",
                         include_crds=False), "InferencePool")
    assert (named["metadata"]["name"], named["metadata"]["namespace"]) == ("llama-pool", "switchyard-system")
    assert named["spec"]["endpointPickerRef"] == {"name": "epp", "port": {"number": 9010}, "failureMode": "FailOpen"}


@pytest.mark.parametrize(("sets", "message"), [
    (["inferencePool.enabled=true"], "inferencePool.decodeService is required"),
    (["inferencePool.enabled=true", "inferencePool.decodeService=llama"],
     "inferencePool.endpointPicker.service is required"),
    (["inferencePool.endpointPicker.failureMode=Maybe"], "failureMode"),
    (["inferencePool.decodeService=Not_A_Name"], "decodeService"),
    (["inferencePool.endpointPicker.port=70000"], "port"),
    (["metrics.podMonitor.interval=soon"], "interval"),
    (["metrics.serviceMonitor.enabeld=true"], "enabeld"),
])
def test_monitor_and_pool_values_are_checked(sets, message):
    args = ["template", "x", str(CHART)]
    for s in sets:
        args += ["--set", s]
    proc = run_helm(*args, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
