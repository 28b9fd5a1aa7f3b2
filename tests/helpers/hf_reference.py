"""Hugging Face ``transformers`` as the reference implementation for engine tests, for every family."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from switchyard.service.modelspec import ModelSpec
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel


def hf_config(spec: ModelSpec) -> PretrainedConfig:
    """The family's transformers config class (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config)
    built from the config.json the spec writes."""
    fields = {k: v for k, v in spec.to_config().items() if k not in ("architectures", "torch_dtype", "model_type")}
    return AutoConfig.for_model(spec.model_type, **fields)


def hf_model(spec: ModelSpec, seed: int = 0, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """A randomly initialised HF model of the spec's family (LlamaForCausalLM, MistralForCausalLM, ...)
    with a trained-model-like weight scale; biases get the matrices' scale."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(spec)).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05)
    return model


def save_hf(model: PreTrainedModel, folder: Path) -> Path:
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def hf_logits(model: PreTrainedModel, tokens: list[int]) -> np.ndarray:
    """Logits [len(tokens), vocab] in float64."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), use_cache=False).logits[0]
    return out.double().numpy()


def hf_greedy(model: PreTrainedModel, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    return out[0, len(prompt):].tolist()
