"""Checkpoint files: what make-checkpoint writes is a Hugging Face checkpoint, and loading shards it."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import safetensors.torch
import torch
from helpers.engine_fixtures import greedy_and_logits, tiny_engine
from helpers.hf_reference import hf_logits
from switchyard.cli.main import main as cli
from switchyard.service.engine import checkpoint
from switchyard.service.engine.checkpoint import INDEX_FILE, NP_DTYPES, CheckpointError, write_checkpoint
from switchyard.service.engine.tensor_source import RAW_DTYPES, TensorSource
from switchyard.service.engine.tokenizer import Tokenizer, build_tokenizer
from switchyard.service.modelspec import ModelSpec, preset
from transformers import LlamaForCausalLM

PROMPT = [1, 10, 20, 30, 40]


def test_make_checkpoint_writes_what_transformers_loads(tmp_path, capsys):
    assert cli(["make-checkpoint", "--preset", "tiny", "--out", str(tmp_path / "ckpt"), "--seed", "3"]) == 0
    assert "wrote tiny-llama" in capsys.readouterr().out
    folder = tmp_path / "ckpt"
    assert {p.name for p in folder.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    hf = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    engine = tiny_engine(folder, tp=2, slots=1, max_seq_len=32)
    ours = greedy_and_logits(engine, PROMPT, 1)[1][0]
    theirs = hf_logits(hf, PROMPT)[-1]
    assert np.abs(ours - theirs).max() / np.abs(theirs).max() < 2e-5


def test_sharded_checkpoint_with_index_loads_identically(tmp_path):
    spec = preset("tiny")
    single = write_checkpoint(spec, tmp_path / "single", seed=5, progress=False)
    sharded = write_checkpoint(spec, tmp_path / "sharded", seed=5, shard_bytes=200_000, progress=False)
    index = json.loads((sharded / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all((sharded / f).exists() for f in files)
    assert files[0].endswith(f"-of-{len(files):05d}.safetensors")
    a = tiny_engine(single, tp=2, slots=1, max_seq_len=32)
    b = tiny_engine(sharded, tp=2, slots=1, max_seq_len=32)
    la, lb = (greedy_and_logits(e, PROMPT, 1)[1] for e in (a, b))
    np.testing.assert_array_equal(la, lb)


def test_each_device_holds_only_its_shard(tiny_checkpoint_dir):
    engine = tiny_engine(tiny_checkpoint_dir, tp=4, slots=1, max_seq_len=32)
    wqkv = engine.params["layers"][0]["wqkv"].w
    shards = wqkv.addressable_shards
    assert len(shards) == 4 and all(s.data.shape == (128, wqkv.shape[1] // 4) for s in shards)
    assert len({s.device for s in shards}) == 4


def test_missing_and_misshapen_tensors_are_named(tmp_path):
    spec = preset("tiny")
    folder = write_checkpoint(spec, tmp_path / "ckpt", progress=False)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] = 320
    (folder / "config.json").write_text(json.dumps(config))
    expected = r"mlp.gate_proj.weight has shape \(352, 128\), the config implies \(320, 128\)"
    with pytest.raises(CheckpointError, match=expected):
        tiny_engine(folder)
    untied = dataclasses.replace(spec, tie_word_embeddings=False)
    config = untied.to_config()
    (folder / "config.json").write_text(json.dumps(config))
    tensors = safetensors.torch.load_file(folder / "model.safetensors")
    del tensors["lm_head.weight"]
    safetensors.torch.save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"no lm_head\.weight and the config does not tie word embeddings"):
        tiny_engine(folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*.safetensors files"):
        tiny_engine(folder)


def test_tokenizer_covers_the_vocabulary_with_the_configured_special_ids():
    for name in ("tiny", "llama3-8b"):
        spec: ModelSpec = preset(name)
        tok = build_tokenizer(spec)
        assert tok.get_vocab_size() == spec.vocab_size
        assert tok.token_to_id("<|begin_of_text|>") == spec.bos_token_id
        assert tok.token_to_id("<|end_of_text|>") == spec.eos_token_ids[0]
        ids = tok.encode("Hello, world! Ünïcödé ✓ 日本").ids
        assert ids[0] == spec.bos_token_id and max(ids) < spec.vocab_size
        assert tok.decode(ids, skip_special_tokens=True) == "Hello, world! Ünïcödé ✓ 日本"


def test_incremental_decoding_never_splits_a_character(tiny_checkpoint_dir):
    tok = Tokenizer.from_dir(tiny_checkpoint_dir)
    text = "naïve café — 日本語 ✓ 🚀 done"
    ids = tok.encode(text)[1:]
    decoder = tok.incremental()
    pieces = [decoder.push(i) for i in ids]
    pieces.append(decoder.flush())
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_every_16_and_32_bit_tensor_reads_from_the_memory_map_as_safetensors_reads_it(tmp_path, rng):
    tensors = {
        "bf16": torch.from_numpy(rng.standard_normal((37, 53), np.float32)).to(torch.bfloat16),
        "f16": torch.from_numpy(rng.standard_normal((5, 7, 11), np.float32)).to(torch.float16),
        "f32": torch.from_numpy(rng.standard_normal((29,), np.float32)),
        "scalar": torch.tensor(0.75, dtype=torch.float32),
    }
    safetensors.torch.save_file(tensors, str(tmp_path / "model.safetensors"))
    src = TensorSource(tmp_path)
    for name, expected in tensors.items():
        want = expected.float().numpy()
        assert src.dtype(name) in RAW_DTYPES
        got = src.slice(name, tuple(expected.shape))
        assert got.dtype == NP_DTYPES[str(expected.dtype).removeprefix("torch.")]
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)
        if want.ndim:
            index = (slice(3, 5), *(slice(1, None, 2),) * (want.ndim - 1))
            np.testing.assert_array_equal(np.asarray(src.slice(name, tuple(expected.shape), index), np.float32),
                                          want[index])
    with pytest.raises(CheckpointError, match="bf16 has shape"):
        src.slice("bf16", (53, 37))


def test_random_tensors_are_the_seeds_whatever_the_threads_that_draw_them(monkeypatch):
    spec = preset("tiny")
    drawn = {}
    for cpus in (1, 3):
        monkeypatch.setattr(checkpoint, "usable_cpus", lambda cpus=cpus: cpus)
        drawn[cpus] = list(checkpoint.random_hf_tensors(spec, seed=9))
    assert [name for name, _ in drawn[1]] == [name for name, _ in drawn[3]]
    assert len(drawn[1]) == 3 + 9 * spec.num_layers  # embeddings, final norm, LM head; 9 a layer
    for (_, one), (_, three) in zip(drawn[1], drawn[3], strict=True):
        np.testing.assert_array_equal(one, three)
    other = dict(checkpoint.random_hf_tensors(spec, seed=10))
    assert not np.array_equal(other["model.embed_tokens.weight"], dict(drawn[1])["model.embed_tokens.weight"])
