"""Shared tiny checkpoint and engines (compiling is the slow part of CPU tests, so engines are reused).

Engines that are not the product (XLA attention, another k_splits, a random cache, a prefill chunk)
come from one place, ``benchmarks/variants.py``: load it with ``helpers.scripts.load("variants")``.
"""

from __future__ import annotations

from pathlib import Path

from switchyard.service.engine.checkpoint import load_params, write_checkpoint
from switchyard.service.engine.paged import PagedEngine
from switchyard.service.engine.tensor_parallel import Engine, make_mesh
from switchyard.service.modelspec import IDLE_STEP_TOKENS, ModelSpec, ServingLayout, preset


def tiny_checkpoint(folder: Path) -> Path:
    return write_checkpoint(preset("tiny"), folder, seed=0, progress=False)


def tiny_engine(folder: Path, tp: int = 1, slots: int = 4, max_seq_len: int = 128) -> Engine:
    return Engine.from_checkpoint(folder, ServingLayout(tp=tp, batch_slots=slots, max_seq_len=max_seq_len),
                                  progress=False)


def tiny_paged_engine(folder: Path, tp: int = 1, slots: int = 4, max_seq_len: int = 128, *, kv_tokens: int = 0,
                      step_tokens: int = 16, block_size: int = 16, dtype: str | None = None,
                      idle_step_tokens: int = IDLE_STEP_TOKENS) -> PagedEngine:
    """The token-budget engine on the tiny checkpoint, with small blocks and chunks so that tests
    cross block and chunk boundaries with short prompts."""
    spec = ModelSpec.from_file(folder)
    mesh = make_mesh(tp)
    dtype = dtype or spec.dtype
    params = load_params(folder, spec, mesh, dtype, progress=False)
    return PagedEngine(spec, params, mesh, batch_slots=slots, max_seq_len=max_seq_len, kv_tokens=kv_tokens,
                       step_tokens=step_tokens, block_size=block_size, dtype=dtype, idle_step_tokens=idle_step_tokens)


def varied_checkpoint(folder: Path, tokenizer_from: Path, seed: int = 11) -> Path:
    """A tiny checkpoint with larger random weights (transformers' own init, rescaled) whose greedy
    outputs vary from token to token, with the tiny tokenizer."""
    from helpers.hf_reference import hf_model, save_hf

    save_hf(hf_model(preset("tiny"), seed=seed), folder)
    (folder / "tokenizer.json").write_bytes((tokenizer_from / "tokenizer.json").read_bytes())
    return folder


def kernel_sized_spec():
    """A bf16 model small enough for a GPU test and shaped for the CUDA kernels (head_dim 64, GQA 4:1)."""
    import dataclasses

    return dataclasses.replace(preset("tiny"), hidden_size=512, num_heads=8, num_kv_heads=2, head_dim=64,
                               intermediate_size=1024, dtype="bfloat16")


def assert_decode_alike(engines: list[Engine], prompts: list[list[int]], steps: int) -> None:
    """Two engines on the same bf16 weights, the same prompts in slots 0..: logits agree within 5% of
    their range step after step, until a near-tie picks different tokens (from then on the inputs
    differ); at least 3 steps must be compared."""
    import numpy as np

    for engine in engines:
        for slot, prompt in enumerate(prompts):
            engine.insert(engine.prefill(prompt), slot)
    rows = len(prompts)
    compared = 0
    for _ in range(steps):
        ra, rb = (e.generate(return_logits=True) for e in engines)
        a, b = (np.asarray(r.logits, np.float32)[:rows] for r in (ra, rb))
        assert np.abs(a - b).max() <= 0.05 * np.abs(b).max(), np.abs(a - b).max()
        compared += 1
        if not np.array_equal(ra.tokens[:rows], rb.tokens[:rows]):
            break  # a near-tie decided differently in bf16: the inputs differ from here on
    assert compared >= 3
