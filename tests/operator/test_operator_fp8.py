"""spec.model.quantization: the schema's enum is the serving side's, the planner prices the weights as
served (FP8 matrices a byte each with their float32 scales), the status says which, and the pods are
told."""

from __future__ import annotations

import json
import math

import pytest
from helpers.kube.harness import H100_MIB, gpu_node
from switchyard.operator import crd, inventory, planner, render
from switchyard.operator import spec as specmod
from switchyard.service.model import quantization as quant
from switchyard.service.modelspec import ServingLayout, preset
from test_operator_crd import GOOD, admit, with_spec


def h100(n: int) -> list[dict]:
    return [gpu_node(f"h100-{i}", "NVIDIA-H100-80GB-HBM3", mem_mib=H100_MIB) for i in range(n)]


def service(preset_name: str, quantization: str | None = None) -> dict:
    model = {"name": "m", "preset": preset_name, "source": {"pvc": {"claimName": "models"}}}
    if quantization is not None:
        model["quantization"] = quantization
    return {"model": model}


def test_the_schema_takes_the_serving_choices_and_defaults_to_auto():
    assert crd.spec_schema("model")["properties"]["quantization"]["enum"] == list(quant.CHOICES)
    stored, errors = admit(GOOD)
    assert errors == [] and stored["spec"]["model"]["quantization"] == "auto"
    assert crd.spec_defaults(GOOD["spec"]) == stored["spec"]
    assert admit(with_spec(model__quantization="fp8"))[1] == []
    _, errors = admit(with_spec(model__quantization="int4"))
    assert any("spec.model.quantization: 'int4' is not one of ['auto', 'none', 'fp8']" in e for e in errors), errors


def _weights(model, block_k: int = 0) -> int:
    """FP8 matrices a byte per weight and a float32 scale per output channel (and per ``block_k``
    input features); the rest two bytes each."""
    s = model
    per_layer = {"q": (s.q_size, s.hidden_size), "k": (s.kv_size, s.hidden_size), "v": (s.kv_size, s.hidden_size),
                 "o": (s.hidden_size, s.q_size), "gate": (s.intermediate_size, s.hidden_size),
                 "up": (s.intermediate_size, s.hidden_size), "down": (s.hidden_size, s.intermediate_size)}
    matrices = sum(o * i for o, i in per_layer.values()) * s.num_layers
    scales = sum(o * (-(-i // block_k) if block_k else 1) for o, i in per_layer.values()) * s.num_layers
    return (s.param_count - matrices) * 2 + matrices + 4 * scales


def test_fp8_halves_the_weight_bytes_the_planner_prices():
    bf16 = specmod.model_spec(service("llama3-70b"))
    fp8 = specmod.model_spec(service("llama3-70b", "fp8"))
    assert bf16.param_bytes == 2 * bf16.param_count and bf16.quantization is None
    assert fp8.param_bytes == _weights(fp8)
    assert 0.5 < fp8.param_bytes / bf16.param_bytes < 0.53  # the embedding and LM head stay 16-bit
    # A decode step reads the weights once: about half the bytes.
    assert fp8.decode_bytes_per_step(1, 1024) < 0.53 * bf16.decode_bytes_per_step(1, 1024)
    assert specmod.model_spec(service("llama3-70b", "none")) == bf16


def test_70b_in_fp8_fits_two_h100s_where_bf16_needs_a_second_stage():
    """70B's bf16 weights take more of two H100s than XLA's compiler counts usable (80%), so at TP=2 bf16
    needs a second pipeline stage (four GPUs); in FP8 two GPUs hold the weights and a KV cache, and the
    status says which weights it priced."""
    nodes = inventory.build(h100(1))
    layouts = {}
    for name in ("auto", "fp8"):
        spec = {**service("llama3-70b", name), "parallelism": {"tp": 2}}
        model = specmod.model_spec(spec)
        p = planner.plan(model, nodes, specmod.request(spec))
        assert p.layout is not None and p.layout.tp == 2, p.message
        assert any(f"GiB weights ({model.weights_label})" in r for r in p.reasons), p.reasons
        layouts[name] = p.layout
        if name == "auto":
            assert any(a.layout.startswith("TP2xPP1") and "XLA's compiler counts usable" in a.rejected
                       for a in p.alternatives), p.alternatives
    assert (layouts["auto"].pp, layouts["fp8"].pp) == (2, 1)
    assert layouts["fp8"].weight_bytes_per_gpu == math.ceil(specmod.model_spec(service("llama3-70b", "fp8"))
                                                            .param_bytes / 2)
    assert layouts["fp8"].kv_tokens >= 64 * 1024  # a pool for real traffic beside the weights
    # Fewer bytes a token, and no second stage to cross: the estimate is faster too.
    assert layouts["fp8"].ms_per_token < layouts["auto"].ms_per_token


def test_405b_in_fp8_fits_one_8_gpu_h100_node_without_pipeline_stages():
    nodes = inventory.build(h100(1))
    p = planner.plan(preset("llama3.1-405b"), nodes, planner.Request(pp=1))
    assert p.layout is None
    spec = {**service("llama3.1-405b", "fp8"), "parallelism": {"pp": 1}}
    p = planner.plan(specmod.model_spec(spec), nodes, specmod.request(spec))
    assert p.layout is not None and (p.layout.tp, p.layout.pp, p.layout.dp) == (8, 1, 1)


def test_an_fp8_checkpoints_config_is_priced_as_fp8_unless_served_dequantized():
    config = {**preset("llama3-8b").to_config(), "quantization_config": quant.WRITTEN["fp8-block"].to_config()}
    spec = {"model": {"name": "m", "configMapRef": {"name": "cfg"}, "source": {"pvc": {"claimName": "models"}}}}
    data = {"config.json": json.dumps(config)}
    auto = specmod.model_spec(spec, data)
    assert auto.quantization == quant.WRITTEN["fp8-block"]
    # Block scales: a float32 scale per output channel and 128 input features, as the engine holds them.
    assert auto.param_bytes == _weights(auto, block_k=128)
    spec["model"]["quantization"] = "none"
    assert specmod.model_spec(spec, data).param_bytes == 2 * auto.param_count


def test_the_pods_are_told_the_quantization():
    body = {"apiVersion": "switchyard.dev/v1alpha1", "kind": "DecodeService",
            "metadata": {"name": "llama", "namespace": "default", "uid": "u1", "generation": 1},
            "spec": service("llama3-8b", "fp8")}
    spec = specmod.normalized(body["spec"])
    p = planner.plan(specmod.model_spec(spec), inventory.build(h100(1)), specmod.request(spec))
    objs = render.render(body, spec, p, specmod.model_source(spec))
    layouts = [ServingLayout.from_json(o["data"]["layout.json"]) for o in objs if o["kind"] == "ConfigMap"]
    assert layouts and all(lay.quantization == "fp8" for lay in layouts)


@pytest.mark.parametrize("choice", quant.CHOICES)
def test_every_choice_is_a_layout_serve_takes(choice):
    assert ServingLayout(quantization=choice).quantization == choice
