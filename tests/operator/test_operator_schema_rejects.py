"""Values no pod can use are refused by the API server (the test API server, with the CRD's OpenAPI
schema and CEL rules): a 422 whose message names the field. And every value in the schema is bounded."""

from __future__ import annotations

import copy

import pytest
from helpers.kube.harness import cluster, decode_service
from switchyard.operator import crd

DS_PATH = "/apis/switchyard.dev/v1alpha1/namespaces/default/decodeservices"
# Half a megabyte: far over every maxLength, under the test server's 1 MiB request limit.
MEGABYTE = "x" * 2**19
CONFIG = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
          "num_attention_heads": 32}


def model(**changes) -> dict:
    body = {"name": "m", "source": {"pvc": {"claimName": "models"}}, "config": dict(CONFIG)}
    for key, value in changes.items():
        if key == "source":
            body["source"] = value
        else:
            body["config"][key] = value
    return body


# name -> (spec changes, a fragment of the 422 message that names the field)
REJECTED = {
    "subPath ..": ({"model": model(source={"pvc": {"claimName": "models", "subPath": "../../etc"}})},
                   "spec.model.source.pvc.subPath: '../../etc' does not match"),
    "subPath inner ..": ({"model": model(source={"pvc": {"claimName": "models", "subPath": "a/../../b"}})},
                         "spec.model.source.pvc.subPath"),
    "subPath absolute": ({"model": model(source={"pvc": {"claimName": "models", "subPath": "/etc"}})},
                         "spec.model.source.pvc.subPath: '/etc' does not match"),
    "claim capitals": ({"model": model(source={"pvc": {"claimName": "Models"}})},
                       "spec.model.source.pvc.claimName: 'Models' does not match"),
    "configMap capitals": ({"model": {"name": "m", "source": {"pvc": {"claimName": "c"}},
                                      "configMapRef": {"name": "Llama Config"}}},
                           "spec.model.configMapRef.name: 'Llama Config' does not match"),
    "exists with value": ({"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]},
                          'spec.tolerations[0]: Invalid value: "object": a toleration with operator Exists '
                          'takes no value'),
    "negative cpu": ({"resources": {"requests": {"cpu": -1}}},
                     "spec.resources.requests.cpu: -1 is less than the minimum of 0"),
    "negative memory": ({"resources": {"limits": {"memory": -5}}},
                        "spec.resources.limits.memory: -5 is less than the minimum of 0"),
    "cpu request above limit": ({"resources": {"requests": {"cpu": "2"}, "limits": {"cpu": "1500m"}}},
                                'spec.resources: Invalid value: "object": requests.cpu must not exceed limits.cpu'),
    "memory request above limit": ({"resources": {"requests": {"memory": "2Gi"}, "limits": {"memory": 2**30}}},
                                   "spec.resources: Invalid value: \"object\": requests.memory must not exceed "
                                   "limits.memory"),
    "selector key with space": ({"nodeSelector": {"gpu pool": "a"}},
                                'spec.nodeSelector: Invalid value: "object": nodeSelector keys must be label keys'),
    "selector key too long": ({"nodeSelector": {"a." * 200 + "/x": "y"}},
                              'spec.nodeSelector: Invalid value: "object": nodeSelector keys must be label keys'),
    "selector value with space": ({"nodeSelector": {"pool": "a b"}}, "spec.nodeSelector.pool: 'a b' does not match"),
    "image with space": ({"image": "registry/x:1 --privileged"},
                         "spec.image: 'registry/x:1 --privileged' does not match"),
    "megabyte image": ({"image": MEGABYTE}, "spec.image: "),
    "megabyte otlp": ({"otlpEndpoint": "http://" + MEGABYTE}, "spec.otlpEndpoint: "),
    "megabyte subPath": ({"model": model(source={"pvc": {"claimName": "c", "subPath": MEGABYTE}})},
                         "spec.model.source.pvc.subPath: "),
    "layers": ({"model": model(num_hidden_layers=10**7)},
               "spec.model.config.num_hidden_layers: 10000000 is greater than the maximum of 1024"),
    "hidden": ({"model": model(hidden_size=2**20)}, "spec.model.config.hidden_size: 1048576 is greater than"),
    "vocab": ({"model": model(vocab_size=1)}, "spec.model.config.vocab_size: 1 is less than the minimum of 2"),
    "heads": ({"model": model(num_attention_heads=4096)}, "spec.model.config.num_attention_heads: 4096 is greater"),
    "one-token context": ({"model": model(max_position_embeddings=1)},
                          "spec.model.config.max_position_embeddings: 1 is less than the minimum of 2"),
    "rope theta": ({"model": model(rope_theta=1e300)}, "spec.model.config.rope_theta: 1e+300 is greater than"),
    "toleration seconds": ({"tolerations": [{"key": "k", "operator": "Exists", "tolerationSeconds": 2**40}]},
                           "spec.tolerations.0.tolerationSeconds: 1099511627776 is greater than"),
    "too many tolerations": ({"tolerations": [{"key": "k", "operator": "Exists"}] * 33},
                             "spec.tolerations: "),
    "slo": ({"slo": {"maxTimePerOutputTokenMs": 1e12}}, "spec.slo.maxTimePerOutputTokenMs: 1000000000000.0 is "),
    "kv fraction": ({"kvMemoryFraction": 0.99}, "spec.kvMemoryFraction: 0.99 is greater than the maximum of 0.95"),
    "step tokens": ({"stepTokens": 100}, "spec.stepTokens: 100 is not a multiple of 16"),
    "image path with a newline": ({"model": model(source={"image": {"path": "/models/m\nx"}})},
                                  "spec.model.source.image.path: "),
    "host path with a control character": ({"model": model(source={"hostPath": {"path": "/models/\x1bm"}})},
                                           "spec.model.source.hostPath.path: "),
    "subPath with a newline": ({"model": model(source={"pvc": {"claimName": "c", "subPath": "a/b\nc"}})},
                               "spec.model.source.pvc.subPath: "),
    "toleration seconds without NoExecute": (
        {"tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 30}]},
        'spec.tolerations[0]: Invalid value: "object": tolerationSeconds applies to the NoExecute effect only'),
    "toleration seconds without an effect": (
        {"tolerations": [{"key": "k", "operator": "Exists", "tolerationSeconds": 30}]},
        "tolerationSeconds applies to the NoExecute effect only"),
    "heads not a multiple of KV heads": ({"model": model(num_attention_heads=3, num_key_value_heads=2)},
                                         "num_attention_heads must be a multiple of num_key_value_heads"),
    "odd head size": ({"model": model(head_dim=65)}, "head_dim (or hidden_size / num_attention_heads) must be even"),
    "odd derived head size": ({"model": model(hidden_size=96, num_attention_heads=32)},
                              "head_dim (or hidden_size / num_attention_heads) must be even"),
    "hidden smaller than heads": ({"model": model(hidden_size=16, num_attention_heads=32)},
                                  "hidden_size is smaller than num_attention_heads"),
    "equal rope frequency factors": (
        {"model": model(rope_scaling={"rope_type": "llama3", "factor": 8, "low_freq_factor": 4,
                                      "high_freq_factor": 4})},
        "llama3 rope scaling needs low_freq_factor below high_freq_factor"),
}

ADMITTED = {
    "subPath nested": {"model": model(source={"pvc": {"claimName": "models", "subPath": "llama/3/8b"}})},
    "subPath dots in names": {"model": model(source={"pvc": {"claimName": "m.v1", "subPath": "..a/b..c/.d/./e"}})},
    "requests equal limits": {"resources": {"requests": {"cpu": "1", "memory": "1Gi"},
                                            "limits": {"cpu": "1000m", "memory": 2**30}}},
    "requests below limits": {"resources": {"requests": {"cpu": "500m", "memory": "1e9"},
                                            "limits": {"cpu": 2, "memory": "1Gi"}}},
    "exists without value": {"tolerations": [{"operator": "Exists"}, {"key": "a/b", "operator": "Exists"}]},
    "prefixed selector": {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200", "pool": ""}},
    "image with digest": {"image": "registry.example.com:5000/switchyard/llama-3-8b:0.1.0@sha256:" + "a" * 64},
    "kv and step": {"kvMemoryFraction": 0.5, "stepTokens": 512},
    "toleration seconds with NoExecute": {"tolerations": [{"key": "k", "operator": "Exists", "effect": "NoExecute",
                                                           "tolerationSeconds": 30}]},
    "image path with a space": {"model": model(source={"image": {"path": "/models/llama 3"}})},
    "grouped heads": {"model": model(num_attention_heads=32, num_key_value_heads=8, head_dim=128)},
    "llama3 rope": {"model": model(rope_scaling={"rope_type": "llama3", "factor": 8, "low_freq_factor": 1,
                                                 "high_freq_factor": 4})},
}


async def post(c, spec_changes: dict, name: str = "llama") -> tuple[int, dict]:
    obj = decode_service(name)
    obj["spec"].update(copy.deepcopy(spec_changes))
    return await c.request("POST", DS_PATH, obj, content_type="application/json")


@pytest.mark.asyncio
async def test_values_no_pod_can_use_are_refused_naming_the_field(tmp_path):
    async with cluster(tmp_path, []) as c:
        wrong = {}
        for i, (name, (changes, fragment)) in enumerate(REJECTED.items()):
            status, body = await post(c, changes, f"ds-{i}")
            if status != 422 or fragment not in body.get("message", ""):
                wrong[name] = (status, body.get("message", "")[:400])
            assert len(body.get("message", "")) < 8192, f"{name}: the value is echoed whole"
        assert not wrong, wrong
        for name, changes in ADMITTED.items():
            status, body = await post(c, changes)
            assert status == 201, (name, body.get("message"))
            status, _ = await c.request("DELETE", f"{DS_PATH}/llama", content_type="application/json")
            assert status in (200, 202)


def _unbounded(schema: dict, path: str) -> list[str]:
    """Paths of the values under ``schema`` without an upper bound (an enum bounds a value too)."""
    kind = "int-or-string" if schema.get("x-kubernetes-int-or-string") else schema.get("type")
    bounds = {"int-or-string": ("maximum", "maxLength"), "integer": ("maximum",), "number": ("maximum",),
              "string": ("maxLength",), "array": ("maxItems",)}.get(kind, ())
    out = [path] if "enum" not in schema and any(b not in schema for b in bounds) else []
    for name, sub in (schema.get("properties") or {}).items():
        if name != "metadata":
            out += _unbounded(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        out += _unbounded(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        out += _unbounded(schema["additionalProperties"], f"{path}{{}}")
        if "maxProperties" not in schema:
            out.append(path)
    return out


def test_every_number_string_and_array_of_the_schema_is_bounded():
    assert _unbounded(crd.openapi_schema(), "") == []
