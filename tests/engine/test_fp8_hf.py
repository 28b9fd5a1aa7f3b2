"""The engine on FP8 weights and an FP8 KV cache against Hugging Face transformers.

An FP8 checkpoint's weight-only products (W8A16) are its dequantized matrices' products: in float32
the engine matches transformers running the float64 dequantization (rounded to float32) as closely as
it matches transformers on any float32 checkpoint (2e-5 of the largest logit, tests/engine/
test_engine_hf.py). FP8 x FP8 products round each token's activation too: the engine matches transformers
doing the same rounding before each linear layer. Quantizing at load
is the same weight-only product over the per-channel rounding defined in kernels/fp8.py, computed
here independently. The FP8 KV cache rounds every cached K and V the same way, which moves logits by
a few percent of their range at most (bounded below)."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from helpers.engine_fixtures import greedy_and_logits, tiny_engine
from helpers.fp8_published import load_into, write_published
from helpers.hf_reference import fp8_rounding, hf_greedy, hf_logits, hf_model, save_hf
from switchyard.kernels import kv_cache
from switchyard.kernels.weights import Fp8Weight
from switchyard.service.engine.engine import Engine, EngineConfig, pool_tokens
from switchyard.service.modelspec import ModelSpec, RopeScaling, ServingLayout, preset

AWKWARD = dataclasses.replace(preset("tiny"), name="awkward", vocab_size=300, hidden_size=160, intermediate_size=200,
                              num_layers=3, num_heads=5, num_kv_heads=1, head_dim=32, rope_scaling=RopeScaling())
ALIGNED = dataclasses.replace(AWKWARD, name="aligned", hidden_size=256, intermediate_size=512, num_heads=4,
                              num_kv_heads=2, head_dim=64, num_layers=2)
PROMPT = [1, 5, 17, 99, 3, 250, 7, 42, 120, 11, 8]
N_TOKENS = 9
FP32_BAR = 2e-5


def run_engine(folder, tp: int = 1, pp: int = 1, **config) -> tuple[list[int], np.ndarray]:
    """The prompt in chunks of 4 over blocks of 4 positions, then a token a step (test_engine_hf.py)."""
    engine = tiny_engine(folder, tp=tp, pp=pp, slots=2, max_seq_len=64, step_tokens=4, block_size=4, **config)
    return greedy_and_logits(engine, PROMPT, N_TOKENS)


def _rel(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


@pytest.mark.parametrize(("layout", "spec", "tp"), [("ct-channel", AWKWARD, 1), ("fp8-block", AWKWARD, 1),
                                                    ("fbgemm", AWKWARD, 1), ("ct-tensor", AWKWARD, 1),
                                                    ("fp8-block", ALIGNED, 2)])
def test_weight_only_fp8_logits_match_transformers_on_the_dequantized_weights(tmp_path, layout, spec, tp):
    model = hf_model(spec, seed=5)
    published = write_published(model, tmp_path / layout, layout)
    reference = load_into(hf_model(spec, seed=5), published.dequantized)
    tokens, logits = run_engine(tmp_path / layout, tp=tp, w8a8_min_rows=0)
    assert tokens == hf_greedy(reference, PROMPT, N_TOKENS)
    expected = hf_logits(reference, PROMPT + tokens[:-1])[len(PROMPT) - 1:]
    assert _rel(logits, expected) < FP32_BAR


def test_fp8_x_fp8_logits_match_transformers_with_activations_rounded_per_token(tmp_path):
    """Exactly the per-token rounding of each product's input on top of the dequantized weights: the
    engine agrees with transformers doing that rounding to 1e-3 of the largest logit (an activation a
    float32 ulp from a rounding boundary may round the other way in one implementation, moving one
    element by one e4m3 step). Against the weights' dequantization alone (no activation rounding) the
    cosine per position is at least 0.998 on this random model: each product's input carries ~2.6%
    RMS rounding noise (3 mantissa bits), which a random network does not attenuate; a trained
    model's logits, far from uniform, are measured on the GPU (benchmarks/fp8.py)."""
    model = hf_model(AWKWARD, seed=6)
    published = write_published(model, tmp_path / "ct", "ct-channel")
    weights_only = load_into(hf_model(AWKWARD, seed=6), published.dequantized)
    # From one row on: every product of every step is FP8 x FP8.
    tokens, logits = run_engine(tmp_path / "ct", w8a8_min_rows=1)
    history = PROMPT + tokens[:-1]
    with fp8_rounding(weights_only, activations=True):
        rounded = hf_logits(weights_only, history)[len(PROMPT) - 1:]
    assert _rel(logits, rounded) < 1e-3
    expected = hf_logits(weights_only, history)[len(PROMPT) - 1:]
    cos = (logits * expected).sum(-1) / np.linalg.norm(logits, axis=-1) / np.linalg.norm(expected, axis=-1)
    assert cos.min() >= 0.998, cos
    assert _rel(logits, expected) > 100 * FP32_BAR  # the activations' rounding shows


def _per_channel_e4m3(w: np.ndarray) -> np.ndarray:
    """An [out, in] float32 matrix rounded as quantize-on-load defines it (kernels/fp8.py): a float32
    scale per output channel, its largest magnitude over 448, each value divided by it and rounded to
    e4m3; returned dequantized in float64."""
    w = w.astype(np.float32)
    scale = np.maximum(np.abs(w).max(axis=1, keepdims=True) / np.float32(448.0), np.float32(1e-12))
    q = np.clip(w / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return q.astype(np.float64) * scale.astype(np.float64)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    model = hf_model(preset("tiny"), seed=8)
    return model, save_hf(model, tmp_path_factory.mktemp("tiny-fp32"))


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 2)])  # one device; tensor-parallel pipeline stages
def test_a_16_bit_checkpoint_quantized_at_load_matches_transformers_on_its_rounding(tiny_hf, tp, pp):
    model, folder = tiny_hf
    state = {k: v.detach().double().numpy() for k, v in model.state_dict().items()}
    rounded = {k: _per_channel_e4m3(v) if k.endswith("_proj.weight") else v for k, v in state.items()}
    reference = load_into(hf_model(preset("tiny"), seed=8), rounded)
    engine = tiny_engine(folder, tp=tp, pp=pp, slots=2, max_seq_len=64, step_tokens=4, block_size=4,
                         quantization="fp8", w8a8_min_rows=0)
    assert all(isinstance(layer[m], Fp8Weight) for layer in engine.params["layers"]
               for m in ("wqkv", "wo", "wgu", "wdown"))
    assert engine.weights_label.startswith("fp8 e4m3 (quantized at load, per-channel weight scales, dynamic "
                                           "activation scales); weight-only products")
    tokens, logits = greedy_and_logits(engine, PROMPT, N_TOKENS)
    expected = hf_logits(reference, PROMPT + tokens[:-1])[len(PROMPT) - 1:]
    assert _rel(logits, expected) < FP32_BAR
    # The rounding is real: against the unrounded model the logits move.
    assert _rel(logits, hf_logits(model, PROMPT + tokens[:-1])[len(PROMPT) - 1:]) > 100 * FP32_BAR


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 2)])  # one device; tensor-parallel pipeline stages
def test_an_fp8_kv_cache_stays_close_to_transformers(tiny_hf, tp, pp):
    """Every cached K and V rounded to e4m3 with a scale per position and head (at most 2^-4 of each
    value, ~2.6% RMS): over an 11-token prompt and 9 tokens decoded the logits keep a cosine of 0.999
    per position with the exact model's and stay within 5% of their range, and do move (the pool is
    FP8, not silently dense)."""
    model, folder = tiny_hf
    engine = tiny_engine(folder, tp=tp, pp=pp, slots=2, max_seq_len=64, step_tokens=4, block_size=4,
                         kv_cache_dtype="fp8")
    assert all(isinstance(p, kv_cache.Fp8Pool) for p in engine._state["k"] + engine._state["v"])
    assert engine.kv_cache_label == "fp8 e4m3 (float32 scale per position and KV head)"
    tokens, logits = greedy_and_logits(engine, PROMPT, N_TOKENS)
    expected = hf_logits(model, PROMPT + tokens[:-1])[len(PROMPT) - 1:]
    cos = (logits * expected).sum(-1) / np.linalg.norm(logits, axis=-1) / np.linalg.norm(expected, axis=-1)
    assert cos.min() >= 0.999, cos
    assert FP32_BAR < _rel(logits, expected) < 0.05
    # Exactly those roundings: transformers rounding its keys (after RoPE) and values the same way. An
    # element a float32 ulp from a rounding boundary may round the other way in one implementation.
    with fp8_rounding(model, kv_cache=True):
        rounded = hf_logits(model, PROMPT + tokens[:-1])[len(PROMPT) - 1:]
    assert _rel(logits, rounded) < 1e-4


def test_an_fp8_kv_cache_holds_1_9_times_the_tokens_in_the_same_memory():
    spec = preset("llama3-8b")
    free = 20 * 2**30
    dense = pool_tokens(spec, EngineConfig(kv_cache_dtype="auto"), 1, 1, "bfloat16", free)
    fp8 = pool_tokens(spec, EngineConfig(kv_cache_dtype="fp8"), 1, 1, "bfloat16", free)
    assert fp8 >= 1.9 * dense
    assert spec.kv_bytes_per_token_per_gpu(1, 1, "fp8") == 2 * 32 * 8 * (128 + 4)


def test_random_fp8_weights_for_benchmarks_serve_over_pipeline_stages():
    spec: ModelSpec = preset("tiny")
    layout = ServingLayout(tp=2, pp=2, batch_slots=2, max_seq_len=32)
    config = EngineConfig(batch_slots=2, max_seq_len=32, dtype="bfloat16", quantization="fp8", kv_cache_dtype="fp8",
                          step_tokens=8, block_size=8)
    engine = Engine.from_random(spec, layout, config)
    down = engine.params["layers"][0]["wdown"]
    assert isinstance(down, Fp8Weight) and down.w.shape == (2, spec.hidden_size, spec.intermediate_size)
    tokens, logits = greedy_and_logits(engine, [1, 2, 3, 4, 5], 3)
    assert len(tokens) == 3 and np.isfinite(logits).all()
