"""The engine on a GPU: prompt chunks through cuDNN's flash attention and decode attention through the
paged kernel follow transformers' float32 logits on the same weights served in bf16, for prompts in one
chunk, in several, and in the short-chunk program; and our kernel's steps follow XLA's ops' steps.
The chunk attention alone: tests/engine/test_chunk_attention.py."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.engine_fixtures import assert_decode_alike, greedy_and_logits, kernel_sized_spec, tiny_engine
from helpers.hf_reference import hf_logits, hf_model, save_hf

pytestmark = pytest.mark.gpu
PROMPTS = ([1, 5, 9, 200], [1, *range(3, 300)], [1, 77])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    spec = kernel_sized_spec()
    return spec, save_hf(hf_model(spec, seed=3), tmp_path_factory.mktemp("kernel-sized"))


# 64: one chunk size. 256: prompts of a few tokens, and the 43 left after a 256-token chunk, run in
# the 64-token program, compiled as one command buffer with cuDNN's calls inside.
@pytest.mark.parametrize("step_tokens", [64, 256])
def test_bf16_logits_follow_transformers(folder, step_tokens):
    spec, path = folder
    engine = tiny_engine(path, slots=4, max_seq_len=512, kv_tokens=4 * 512, step_tokens=step_tokens, block_size=64,
                         dtype="bfloat16")
    assert engine.policy.chunk_sizes == ([64, 128] if step_tokens == 64 else [64, 256, 512])
    model = hf_model(spec, seed=3)
    for prompt in PROMPTS:
        tokens, logits = greedy_and_logits(engine, prompt, 6)
        expected = hf_logits(model, prompt + tokens[:-1])[len(prompt) - 1:]
        scale = np.abs(expected).max()
        for step in range(6):
            assert np.abs(logits[step] - expected[step]).max() <= 0.05 * scale, f"{len(prompt)}-token prompt, {step}"
            if tokens[step] != int(np.argmax(expected[step])):
                break  # a near-tie decided differently in bf16: the inputs differ from here on


def test_the_decode_kernel_follows_xlas_ops(folder):
    _, path = folder
    engines = [tiny_engine(path, slots=2, max_seq_len=512, kv_tokens=2 * 512, step_tokens=64, block_size=64,
                           dtype="bfloat16", decode_attention=attention) for attention in ("auto", "xla")]
    assert_decode_alike(engines, PROMPTS[1], 8)
