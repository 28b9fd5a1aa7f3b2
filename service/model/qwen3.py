"""Qwen3: Llama's layer with an RMSNorm over head_dim on each query and key head before RoPE;
config.json states head_dim (128 when absent, as in transformers, whatever hidden_size is)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from switchyard.service.model.family import DECODER_LAYER, QK_NORM, Family, refuse, windowed_layers

if TYPE_CHECKING:
    from switchyard.service.modelspec import ModelSpec

DEFAULT_HEAD_DIM = 128


def read_config(config: Mapping[str, Any]) -> dict[str, Any]:
    refuse(config, "attention_bias", "qwen3", "Qwen3's bias is on the output projection too")
    return {"head_dim": DEFAULT_HEAD_DIM, "sliding_window": windowed_layers(config)}


def write_config(spec: ModelSpec) -> dict[str, Any]:
    window = spec.sliding_window
    return {"attention_bias": False, "use_sliding_window": window is not None, "sliding_window": window,
            "max_window_layers": 0}


FAMILY = Family(name="qwen3", model_types=("qwen3",), architectures=("Qwen3ForCausalLM",),
                layer_tensors={**DECODER_LAYER, **QK_NORM}, read_config=read_config, write_config=write_config)
