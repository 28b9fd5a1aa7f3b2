"""Llama 2 / 3 / 3.1 / 3.2: the decoder layer every other family builds on."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from switchyard.service.model.family import DECODER_LAYER, Family, refuse

if TYPE_CHECKING:
    from switchyard.service.modelspec import ModelSpec


def read_config(config: Mapping[str, Any]) -> dict[str, Any]:
    refuse(config, "attention_bias", "llama", "Llama's bias is on the output projection too")
    return {}


def write_config(spec: ModelSpec) -> dict[str, Any]:
    return {"attention_bias": False, "mlp_bias": False}


FAMILY = Family(name="llama", model_types=("llama",), architectures=("LlamaForCausalLM",),
                layer_tensors=DECODER_LAYER, read_config=read_config, write_config=write_config)
