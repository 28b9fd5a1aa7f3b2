"""The token-budget engine on a GPU: prompt chunks through cuDNN's flash attention and decode
attention through the paged kernel give the slot engine's logits (whole-prompt prefill, contiguous
kernel) on the same bf16 weights. The chunk attention alone: tests/engine/test_chunk_attention.py."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.engine_fixtures import kernel_sized_spec
from switchyard.service.engine.paged import PagedEngine
from switchyard.service.engine.sampling import SamplingParams
from switchyard.service.engine.tensor_parallel import Engine, random_weights

pytestmark = pytest.mark.gpu


# 64: one chunk size. 256: prompts of a few tokens, and the 43 left after a 256-token chunk, run in
# the 64-token program, compiled as one command buffer with cuDNN's calls inside.
@pytest.mark.parametrize("step_tokens", [64, 256])
def test_paged_engine_logits_follow_the_slot_engine(step_tokens):
    spec = kernel_sized_spec()
    params, mesh = random_weights(spec, 1, "bfloat16", seed=3)
    slots = Engine(spec, params, mesh, batch_slots=4, max_seq_len=512, dtype="bfloat16")
    paged = PagedEngine(spec, params, mesh, batch_slots=4, max_seq_len=512, dtype="bfloat16", kv_tokens=4 * 512,
                        step_tokens=step_tokens)
    assert paged.chunk_sizes == ([64, 128] if step_tokens == 64 else [64, 256, 512])
    # One prompt at a time: a decoding sequence makes a token at every step of the paged engine,
    # chunk steps included, so two prompts in flight would not step alike in the two engines.
    for prompt in ([1, 5, 9, 200], [1, *range(3, 300)], [1, 77]):
        prefix = slots.prefill(prompt, return_logits=True)
        slots.insert(prefix, 0)
        expected = np.asarray(prefix.logits, np.float32)
        assert paged.begin(0, prompt, SamplingParams()) == 0
        while True:
            chunk = paged.next_chunk(0)
            result = paged.collect(paged.dispatch(chunk, return_logits=True))
            if chunk.completes:
                break
        got = np.asarray(result.logits[-1], np.float32)
        assert np.abs(got - expected).max() <= 0.05 * np.abs(expected).max(), f"{len(prompt)}-token prompt"
        if result.chunk_token == prefix.first_token:
            for _ in range(6):
                assert paged.ensure_decode_blocks()
                a = slots.generate(return_logits=True)
                b = paged.collect(paged.dispatch(return_logits=True))
                la, lb = (np.asarray(r.logits, np.float32)[0] for r in (a, b))
                assert np.abs(la - lb).max() <= 0.05 * np.abs(la).max(), f"{len(prompt)}-token prompt, decoding"
                if a.tokens[0] != b.tokens[0]:
                    break  # a near-tie decided differently in bf16: the inputs differ from here on
        slots.evict(0)
        paged.evict(0)
