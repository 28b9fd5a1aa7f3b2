"""The PyTorch peer of the decode benchmark: a gpt-fast-style Llama decoder under ``torch.compile``.

``benchmarks/decode.py`` publishes the engine's figures beside this peer's, measured in the same run on
the same GPU. The peer is written the way gpt-fast writes it: a static KV cache ``[batch, kv_heads,
max_seq, head_dim]`` per layer updated with ``index_copy_``, fused QKV (``wqkv``) and gate/up (``w13``)
weights, attention through ``F.scaled_dot_product_attention`` with a mask over the whole cache, and a
one-token decode step (greedy argmax, the token fed back) compiled with
``torch.compile(mode="reduce-overhead", fullgraph=True)``, so each step replays one CUDA graph.
Rope uses Hugging Face's rotate-half convention, so weights map 1:1 to ``LlamaForCausalLM``
(``check_against_reference``).

Times are per token of the serving loop the engine is timed with: launch step n+1, then bring step
n's tokens to the host (a server streams every token), with ``time.perf_counter``.

    python benchmarks/torch_peer.py --model llama3-8b --batch 1 8 32 --context 1024 \
        --steps 64 --warmup 8 --out /tmp/torch-peer.json
"""

from __future__ import annotations

import os

# Set before torch (and NCCL) load: NVLink multicast stays off on these machines.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import argparse
import contextlib
import gc
import itertools
import math
import platform
import runpy
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from switchyard.service.modelspec import ModelSpec, preset
from torch import nn
from torch._dynamo import mark_static_address
from torch._inductor import config as inductor_config
from torch.nn.attention import SDPBackend, sdpa_kernel

# benchmarks/result_file.py (provenance and writing), by its path: PYTHONSAFEPATH=1 keeps benchmarks/ off sys.path.
result_file = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("result_file.py"))))

CACHE_ALIGN = 128  # cache length rounded up to this, as the engine rounds its own
WEIGHT_STD = 0.02
NORM_STD = 0.1
REFERENCE_TOLERANCE = 1e-4
RESULT_KEYS = ("impl", "batch", "context", "ms_per_token", "p10_ms", "p90_ms", "tokens_per_s", "torch_version",
               "device_name", "sdpa")
# SDPA backends a decode step can use with a mask (flash attention takes none).
SDPA_BACKENDS = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "cudnn": SDPBackend.CUDNN_ATTENTION}


# ---- rotary embedding ------------------------------------------------------------------------------
def inverse_frequencies(spec: ModelSpec) -> torch.Tensor:
    """Rope inverse frequencies [head_dim / 2] in float32, with Llama-3 or linear scaling as the spec says
    (the same arithmetic as ``transformers``' rope initialisers)."""
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = spec.rope_scaling
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type != "llama3":
        return inv_freq
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(spec: ModelSpec, max_seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_seq, head_dim] in float32, each frequency twice (rotate-half layout)."""
    inv_freq = inverse_frequencies(spec).to(device)
    freqs = torch.outer(torch.arange(max_seq, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope on x [batch, 1, heads, head_dim] in float32; cos, sin [1, head_dim]."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos + rotated * sin).type_as(x)


# ---- the model -------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.type_as(x)


class KVCache(nn.Module):
    def __init__(self, batch: int, kv_heads: int, max_seq: int, head_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        shape = (batch, kv_heads, max_seq, head_dim)
        self.register_buffer("k_cache", torch.empty(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.empty(shape, dtype=dtype), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [batch, kv_heads, 1, head_dim] at ``input_pos``; the whole cache back."""
        self.k_cache.index_copy_(2, input_pos, k)
        self.v_cache.index_copy_(2, input_pos, v)
        return self.k_cache, self.v_cache


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, batch: int, max_seq: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.wqkv = nn.Linear(spec.hidden_size, spec.q_size + 2 * spec.kv_size, bias=False, dtype=dtype)
        self.wo = nn.Linear(spec.q_size, spec.hidden_size, bias=False, dtype=dtype)
        self.kv_cache = KVCache(batch, spec.num_kv_heads, max_seq, spec.head_dim, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                input_pos: torch.Tensor) -> torch.Tensor:
        batch = x.shape[0]
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rope(q.view(batch, 1, self.heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(batch, 1, self.kv_heads, self.head_dim), cos, sin)
        v = v.view(batch, 1, self.kv_heads, self.head_dim)
        keys, values = self.kv_cache.update(input_pos, k.transpose(1, 2), v.transpose(1, 2))
        # One query token: the query heads that share a KV head become that head's query rows (query head h
        # reads KV head h // group, as in HF's repeat_kv), so the cache is read once, never repeated.
        group = self.heads // self.kv_heads
        q = q.view(batch, self.kv_heads, group, self.head_dim)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.wo(y.reshape(batch, 1, q_size))


class FeedForward(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype) -> None:
        super().__init__()
        self.w13 = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False, dtype=dtype)
        self.w2 = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, spec: ModelSpec, batch: int, max_seq: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.attention = Attention(spec, batch, max_seq, dtype)
        self.ffn_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.feed_forward = FeedForward(spec, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                input_pos: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Llama decoder with a static KV cache of ``max_seq`` positions for ``batch`` sequences."""

    def __init__(self, spec: ModelSpec, batch: int, max_seq: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.spec, self.batch, self.max_seq = spec, batch, max_seq
        self.tok_embeddings = nn.Embedding(spec.vocab_size, spec.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(TransformerBlock(spec, batch, max_seq, dtype) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.output = None if spec.tie_word_embeddings else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False,
                                                                      dtype=dtype)
        self.register_buffer("rope_cos", torch.empty(max_seq, spec.head_dim), persistent=False)
        self.register_buffer("rope_sin", torch.empty(max_seq, spec.head_dim), persistent=False)
        self.register_buffer("cache_positions", torch.empty(max_seq, dtype=torch.int64), persistent=False)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """Logits [batch, 1, vocab] of tokens [batch, 1] at position ``input_pos`` [1]; writes their K/V."""
        x = self.tok_embeddings(tokens)
        cos, sin = self.rope_cos[input_pos], self.rope_sin[input_pos]
        mask = (self.cache_positions <= input_pos).view(1, 1, 1, self.max_seq)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, input_pos)
        x = self.norm(x)
        return F.linear(x, self.tok_embeddings.weight) if self.output is None else self.output(x)

    def kv_caches(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in (layer.attention.kv_cache.k_cache,
                                                      layer.attention.kv_cache.v_cache)]


def build(spec: ModelSpec, batch: int, max_seq: int, device: str | torch.device = "cuda",
          dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Transformer:
    """A peer with random weights scaled like a trained model (normal * 0.02; norms 1 + 0.1 * normal) and a
    KV cache of random values. Built on the meta device and then allocated once on ``device``: the weights
    are drawn there, so no second copy (and none on the host) ever exists."""
    device = torch.device(device)
    with torch.device("meta"):
        model = Transformer(spec, batch, max_seq, dtype)
    model = model.to_empty(device=device).eval().requires_grad_(False)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.weight.normal_(1.0, NORM_STD, generator=generator)
            elif isinstance(module, nn.Linear | nn.Embedding):
                module.weight.normal_(0.0, WEIGHT_STD, generator=generator)
        for cache in model.kv_caches():
            cache.normal_(0.0, 1.0, generator=generator)
        cos, sin = rope_tables(spec, max_seq, device)
        model.rope_cos.copy_(cos)
        model.rope_sin.copy_(sin)
        model.cache_positions.copy_(torch.arange(max_seq, device=device))
    return model


def decode_one_token(model: Transformer, tokens: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
    """One greedy decode step: the next tokens [batch, 1]."""
    logits = model(tokens, input_pos)
    return torch.argmax(logits[:, -1], dim=-1, keepdim=True)


def prefill_last_logits(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """A whole prompt tokens [1, T] in one pass, eager: cuBLAS products and SDPA's causal attention
    (flash where it runs), through the model's own weights; the last position's logits [1, vocab].
    (The decoder's KV cache is not written: this times prefill alone.)"""
    T = tokens.shape[1]
    x = model.tok_embeddings(tokens)
    cos, sin = model.rope_cos[:T, None], model.rope_sin[:T, None]  # [T, 1, head_dim]: per position, all heads
    for layer in model.layers:
        attn = layer.attention
        q_size, kv_size = attn.heads * attn.head_dim, attn.kv_heads * attn.head_dim
        q, k, v = attn.wqkv(layer.attention_norm(x)).split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rope(q.view(1, T, attn.heads, attn.head_dim), cos, sin).transpose(1, 2)
        k = apply_rope(k.view(1, T, attn.kv_heads, attn.head_dim), cos, sin).transpose(1, 2)
        v = v.view(1, T, attn.kv_heads, attn.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = x + attn.wo(y.transpose(1, 2).reshape(1, T, q_size))
        x = h + layer.feed_forward(layer.ffn_norm(h))
    last = model.norm(x[:, -1:])
    return F.linear(last, model.tok_embeddings.weight) if model.output is None else model.output(last)


# ---- Hugging Face parity -----------------------------------------------------------------------------
class ReferenceMismatch(AssertionError):
    """The peer's logits differ from Hugging Face's on the same weights."""


def hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The peer's weights under ``LlamaForCausalLM``'s names (fused weights split back)."""
    spec = model.spec
    state = {"model.embed_tokens.weight": model.tok_embeddings.weight, "model.norm.weight": model.norm.weight,
             "lm_head.weight": model.tok_embeddings.weight if model.output is None else model.output.weight}
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        q, k, v = layer.attention.wqkv.weight.split([spec.q_size, spec.kv_size, spec.kv_size], dim=0)
        gate, up = layer.feed_forward.w13.weight.chunk(2, dim=0)
        state |= {
            prefix + "input_layernorm.weight": layer.attention_norm.weight,
            prefix + "self_attn.q_proj.weight": q,
            prefix + "self_attn.k_proj.weight": k,
            prefix + "self_attn.v_proj.weight": v,
            prefix + "self_attn.o_proj.weight": layer.attention.wo.weight,
            prefix + "post_attention_layernorm.weight": layer.ffn_norm.weight,
            prefix + "mlp.gate_proj.weight": gate,
            prefix + "mlp.up_proj.weight": up,
            prefix + "mlp.down_proj.weight": layer.feed_forward.w2.weight,
        }
    return state


def hf_reference(model: Transformer):
    """A float32 CPU ``LlamaForCausalLM`` holding a copy of the peer's weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = {k: v for k, v in model.spec.to_config().items() if k not in ("architectures", "torch_dtype")}
    config = LlamaConfig(**fields)
    reference = LlamaForCausalLM(config).float().eval()
    reference.load_state_dict({k: v.detach().float().cpu() for k, v in hf_state_dict(model).items()}, strict=True)
    return reference


def peer_logits(model: Transformer, tokens: Sequence[int]) -> torch.Tensor:
    """Logits [len(tokens), vocab] of a prompt fed one token per step from position 0 (batch row 0)."""
    rows = []
    with torch.no_grad():
        for pos, token in enumerate(tokens):
            batch_tokens = torch.full((model.batch, 1), token, dtype=torch.int64, device=model.rope_cos.device)
            rows.append(model(batch_tokens, torch.tensor([pos], device=model.rope_cos.device))[0, -1])
    return torch.stack(rows)


def check_against_reference(spec: ModelSpec, tokens: Sequence[int] = (1, 17, 300, 5, 42, 511, 7, 128, 64, 3),
                            seed: int = 0, model: Transformer | None = None, reference=None,
                            tolerance: float = REFERENCE_TOLERANCE) -> float:
    """Max relative error (max |peer - HF| / max |HF|) of the peer's logits for ``tokens`` fed one at a time
    against Hugging Face ``LlamaForCausalLM``'s on the same weights, float32 on CPU; raises
    :class:`ReferenceMismatch` at or above ``tolerance``. ``model`` and ``reference`` default to a fresh peer
    and its HF copy."""
    if model is None:
        model = build(spec, 1, len(tokens), device="cpu", dtype=torch.float32, seed=seed)
    if reference is None:
        reference = hf_reference(model)
    ours = peer_logits(model, tokens).double().cpu()
    with torch.no_grad():
        theirs = reference(torch.tensor([list(tokens)]), use_cache=False).logits[0].double()
    error = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    if not error < tolerance:
        raise ReferenceMismatch(f"peer logits differ from transformers': relative error {error:.3g} >= {tolerance}")
    return error


# ---- timing ----------------------------------------------------------------------------------------
class _HostTokens:
    """Brings a step's tokens to the host: on CUDA an asynchronous copy into pinned memory whose event is
    waited for at collection, so a step can be launched before the previous one's tokens are read."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.event = None
        if tokens.is_cuda:
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tokens.clone()

    def collect(self) -> list[list[int]]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


def time_serving_loop(launch: Callable[[], _HostTokens], steps: int, warmup: int) -> list[float]:
    """Per-token times of the serving loop: launch step n+1, then bring step n's tokens to the host (as the
    engine's scheduler does), so host work overlaps the device's."""
    pending = launch()
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        nxt = launch()
        pending.collect()
        pending = nxt
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    pending.collect()
    return times


def cache_length(context: int, steps: int, warmup: int) -> int:
    """Positions the cache needs for ``context`` plus every launched step, rounded up to CACHE_ALIGN."""
    needed = context + warmup + steps + 1
    return -(-needed // CACHE_ALIGN) * CACHE_ALIGN


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or device.type


def _release(device: torch.device, compiled: bool) -> None:
    """Drop compiled graphs (and their CUDA graph memory pool), then whatever referenced the model, and
    return cached memory to the device."""
    if compiled:
        torch.compiler.reset()
        if device.type == "cuda":
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees

            reset_cudagraph_trees()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


@contextlib.contextmanager
def half_precision_math_sdpa():
    """Math SDPA in the inputs' precision. By default it converts bf16 q, k, v to float32 first: under
    Inductor that is a float32 copy of every layer's whole K and V cache each step, an extra that
    gpt-fast's recipe (math SDPA for Inductor to fuse) did not have when it was written."""
    saved = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        yield
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(saved)


def time_peer(model: Transformer, context: int, steps: int, warmup: int, compile: bool,
              sdpa: str = "math") -> list[float]:
    """Serving-loop times of ``model``'s decode step from position ``context`` (its cache already filled)."""
    spec, dev = model.spec, model.rope_cos.device
    step: Callable[..., torch.Tensor] = decode_one_token
    if compile:
        # Parameters and caches keep their addresses, so CUDA graphs replay on them in place rather than
        # copying them into graph-owned inputs (a second copy of the weights and caches).
        for tensor in (*model.parameters(), *model.kv_caches(), model.rope_cos, model.rope_sin,
                       model.cache_positions):
            mark_static_address(tensor, guard=False)
        step = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)
    generator = torch.Generator(device=dev).manual_seed(1)
    current = torch.randint(0, spec.vocab_size, (model.batch, 1), device=dev, generator=generator)
    input_pos = torch.tensor([context], device=dev)

    def launch() -> _HostTokens:
        nonlocal current
        if compile and dev.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        # The clone leaves the CUDA graph's output buffer free for the next replay (as gpt-fast does).
        current = step(model, current, input_pos).clone()
        input_pos.add_(1)
        return _HostTokens(current)

    # gpt-fast's decode settings: coordinate-descent tuning of the generated kernels, and math SDPA (which
    # Inductor fuses) for the one query token. The compile caches stay off: their keys leave out the SDPA
    # settings, so a cached graph could carry another backend's attention.
    tuning = (inductor_config.patch(coordinate_descent_tuning=True, force_disable_caches=True) if compile
              else contextlib.nullcontext())
    with torch.no_grad(), tuning, sdpa_kernel(SDPA_BACKENDS[sdpa]), half_precision_math_sdpa():
        return time_serving_loop(launch, steps, warmup)


def measure(spec: ModelSpec, batch: int, context: int, steps: int, warmup: int, device: str = "cuda",
            compile: bool = True, sdpa: str = "math") -> dict:
    """ms per token of the peer's serving loop for ``batch`` sequences at ``context`` positions (random
    bf16 weights, a random-filled cache). ``compile``: the step under ``torch.compile(mode="reduce-overhead",
    fullgraph=True)``, CUDA graphs on CUDA (warm-up at least 3 steps, so the graph is recorded before
    timing); otherwise eager (impl ``torch-eager``). ``sdpa``: the attention backend (a key of SDPA_BACKENDS;
    gpt-fast's math by default). The model and compiled graphs are freed before return, so the device's memory
    is free for whatever runs next in the process."""
    if sdpa not in SDPA_BACKENDS:
        raise ValueError(f"sdpa must be one of {', '.join(SDPA_BACKENDS)}, got {sdpa!r}")
    dev = torch.device(device)
    if compile:
        warmup = max(warmup, 3)
    model = build(spec, batch, cache_length(context, steps, warmup), dev, torch.bfloat16)
    try:
        times = time_peer(model, context, steps, warmup, compile, sdpa)
    finally:
        del model
        _release(dev, compile)
    ms = 1000 * statistics.median(times)
    ordered = sorted(times)
    return {
        "impl": "torch-compile" if compile else "torch-eager",
        "batch": batch,
        "context": context,
        "ms_per_token": round(ms, 4),
        "p10_ms": round(1000 * ordered[int(0.1 * len(ordered))], 4),
        "p90_ms": round(1000 * ordered[min(int(0.9 * len(ordered)), len(ordered) - 1)], 4),
        "tokens_per_s": round(batch * 1000 / ms, 1),
        "torch_version": torch.__version__,
        "device_name": device_name(dev),
        "sdpa": sdpa,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[1024])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-compile", action="store_true", help="time the eager step instead")
    parser.add_argument("--sdpa", nargs="+", default=["math"], choices=list(SDPA_BACKENDS),
                        help="attention backends to compare (gpt-fast uses math)")
    parser.add_argument("--out", help="result JSON path")
    args = parser.parse_args(argv)

    spec = preset(args.model)
    rows = []
    for sdpa, context, batch in itertools.product(args.sdpa, args.context, args.batch):
        t0 = time.perf_counter()
        row = {"model": args.model, **measure(spec, batch, context, args.steps, args.warmup, args.device,
                                              compile=not args.no_compile, sdpa=sdpa)}
        rows.append(row)
        print(f"{row['impl']} sdpa {sdpa:9s} batch={batch:3d} ctx={context:5d} {row['ms_per_token']:8.3f} ms/token "
              f"(p10 {row['p10_ms']:.3f}, p90 {row['p90_ms']:.3f}) {row['tokens_per_s']:9.1f} tokens/s "
              f"[{time.perf_counter() - t0:.0f}s]", flush=True)
    result = {
        **result_file.provenance(f"1x {device_name(torch.device(args.device))}", argv, script=__file__),
        "host": platform.node(),
        "rows": rows,
    }
    if args.out:
        result_file.write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
