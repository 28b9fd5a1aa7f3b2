"""Hugging Face ``transformers`` as the reference implementation for engine tests, for every family."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from switchyard.kernels.fp8 import FP8_MAX, INV_FP8_MAX, MIN_SCALE
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


def _fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to e4m3 with a float32 scale per slice of its last dimension, and back (the
    engine's ``kernels.fp8.quantize_rows`` then ``dequantize``)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) * float(INV_FP8_MAX)).clamp_min(MIN_SCALE)
    q = (xf * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


@contextlib.contextmanager
def fp8_rounding(model: PreTrainedModel, activations: bool = False, kv_cache: bool = False) -> Iterator[None]:
    """Run ``model`` with the engine's FP8 roundings applied to its float values: with ``activations``
    every layer matrix's input per token (the FP8 x FP8 products; the LM head stays as it is), with
    ``kv_cache`` the keys (after RoPE) and values per position and KV head (an FP8 KV pool).
    A reference for FP8 paths whose differences from the 16-bit model are their roundings."""
    hooks = []
    patched: list[tuple[Any, Any]] = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if activations:
            for linear in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
                           mlp.down_proj):
                hooks.append(linear.register_forward_pre_hook(lambda _, args: (_fp8_round_trip(args[0]),)))
        if kv_cache:
            head_dim = attn.head_dim

            def round_heads(_, __, out, head_dim=head_dim):
                shape = out.shape
                return _fp8_round_trip(out.reshape(*shape[:-1], -1, head_dim)).reshape(shape)

            hooks.append(attn.v_proj.register_forward_hook(round_heads))
            module = sys.modules[type(attn).__module__]
            if not any(m is module for m, _ in patched):
                rope = module.apply_rotary_pos_emb
                patched.append((module, rope))

                def rounded_rope(q, k, *args, rope=rope, **kwargs):
                    q, k = rope(q, k, *args, **kwargs)
                    return q, _fp8_round_trip(k)  # [batch, kv heads, positions, head_dim]

                module.apply_rotary_pos_emb = rounded_rope
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()
        for module, rope in patched:
            module.apply_rotary_pos_emb = rope
