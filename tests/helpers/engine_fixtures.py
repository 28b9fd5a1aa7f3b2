"""Tiny checkpoints and engines for tests, and two ways to drive an engine without a server: the real
scheduler (greedy tokens of several prompts at once) and one sequence step by step with its logits."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from switchyard.service.engine.checkpoint import write_checkpoint
from switchyard.service.engine.engine import Engine, EngineConfig
from switchyard.service.engine.kv_manager import KVManager
from switchyard.service.engine.request import GenerationRequest
from switchyard.service.engine.sampling import SamplingParams
from switchyard.service.engine.scheduler import Scheduler
from switchyard.service.modelspec import IDLE_STEP_TOKENS, ServingLayout, preset


def tiny_checkpoint(folder: Path) -> Path:
    return write_checkpoint(preset("tiny"), folder, seed=0, progress=False)


def tiny_engine(folder: Path, tp: int = 1, slots: int = 4, max_seq_len: int = 128, *, pp: int = 1,
                kv_tokens: int = 0, step_tokens: int = 16, block_size: int = 16, dtype: str | None = None,
                idle_step_tokens: int = IDLE_STEP_TOKENS, **config: Any) -> Engine:
    """The engine on a checkpoint, with small blocks and chunks by default so that tests cross block
    and chunk boundaries with short prompts."""
    layout = ServingLayout(tp=tp, pp=pp, batch_slots=slots, max_seq_len=max_seq_len)
    cfg = EngineConfig(batch_slots=slots, max_seq_len=max_seq_len, kv_tokens=kv_tokens, step_tokens=step_tokens,
                       block_size=block_size, dtype=dtype, idle_step_tokens=idle_step_tokens, **config)
    return Engine.from_checkpoint(folder, layout, cfg, progress=False)


def generate(engine: Any, prompts: Sequence[Sequence[int]], max_tokens: int, *,
             sampling: SamplingParams | None = None, timeout: float = 300) -> list[list[int]]:
    """Each prompt's tokens (end-of-sequence ignored), all submitted at once to a scheduler over
    ``engine`` and run to the end."""
    scheduler = Scheduler(engine)
    out: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    done = threading.Event()

    def on_event(event: Any) -> None:
        if event.token_id is not None:
            out.setdefault(event.request_id, []).append(event.token_id)
        if event.finish_reason is not None:
            finished[event.request_id] = event.finish_reason
            if len(finished) == len(prompts):
                done.set()

    for i, prompt in enumerate(prompts):
        scheduler.submit(GenerationRequest(f"p{i}", list(prompt), max_tokens, sampling or SamplingParams(),
                                           on_event=on_event, ignore_eos=True))
    stop = threading.Event()
    thread = threading.Thread(target=scheduler.run, args=(stop,), daemon=True)
    thread.start()
    try:
        assert done.wait(timeout), f"finished {finished} of {len(prompts)}"
    finally:
        stop.set()
        thread.join(60)
    assert set(finished.values()) == {"length"}, finished
    assert scheduler.kv.held_blocks() == 0
    return [out.get(f"p{i}", []) for i in range(len(prompts))]


def greedy_and_logits(engine: Engine, prompt: Sequence[int], n: int) -> tuple[list[int], np.ndarray]:
    """One sequence's first ``n`` greedy tokens and the logits each was taken from [n, vocab], float64:
    its prompt in the engine's chunks, then one token per step, each step's logits from the engine's
    logits program before the step is launched."""
    kv = KVManager(max_slots=engine.max_slots, max_seq_len=engine.max_seq_len, kv_tokens=engine.kv_tokens,
                   block_size=engine.kv_block_size)
    assert kv.begin(0, list(prompt), SamplingParams(), reuse_prefix=False) == 0
    tokens: list[int] = []
    logits: list[np.ndarray] = []
    while len(tokens) < n:
        assert kv.ensure_decode_blocks()
        seq = kv.sequence(0)
        plan = engine.policy.plan(kv, [0] if seq.left else [])
        # Only steps that make a token have logits to compare: a chunk that does not end its prompt
        # gets no logits program compiled.
        makes_token = not plan.chunks or plan.chunks[0].completes
        step_logits = engine.logits(plan) if makes_token else None
        result = engine.collect(engine.launch(plan))
        kv.launched(plan)
        if plan.chunks and plan.chunks[0].completes:
            tokens.append(int(result.chunk_tokens[0]))
            logits.append(step_logits[-1])
        elif not plan.chunks:
            tokens.append(int(result.tokens[0]))
            logits.append(step_logits[0])
    return tokens, np.asarray(logits, np.float64)


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


def assert_decode_alike(engines: list[Engine], prompt: Sequence[int], steps: int) -> None:
    """Two engines on the same bf16 weights, the same prompt: logits agree within 5% of their range
    step after step, until a near-tie picks different tokens (from then on the inputs differ); at
    least 3 steps must be compared."""
    (ta, la), (tb, lb) = (greedy_and_logits(e, prompt, steps) for e in engines)
    compared = 0
    for step in range(steps):
        a, b = la[step], lb[step]
        assert np.abs(a - b).max() <= 0.05 * np.abs(b).max(), np.abs(a - b).max()
        compared += 1
        if ta[step] != tb[step]:
            break  # a near-tie decided differently in bf16: the inputs differ from here on
    assert compared >= 3
