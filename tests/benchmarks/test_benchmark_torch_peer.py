"""benchmarks/torch_peer.py on the CPU: the peer's logits equal Hugging Face ``LlamaForCausalLM``'s on the
same weights (and differ once any weight is perturbed), the model is built as the benchmark needs it,
and ``measure`` returns its documented row and lets the model go."""

from __future__ import annotations

import dataclasses
import gc
import json
import weakref

import pytest
import torch
from helpers import scripts
from switchyard.service.modelspec import RopeScaling, preset

peer = scripts.load("torch_peer")
TINY = preset("tiny")
VARIANTS = {
    "tiny": TINY,  # Llama-3 rope scaling, untied head
    "tied": dataclasses.replace(TINY, tie_word_embeddings=True),
    "default-rope": dataclasses.replace(TINY, rope_scaling=RopeScaling()),
    "linear-rope": dataclasses.replace(TINY, rope_scaling=RopeScaling("linear", 2.0)),
}


@pytest.mark.parametrize("name", VARIANTS)
def test_logits_equal_transformers_on_the_same_weights(name):
    assert peer.check_against_reference(VARIANTS[name]) < peer.REFERENCE_TOLERANCE


q, kv = TINY.q_size, TINY.kv_size
# One slice per mapped weight (each part of the fused ones): perturbing any of them must show.
PERTURBED = {
    "embedding": lambda m: m.tok_embeddings.weight[17],
    "q": lambda m: m.layers[0].attention.wqkv.weight[:q][5],
    "k": lambda m: m.layers[1].attention.wqkv.weight[q:q + kv][3],
    "v": lambda m: m.layers[2].attention.wqkv.weight[q + kv:][7],
    "o": lambda m: m.layers[3].attention.wo.weight[9],
    "gate": lambda m: m.layers[0].feed_forward.w13.weight[:TINY.intermediate_size][11],
    "up": lambda m: m.layers[1].feed_forward.w13.weight[TINY.intermediate_size:][11],
    "down": lambda m: m.layers[2].feed_forward.w2.weight[4],
    "attention_norm": lambda m: m.layers[3].attention_norm.weight,
    "ffn_norm": lambda m: m.layers[0].ffn_norm.weight,
    "final_norm": lambda m: m.norm.weight,
    "lm_head": lambda m: m.output.weight[300],
}


@pytest.mark.parametrize("name", PERTURBED)
def test_the_check_fails_when_a_weight_differs(name):
    model = peer.build(TINY, 1, 16, device="cpu", dtype=torch.float32)
    reference = peer.hf_reference(model)
    assert peer.check_against_reference(TINY, model=model, reference=reference) < peer.REFERENCE_TOLERANCE
    with torch.no_grad():
        PERTURBED[name](model).add_(0.05)
    with pytest.raises(peer.ReferenceMismatch):
        peer.check_against_reference(TINY, model=model, reference=reference)


def test_build_draws_trained_scale_weights_and_a_random_cache():
    model = peer.build(TINY, 2, 64, device="cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    wqkv = model.layers[0].attention.wqkv.weight.float()
    assert wqkv.shape == (q + 2 * kv, TINY.hidden_size)
    assert model.layers[0].feed_forward.w13.weight.shape == (2 * TINY.intermediate_size, TINY.hidden_size)
    assert abs(wqkv.std().item() - peer.WEIGHT_STD) < 0.002 and abs(wqkv.mean().item()) < 0.002
    norm = model.layers[0].attention_norm.weight.float()
    assert abs(norm.mean().item() - 1) < 0.05 and abs(norm.std().item() - peer.NORM_STD) < 0.03
    for cache in model.kv_caches():
        assert cache.shape == (2, TINY.num_kv_heads, 64, TINY.head_dim)
        assert (cache != 0).float().mean() > 0.99 and abs(cache.float().std().item() - 1) < 0.05
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def test_measure_returns_the_documented_row_and_frees_the_model(monkeypatch):
    built = []
    build = peer.build

    def tracked_build(*args, **kwargs):
        model = build(*args, **kwargs)
        built.append((weakref.ref(model), model.max_seq))
        return model

    monkeypatch.setattr(peer, "build", tracked_build)
    # 122 + 2 warm-up + 4 timed + the first launch write positions up to 129: past one 128-row cache block.
    row = peer.measure(TINY, batch=2, context=122, steps=4, warmup=2, device="cpu", compile=False)
    assert set(row) == set(peer.RESULT_KEYS)
    assert row["impl"] == "torch-eager" and (row["batch"], row["context"], row["sdpa"]) == (2, 122, "math")
    assert 0 < row["p10_ms"] <= row["ms_per_token"] <= row["p90_ms"]
    assert row["tokens_per_s"] == pytest.approx(2 * 1000 / row["ms_per_token"], rel=1e-3, abs=0.05)  # 1 decimal
    assert row["torch_version"] == torch.__version__ and row["device_name"]
    (model_ref, max_seq), = built
    assert max_seq == 256
    gc.collect()
    assert model_ref() is None


def test_measure_refuses_an_unknown_attention_backend():
    with pytest.raises(ValueError, match="sdpa must be one of math, efficient, cudnn"):
        peer.measure(TINY, batch=1, context=8, steps=1, warmup=0, device="cpu", compile=False, sdpa="flash")


def test_cache_holds_every_launched_position():
    assert peer.cache_length(121, steps=4, warmup=2) == 128  # positions 121..127
    assert peer.cache_length(122, steps=4, warmup=2) == 256


def test_main_prints_a_line_and_writes_a_row_per_config(tmp_path, capsys):
    out = tmp_path / "peer.json"
    assert peer.main(["--model", "tiny", "--batch", "1", "2", "--context", "8", "--steps", "2", "--warmup", "1",
                      "--device", "cpu", "--no-compile", "--out", str(out)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "ms/token" in ln]
    assert len(lines) == 2
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["batch"], r["context"], r["impl"]) for r in rows] == [
        ("tiny", 1, 8, "torch-eager"), ("tiny", 2, 8, "torch-eager")]


def test_prefill_gives_the_last_logits_of_decoding_the_prompt_token_by_token():
    torch.manual_seed(0)
    model = peer.build(TINY, batch=1, max_seq=40, device="cpu", dtype=torch.float32)
    tokens = torch.randint(3, TINY.vocab_size, (1, 37))
    with torch.no_grad():
        for pos in range(tokens.shape[1]):
            stepped = model(tokens[:, pos:pos + 1], torch.tensor([pos]))
        whole = peer.prefill_last_logits(model, tokens)
    assert torch.allclose(whole[:, -1], stepped[:, -1], atol=1e-4, rtol=1e-4)
