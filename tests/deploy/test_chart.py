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
                    "--set", "operator.imagePullSecrets[0].name=registry")
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
