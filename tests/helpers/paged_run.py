"""The one place family and parity tests drive the serving engine (the token-budget engine over a
paged KV pool): the engine's API changes here and nowhere else in them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from switchyard.service.engine.sampling import SamplingParams

from helpers.engine_fixtures import tiny_paged_engine


def paged_greedy_and_logits(folder: Path, tp: int, prompt: list[int], n: int,
                            dtype: str | None = None) -> tuple[list[int], np.ndarray]:
    """``n`` greedy tokens after ``prompt`` from the checkpoint in ``folder`` at tensor-parallel size
    ``tp``, and the logits [n, vocab] (float64) each was chosen from. The prompt goes in chunks of 4
    tokens over blocks of 4 positions, so chunks cross blocks and attend to earlier ones."""
    engine = tiny_paged_engine(folder, tp=tp, slots=2, max_seq_len=64, step_tokens=4, block_size=4, dtype=dtype)
    assert engine.begin(0, prompt, SamplingParams()) == 0
    while True:
        chunk = engine.next_chunk(0)
        result = engine.collect(engine.dispatch(chunk, return_logits=True))
        if chunk.completes:
            break
    tokens, logits = [result.chunk_token], [np.asarray(result.logits[-1], np.float64)]
    for _ in range(n - 1):
        assert engine.ensure_decode_blocks()
        step = engine.collect(engine.dispatch(return_logits=True))
        tokens.append(int(step.tokens[0]))
        logits.append(np.asarray(step.logits[0], np.float64))
    return tokens, np.stack(logits)[:, : engine.spec.vocab_size]
