"""DecodeService spec → the planner's inputs. Pure: the handlers fetch, this module interprets."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from switchyard.service.modelspec import ModelSpec, ModelSpecError, preset

from .crd import object_defaults, spec_default, spec_defaults
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


def model_spec(spec: Mapping[str, Any], config_map_data: Mapping[str, str] | None = None) -> ModelSpec:
    """The model as served: its shape from a preset, the inline config or the referenced ConfigMap's
    data, its weights in the format spec.model.quantization asks for (``ModelSpec.served_as``)."""
    shape = _model_shape(spec, config_map_data)
    try:
        return shape.served_as(spec["model"].get("quantization", spec_default("model.quantization")))
    except ModelSpecError as err:
        raise SpecError(f"spec.model.quantization: {err}") from err


def _model_shape(spec: Mapping[str, Any], config_map_data: Mapping[str, str] | None) -> ModelSpec:
    model = spec["model"]
    try:
        if "preset" in model:
            return dataclasses.replace(preset(model["preset"]), name=model["name"])
        if "config" in model:
            return _from_config(model["config"], model["name"], "spec.model.config")
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
        return _from_config(raw, model["name"], f"ConfigMap {ref[0]} key {ref[1]}")
    except ModelSpecError as err:
        raise SpecError(str(err)) from err


def _from_config(config: Any, name: str, where: str) -> ModelSpec:
    """The shape a config.json describes; its bounds and rules are modelspec's (the CRD states the
    same bounds, which a ConfigMap's config.json never passed through)."""
    try:
        return ModelSpec.from_config(config, name=name)
    except ModelSpecError as err:
        raise SpecError(f"{where}: {err}") from err


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
