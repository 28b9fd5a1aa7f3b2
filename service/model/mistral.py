"""Mistral: Llama's layer; config.json states a sliding window (4096 when the key is absent, as in
transformers), which the engine does not implement: serve refuses a context longer than it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from switchyard.service.model.family import DECODER_LAYER, Family

if TYPE_CHECKING:
    from switchyard.service.modelspec import ModelSpec

DEFAULT_SLIDING_WINDOW = 4096


def read_config(config: Mapping[str, Any]) -> dict[str, Any]:
    return {"sliding_window": config.get("sliding_window", DEFAULT_SLIDING_WINDOW)}


def write_config(spec: ModelSpec) -> dict[str, Any]:
    return {"sliding_window": spec.sliding_window}


FAMILY = Family(name="mistral", model_types=("mistral",), architectures=("MistralForCausalLM",),
                layer_tensors=DECODER_LAYER, read_config=read_config, write_config=write_config)
