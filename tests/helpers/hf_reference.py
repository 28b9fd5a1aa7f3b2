"""Hugging Face ``transformers`` as the reference implementation for engine tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from switchyard.service.modelspec import ModelSpec
from transformers import LlamaConfig, LlamaForCausalLM


def hf_model(spec: ModelSpec, seed: int = 0, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """A randomly initialised HF Llama with a trained-model-like weight scale."""
    torch.manual_seed(seed)
    config = LlamaConfig(**{k: v for k, v in spec.to_config().items() if k not in ("architectures", "torch_dtype")})
    model = LlamaForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05)
    return model


def save_hf(model: LlamaForCausalLM, folder: Path) -> Path:
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def hf_logits(model: LlamaForCausalLM, tokens: list[int]) -> np.ndarray:
    """Logits [len(tokens), vocab] in float64."""
    with torch.no_grad():
        out = model(torch.tensor([tokens]), use_cache=False).logits[0]
    return out.double().numpy()


def hf_greedy(model: LlamaForCausalLM, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
    return out[0, len(prompt):].tolist()
