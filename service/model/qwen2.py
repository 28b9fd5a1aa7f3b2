"""Qwen2 / Qwen2.5: Llama's layer with biases on the q, k and v projections (always: config.json has
no switch for them)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from switchyard.service.model.family import DECODER_LAYER, QKV_BIAS, Family, windowed_layers

if TYPE_CHECKING:
    from switchyard.service.modelspec import ModelSpec


def read_config(config: Mapping[str, Any]) -> dict[str, Any]:
    return {"sliding_window": windowed_layers(config)}


def write_config(spec: ModelSpec) -> dict[str, Any]:
    window = spec.sliding_window
    return {"use_sliding_window": window is not None, "sliding_window": window, "max_window_layers": 0}


FAMILY = Family(name="qwen2", model_types=("qwen2",), architectures=("Qwen2ForCausalLM",),
                layer_tensors={**DECODER_LAYER, **QKV_BIAS}, read_config=read_config, write_config=write_config)
