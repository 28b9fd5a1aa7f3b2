"""DecodeService spec → the planner's inputs. Pure: the handlers fetch, this module interprets."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from switchyard.service.modelspec import ModelSpec, ModelSpecError, is_integer, is_number, preset

from .crd import object_defaults, spec_defaults, spec_schema
from .planner import Request
from .rejections import ServiceRejection

MODEL_ROOT = "/models"


class SpecError(ValueError):
    """A DecodeService the schema let through but the operator cannot serve (e.g. a bad config.json)."""

    kind = ServiceRejection.INVALID_MODEL


@dataclasses.dataclass(frozen=True)
class ModelSource:
    kind: str  # pvc | hostPath | image
    path: str  # where the pod sees the checkpoint
    claim_name: str = ""
    sub_path: str = ""
    host_path: str = ""


def normalized(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The spec with the schema defaults the API server would have applied."""
    return spec_defaults(dict(spec))


def model_source(spec: Mapping[str, Any]) -> ModelSource:
    model = spec["model"]
    src = model["source"]
    mount = f"{MODEL_ROOT}/{model['name']}"
    if "pvc" in src:
        return ModelSource("pvc", mount, claim_name=src["pvc"]["claimName"], sub_path=src["pvc"].get("subPath", ""))
    if "hostPath" in src:
        return ModelSource("hostPath", mount, host_path=src["hostPath"]["path"])
    if "image" in src:
        return ModelSource("image", src["image"]["path"])
    raise SpecError("spec.model.source needs one of pvc, hostPath, image")


def config_map_ref(spec: Mapping[str, Any]) -> tuple[str, str] | None:
    ref = spec["model"].get("configMapRef")
    if not ref:
        return None
    ref = object_defaults("model.configMapRef", ref)
    return ref["name"], ref["key"]


def check_config_bounds(config: Mapping[str, Any], where: str) -> None:
    """The numbers of a config.json within the bounds the CRD schema sets for ``spec.model.config``: a
    ConfigMap's config.json reaches the planner without the API server's validation."""
    if not isinstance(config, Mapping):
        return  # ModelSpec.from_config says what is wrong
    for name, rule in spec_schema("model.config")["properties"].items():
        if rule.get("type") not in ("integer", "number") or name not in config:
            continue
        value = config[name]
        whole = rule["type"] == "integer"
        if not (is_integer(value) if whole else is_number(value)):
            raise SpecError(f"{where}: {name} must be {'an integer' if whole else 'a number'}, got {value!r:.40}")
        low, high = rule.get("minimum", -math.inf), rule.get("maximum", math.inf)
        if (isinstance(value, float) and not math.isfinite(value)) or not low <= value <= high \
                or (rule.get("exclusiveMinimum") and value == low):
            raise SpecError(f"{where}: {name} {value!r:.40} is outside "
                            f"[{rule.get('minimum', '-inf')}, {rule.get('maximum', 'inf')}]")


def model_spec(spec: Mapping[str, Any], config_map_data: Mapping[str, str] | None = None) -> ModelSpec:
    """The model's shape from a preset, the inline config or the referenced ConfigMap's data."""
    model = spec["model"]
    try:
        if "preset" in model:
            return dataclasses.replace(preset(model["preset"]), name=model["name"])
        if "config" in model:
            check_config_bounds(model["config"], "spec.model.config")
            return ModelSpec.from_config(model["config"], name=model["name"])
        ref = config_map_ref(spec)
        if ref is None:
            raise SpecError("spec.model needs one of preset, config, configMapRef")
        if config_map_data is None:
            raise SpecError(f"ConfigMap {ref[0]} (the model's config.json) does not exist in this namespace")
        if ref[1] not in config_map_data:
            raise SpecError(f"ConfigMap {ref[0]} has no key {ref[1]!r}")
        try:
            raw = json.loads(config_map_data[ref[1]])
        except json.JSONDecodeError as err:
            raise SpecError(f"ConfigMap {ref[0]} key {ref[1]} is not JSON: {err}") from err
        check_config_bounds(raw, f"ConfigMap {ref[0]} key {ref[1]}")
        return ModelSpec.from_config(raw, name=model["name"])
    except ModelSpecError as err:
        raise SpecError(str(err)) from err


def request(spec: Mapping[str, Any]) -> Request:
    spec = normalized(spec)
    slo = spec.get("slo", {})
    work = object_defaults("workload", spec.get("workload"))
    par = spec.get("parallelism", {})
    pp = par.get("pp")
    if spec.get("engine") == "tensorrt-llm" and pp is None:
        # trtllm-serve spreads pipeline stages with MPI, which the operator does not launch across pods.
        pp = 1
    return Request(
        objective=spec["objective"],
        input_tokens=int(work["inputTokens"]),
        output_tokens=int(work["outputTokens"]),
        concurrency=int(work["concurrency"]),
        max_tpot_ms=slo.get("maxTimePerOutputTokenMs"),
        max_ttft_ms=slo.get("maxTimeToFirstTokenMs"),
        target_tokens_per_s=slo.get("targetTokensPerSecond"),
        replicas=spec.get("replicas"),
        tp=par.get("tp"),
        pp=pp,
        strategy=spec["allReduce"],
        kv_memory_fraction=float(spec["kvMemoryFraction"]),
        step_tokens=spec.get("stepTokens"),
        node_selector=dict(spec.get("nodeSelector", {})),
        tolerations=tuple(spec.get("tolerations", [])),
    )
