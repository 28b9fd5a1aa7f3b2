"""The CRD schema is the one source of the DecodeService defaults: the spec reader and the planner's
Request take theirs from it, so a default changed in crd.yaml changes what the operator plans."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import yaml
from switchyard.operator import crd, planner
from switchyard.operator import spec as specmod
from switchyard.service import modelspec

MINIMAL = {"model": {"name": "m", "preset": "tiny", "source": {"pvc": {"claimName": "c"}}}}
# Every spec field the schema gives a default, and the Request field that carries it ("" where the
# planner does not read it: the renderer and the spec reader do).
DEFAULTED = {
    "objective": "objective",
    "workload.inputTokens": "input_tokens",
    "workload.outputTokens": "output_tokens",
    "workload.concurrency": "concurrency",
    "allReduce": "strategy",
    "kvMemoryFraction": "kv_memory_fraction",
    "engine": "",
    "model.configMapRef.key": "",
    "model.quantization": "",
}


def schema_defaults(node: dict, prefix: str = "") -> dict[str, object]:
    """Every ``default:`` under a schema node, by dotted path, read straight from the YAML."""
    out = {}
    for name, sub in node.get("properties", {}).items():
        path = f"{prefix}{name}"
        if "default" in sub:
            out[path] = sub["default"]
        out.update(schema_defaults(sub, f"{path}."))
    return out


def yaml_spec_defaults() -> dict[str, object]:
    manifest = yaml.safe_load(crd.CRD_FILE.read_text())
    (version,) = [v for v in manifest["spec"]["versions"] if v["name"] == crd.VERSION]
    return schema_defaults(version["schema"]["openAPIV3Schema"]["properties"]["spec"])


def test_every_schema_default_is_accounted_for():
    assert set(yaml_spec_defaults()) == set(DEFAULTED)
    for path, value in yaml_spec_defaults().items():
        assert crd.spec_default(path) == value


def test_request_defaults_are_the_schema_defaults():
    defaults = yaml_spec_defaults()
    fields = {f.name: f.default for f in dataclasses.fields(planner.Request)}
    for path, field in DEFAULTED.items():
        if field:
            assert fields[field] == defaults[path], (path, field)


def test_a_request_from_an_empty_spec_is_the_default_request():
    assert specmod.request(MINIMAL) == planner.Request()
    assert specmod.request(specmod.normalized(MINIMAL)) == planner.Request()
    # A workload that sets one field keeps the schema's defaults for the others.
    req = specmod.request({**MINIMAL, "workload": {"concurrency": 3}})
    assert (req.input_tokens, req.output_tokens, req.concurrency) == (1024, 256, 3)


def test_a_spec_without_workload_reads_as_the_api_server_stores_one_with_an_empty_workload():
    assert specmod.request(MINIMAL) == specmod.request(crd.spec_defaults({**MINIMAL, "workload": {}}))
    assert crd.object_defaults("workload") == {"inputTokens": 1024, "outputTokens": 256, "concurrency": 8}
    assert crd.object_defaults("workload", {"concurrency": 3}) == {"inputTokens": 1024, "outputTokens": 256,
                                                                   "concurrency": 3}
    with pytest.raises(KeyError, match=r"spec\.replicas"):
        crd.spec_default("replicas")


def test_config_map_key_defaults_from_the_schema_even_before_normalising():
    spec = {"model": {"name": "m", "configMapRef": {"name": "cfg"}, "source": {"pvc": {"claimName": "c"}}}}
    assert specmod.config_map_ref(spec) == ("cfg", "config.json")
    spec["model"]["configMapRef"]["key"] = "shape.json"
    assert specmod.config_map_ref(spec) == ("cfg", "shape.json")


def test_a_default_changed_in_the_schema_changes_what_the_spec_reader_asks_for(monkeypatch):
    schema = crd.openapi_schema()
    changed = copy.deepcopy(schema)
    spec_props = changed["properties"]["spec"]["properties"]
    spec_props["objective"]["default"] = "throughput"
    spec_props["allReduce"]["default"] = "twoshot"
    spec_props["workload"]["properties"]["concurrency"]["default"] = 64
    spec_props["model"]["properties"]["configMapRef"]["properties"]["key"]["default"] = "shape.json"
    spec_props["kvMemoryFraction"]["default"] = 0.7
    monkeypatch.setattr(crd, "openapi_schema", lambda version=crd.VERSION: copy.deepcopy(changed))
    req = specmod.request(MINIMAL)
    assert (req.objective, req.strategy, req.concurrency, req.input_tokens) == ("throughput", "twoshot", 64, 1024)
    assert req.kv_memory_fraction == 0.7 and req.step_tokens is None
    assert specmod.normalized(MINIMAL)["objective"] == "throughput"
    spec = {"model": {"name": "m", "configMapRef": {"name": "cfg"}, "source": {"pvc": {"claimName": "c"}}}}
    assert specmod.config_map_ref(spec) == ("cfg", "shape.json")


def test_planner_limits_match_the_schema():
    assert tuple(crd.spec_schema("objective")["enum"]) == planner.OBJECTIVES
    assert tuple(crd.spec_schema("parallelism.tp")["enum"]) == planner.TP_SIZES
    assert crd.spec_schema("parallelism.pp")["maximum"] == planner.MAX_PP
    assert crd.spec_schema("replicas")["maximum"] == planner.MAX_REPLICAS
    # The KV and step settings: the schema's bounds are the layout file's, and a pod started without
    # a layout file sizes its KV pool with the schema's default share.
    fraction = crd.spec_schema("kvMemoryFraction")
    assert (fraction["minimum"], fraction["exclusiveMinimum"], fraction["maximum"]) == (
        0, True, modelspec.MAX_KV_MEMORY_FRACTION)
    assert fraction["default"] == modelspec.ServingLayout().kv_memory_fraction == modelspec.DEFAULT_KV_MEMORY_FRACTION
    step = crd.spec_schema("stepTokens")
    assert step["minimum"] == step["multipleOf"] == modelspec.STEP_TOKENS_MULTIPLE
    assert "default" not in step  # unset: the planner's choice, DEFAULT_STEP_TOKENS
    assert step["minimum"] <= modelspec.DEFAULT_STEP_TOKENS <= step["maximum"]
    assert specmod.request({**MINIMAL, "stepTokens": 512, "kvMemoryFraction": 0.5}) == planner.Request(
        step_tokens=512, kv_memory_fraction=0.5)
