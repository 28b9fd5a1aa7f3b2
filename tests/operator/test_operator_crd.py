"""The DecodeService CRD: one source of truth, structural, and strict enough that bad resources are
rejected with a readable message (validated with an OpenAPI 3.0 validator, as the API server would)."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
import yaml
from helpers import ROOT
from helpers.kube import crschema
from switchyard.operator import crd

EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))

GOOD = {
    "apiVersion": "switchyard.dev/v1alpha1", "kind": "DecodeService",
    "metadata": {"name": "llama", "namespace": "default"},
    "spec": {"model": {"name": "llama-3-8b", "preset": "llama3-8b", "source": {"pvc": {"claimName": "models"}}}},
}


def admit(obj: dict) -> tuple[dict, list[str]]:
    return crschema.admit(crd.openapi_schema(), obj, strict=True)


def with_spec(**changes) -> dict:
    obj = copy.deepcopy(GOOD)
    for dotted, value in changes.items():
        cur = obj["spec"]
        *parents, leaf = dotted.split("__")
        for p in parents:
            cur = cur.setdefault(p, {})
        if value is _DELETE:
            del cur[leaf]
        else:
            cur[leaf] = value
    return obj


_DELETE = object()


def test_copies_do_not_drift_from_the_packaged_source():
    for source, name in crd.COPIES.items():
        copy_path = ROOT / "manifests" / "crds" / name
        assert copy_path.read_bytes() == source.read_bytes(), \
            f"{copy_path} drifted: run python -m switchyard.operator.crd --write manifests/crds"
    chart = ROOT / "charts" / "switchyard" / "crds"
    if chart.exists():  # the Helm chart carries the same bytes
        for source, name in crd.COPIES.items():
            assert (chart / name).read_bytes() == source.read_bytes(), f"{chart / name} drifted"


def test_crd_is_a_valid_structural_crd():
    manifest = crd.load_crd()
    kubernetes_validate.validate(manifest, "1.31", strict=True)
    version = manifest["spec"]["versions"][0]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.replicas"
    # Structural schema rules the API server enforces: every node typed, no additionalProperties
    # next to properties.
    def walk(node: dict, path: str) -> None:
        if "properties" in node:
            assert "additionalProperties" not in node, path
            for key, sub in node["properties"].items():
                walk(sub, f"{path}.{key}")
        if "items" in node:
            walk(node["items"], f"{path}[]")
        assert "type" in node or node.get("x-kubernetes-int-or-string") or \
            node.get("x-kubernetes-preserve-unknown-fields"), f"{path} has no type"
    walk(version["schema"]["openAPIV3Schema"], "")
    # Printer columns and scale paths point at fields the status schema declares.
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    for column in version["additionalPrinterColumns"]:
        parts = column["jsonPath"].split(".")[1:]
        if parts[0] == "status":
            assert parts[1] in status, column
    assert "selector" in status and "replicas" in status


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_admitted(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs
    for doc in docs:
        stored, errors = admit(doc)
        assert errors == [], errors
        assert stored["spec"]["engine"] in ("switchyard", "tensorrt-llm")


def test_defaults_are_applied_by_the_schema_and_by_the_operator_alike():
    stored, errors = admit(GOOD)
    assert errors == []
    assert (stored["spec"]["objective"], stored["spec"]["engine"], stored["spec"]["allReduce"]) == \
        ("balanced", "switchyard", "auto")
    assert stored["spec"]["kvMemoryFraction"] == 0.9 and "stepTokens" not in stored["spec"]
    assert crd.spec_defaults(GOOD["spec"]) == stored["spec"]
    with_workload = with_spec(workload={"concurrency": 3})
    stored, _ = admit(with_workload)
    assert stored["spec"]["workload"] == {"concurrency": 3, "inputTokens": 1024, "outputTokens": 256}


GOOD_VARIANTS = {
    "inline config": with_spec(model={"name": "m", "source": {"hostPath": {"path": "/m"}}, "config": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}}),
    "configmap": with_spec(model={"name": "m", "source": {"image": {"path": "/opt/m"}}, "configMapRef": {"name": "c"}}),
    "pinned": with_spec(parallelism={"tp": 4, "pp": 2}, replicas=0, allReduce="twoshot"),
    "everything": with_spec(objective="throughput", slo={"maxTimePerOutputTokenMs": 50, "maxTimeToFirstTokenMs": 800,
                                                         "targetTokensPerSecond": 1e4},
                            resources={"requests": {"cpu": "500m", "memory": "64Gi"},
                                       "limits": {"memory": 68719476736}},
                            nodeSelector={"pool": "gpu"}, engine="tensorrt-llm", imagePullPolicy="Always",
                            tolerations=[{"key": "k", "operator": "Exists", "effect": "NoExecute",
                                          "tolerationSeconds": 30}],
                            otlpEndpoint="https://otel.example.com:4318", image="registry/x:1"),
    "kv and step": with_spec(kvMemoryFraction=0.95, stepTokens=8192),
    "smallest step": with_spec(kvMemoryFraction=0.01, stepTokens=16),
    "qwen2": with_spec(model={"name": "m", "source": {"hostPath": {"path": "/m"}}, "config": {
        "model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
        "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "use_sliding_window": False,
        "sliding_window": 131072}}),
    # Qwen3's head_dim is 128 when absent, whatever hidden_size / num_attention_heads (here 45) is.
    "qwen3 without head_dim": with_spec(model={"name": "m", "source": {"hostPath": {"path": "/m"}}, "config": {
        "model_type": "qwen3", "vocab_size": 1000, "hidden_size": 1800, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 40, "num_key_value_heads": 8}}),
    "mistral without a window": with_spec(model={"name": "m", "source": {"hostPath": {"path": "/m"}}, "config": {
        "model_type": "mistral", "vocab_size": 32768, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "sliding_window": None}}),
}


@pytest.mark.parametrize("name", GOOD_VARIANTS)
def test_good_resources_are_admitted(name):
    _, errors = admit(GOOD_VARIANTS[name])
    assert errors == []


BAD = {
    "no model": (with_spec(model=_DELETE), "'model' is a required property"),
    "no source": (with_spec(model__source=_DELETE), "'source' is a required property"),
    "two shapes": (with_spec(model__config={"vocab_size": 1, "hidden_size": 1, "intermediate_size": 1,
                                            "num_hidden_layers": 1, "num_attention_heads": 1}),
                   "is valid under each of {'required': ['config']}, {'required': ['preset']}"),
    "no shape": (with_spec(model__preset=_DELETE), "is not valid under any of the given schemas"),
    "two sources": (with_spec(model__source={"pvc": {"claimName": "a"}, "hostPath": {"path": "/a"}}),
                    "spec.model.source:"),
    "unknown preset": (with_spec(model__preset="gpt-5"), "spec.model.preset: 'gpt-5' is not one of"),
    "unknown model type": (with_spec(model={"name": "m", "source": {"pvc": {"claimName": "c"}}, "config": {
        "model_type": "gpt2", "vocab_size": 2, "hidden_size": 2, "intermediate_size": 1, "num_hidden_layers": 1,
        "num_attention_heads": 1}}), "spec.model.config.model_type: 'gpt2' is not one of ['llama', 'mistral', "
                                     "'qwen2', 'qwen3']"),
    "odd llama head": (with_spec(model={"name": "m", "source": {"pvc": {"claimName": "c"}}, "config": {
        "model_type": "llama", "vocab_size": 1000, "hidden_size": 1800, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 40}}), "must be even for rotary embeddings"),
    "window of 0": (with_spec(model={"name": "m", "source": {"pvc": {"claimName": "c"}}, "config": {
        "model_type": "mistral", "vocab_size": 2, "hidden_size": 2, "intermediate_size": 1, "num_hidden_layers": 1,
        "num_attention_heads": 1, "sliding_window": 0}}),
        "spec.model.config.sliding_window: 0 is less than the minimum of 1"),
    "bad objective": (with_spec(objective="fastest"), "spec.objective: 'fastest' is not one of"),
    "tp 3": (with_spec(parallelism={"tp": 3}), "spec.parallelism.tp: 3 is not one of [1, 2, 4, 8]"),
    "pp 0": (with_spec(parallelism={"pp": 0}), "spec.parallelism.pp: 0 is less than the minimum of 1"),
    "negative replicas": (with_spec(replicas=-1), "spec.replicas: -1 is less than the minimum of 0"),
    "replicas string": (with_spec(replicas="auto"), "spec.replicas: 'auto' is not of type 'integer'"),
    "strategy": (with_spec(allReduce="nccl"), "spec.allReduce: 'nccl' is not one of"),
    "engine": (with_spec(engine="vllm"), "spec.engine: 'vllm' is not one of"),
    "slo zero": (with_spec(slo={"maxTimePerOutputTokenMs": 0}),
                 "spec.slo.maxTimePerOutputTokenMs: 0 is less than or equal"),
    "concurrency": (with_spec(workload={"concurrency": 0}), "spec.workload.concurrency: 0 is less than the minimum"),
    "unknown field": (with_spec(gpus=8), 'spec.gpus: unknown field "gpus"'),
    "unknown nested": (with_spec(slo={"p99": 5}), 'spec.slo.p99: unknown field "p99"'),
    "otlp": (with_spec(otlpEndpoint="collector:4317"), "spec.otlpEndpoint: 'collector:4317' does not match"),
    "cpu": (with_spec(resources={"requests": {"cpu": "two"}}), "spec.resources.requests.cpu: 'two' does not match"),
    "hostPath relative": (with_spec(model__source={"hostPath": {"path": "models"}}),
                          "spec.model.source.hostPath.path: 'models' does not match"),
    "config lacks layers": (with_spec(model={"name": "m", "source": {"pvc": {"claimName": "c"}}, "config": {
        "vocab_size": 1, "hidden_size": 1, "intermediate_size": 1, "num_attention_heads": 1}}),
        "'num_hidden_layers' is a required property"),
    "toleration op": (with_spec(tolerations=[{"key": "k", "operator": "Matches"}]),
                      "spec.tolerations.0.operator: 'Matches' is not one of"),
    "model name": (with_spec(model__name="Llama 3"), "spec.model.name: 'Llama 3' does not match"),
    "kv fraction 0": (with_spec(kvMemoryFraction=0), "spec.kvMemoryFraction: 0 is less than or equal to the minimum"),
    "kv fraction 1": (with_spec(kvMemoryFraction=1), "spec.kvMemoryFraction: 1 is greater than the maximum of 0.95"),
    "step tokens 8": (with_spec(stepTokens=8), "spec.stepTokens: 8 is less than the minimum of 16"),
    "step tokens 100": (with_spec(stepTokens=100), "spec.stepTokens: 100 is not a multiple of 16"),
    "step tokens big": (with_spec(stepTokens=16384), "spec.stepTokens: 16384 is greater than the maximum of 8192"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_resources_are_rejected_with_a_readable_message(name):
    obj, fragment = BAD[name]
    _, errors = admit(obj)
    assert errors, f"{name} was admitted"
    assert any(fragment in e for e in errors), errors


def test_rbac_is_a_valid_cluster_role_without_wildcards():
    role = yaml.safe_load(crd.RBAC_FILE.read_text())
    kubernetes_validate.validate(role, "1.31", strict=True)
    standard = {"get", "list", "watch", "create", "update", "patch", "delete"}
    for rule in role["rules"]:
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[key], rule
        assert set(rule["verbs"]) <= standard, rule


def test_the_model_config_bounds_are_modelspecs():
    """The schema's bounds on spec.model.config are the ones every other path checks (modelspec)."""
    from switchyard.service.modelspec import INTEGER_BOUNDS, NUMBER_BOUNDS

    for name, (low, high) in INTEGER_BOUNDS.items():
        rule = crd.spec_schema("model.config")
        for part in name.split("."):
            rule = rule["properties"][part]
        assert (rule["type"], rule["minimum"], rule["maximum"]) == ("integer", low, high), name
    for name, (low, high) in NUMBER_BOUNDS.items():
        rule = crd.spec_schema("model.config")
        for part in name.split("."):
            rule = rule["properties"][part]
        assert (rule["type"], rule["minimum"], rule["exclusiveMinimum"], rule["maximum"]) == \
            ("number", low, True, high), name
    integers = [n for n, r in crd.spec_schema("model.config")["properties"].items() if r.get("type") == "integer"]
    assert set(integers) <= set(INTEGER_BOUNDS)
