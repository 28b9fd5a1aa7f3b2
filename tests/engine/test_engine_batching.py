"""Continuous batching at the engine level: joining, leaving, reproducible sampling, no recompiles."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.engine_fixtures import tiny_engine
from switchyard.service.engine.sampling import SamplingParams
from switchyard.service.errors import InvalidRequestError, OutOfRangeError

PROMPTS = [[1, 40, 41, 42], [1, 7, 300, 12, 99, 5, 6], [1, 250], [1, *range(3, 18)]]
SAMPLING = [SamplingParams(), SamplingParams(temperature=0.9, seed=11),
            SamplingParams(temperature=1.2, top_k=20, seed=3), SamplingParams(temperature=0.7, top_p=0.8, seed=5)]


@pytest.fixture(scope="module", params=[1, 2])
def engine(request, tiny_checkpoint_dir):
    e = tiny_engine(tiny_checkpoint_dir, tp=request.param, slots=4, max_seq_len=64)
    e.warmup()
    return e


def alone(engine, prompt, sampling, n):
    prefix = engine.prefill(prompt, sampling)
    slot = engine.free_slots()[0]
    engine.insert(prefix, slot)
    out = [prefix.first_token]
    while len(out) < n:
        out.append(int(engine.generate().tokens[slot]))
    engine.evict(slot)
    return out


def test_requests_joining_a_running_batch_get_the_tokens_they_get_alone(engine):
    n = 12
    solo = [alone(engine, p, s, n) for p, s in zip(PROMPTS, SAMPLING, strict=True)]
    compiled = engine.compiled_count()
    # Staggered: request i joins after 2*i steps of the others, in a different slot than when alone.
    outputs: dict[int, list[int]] = {}
    slot_of: dict[int, int] = {}
    pending = list(range(len(PROMPTS)))[::-1]
    step = 0
    while pending or slot_of:
        if pending and step % 2 == 0:
            i = pending.pop()
            prefix = engine.prefill(PROMPTS[i], SAMPLING[i])
            slot = engine.free_slots()[-1]
            engine.insert(prefix, slot)
            slot_of[i], outputs[i] = slot, [prefix.first_token]
        result = engine.generate()
        for i, slot in list(slot_of.items()):
            outputs[i].append(int(result.tokens[slot]))
            if len(outputs[i]) == n:
                engine.evict(slot)
                del slot_of[i]
        step += 1
    assert [outputs[i] for i in range(len(PROMPTS))] == solo
    assert engine.compiled_count() == compiled, "steady-state serving compiled a new step"


def test_seed_reproduces_and_different_seeds_differ(engine):
    a = alone(engine, PROMPTS[0], SamplingParams(temperature=1.0, seed=1), 10)
    b = alone(engine, PROMPTS[0], SamplingParams(temperature=1.0, seed=1), 10)
    c = alone(engine, PROMPTS[0], SamplingParams(temperature=1.0, seed=2), 10)
    assert a == b and a != c


def test_top_k_one_is_greedy(engine):
    greedy = alone(engine, PROMPTS[1], SamplingParams(), 8)
    assert alone(engine, PROMPTS[1], SamplingParams(temperature=1.5, top_k=1, seed=9), 8) == greedy
    assert alone(engine, PROMPTS[1], SamplingParams(temperature=1.5, top_p=1e-6, seed=9), 8) == greedy


def test_context_room_and_slot_bookkeeping(engine):
    prefix = engine.prefill(PROMPTS[0])
    engine.insert(prefix, 2)
    assert 2 not in engine.free_slots() and engine.room(2) == 64 - len(PROMPTS[0])
    with pytest.raises(ValueError, match="slot 2 is occupied"):
        engine.insert(prefix, 2)
    engine.evict(2)
    assert 2 in engine.free_slots()


@pytest.mark.parametrize(
    ("tokens", "error", "message"),
    [([], InvalidRequestError, "prompt is empty"),
     (list(range(1, 65)), OutOfRangeError, "at most 63"),
     ([1, 512], InvalidRequestError, r"token ids must be in \[0, 512\)"),
     ([1, -3], InvalidRequestError, "token ids must be")],
)
def test_bad_prompts_are_rejected(engine, tokens, error, message):
    with pytest.raises(error, match=message):
        engine.prefill(tokens)


def test_sampled_tokens_follow_the_distribution(engine):
    """Temperature sampling from the model's own distribution: empirical frequencies of the first token
    over many seeds match softmax(logits / T) (loose chi-square-style bound)."""
    prompt, temperature = PROMPTS[2], 2.0
    logits = np.asarray(engine.prefill(prompt, return_logits=True).logits, np.float64)[:512] / temperature
    p = np.exp(logits - logits.max())
    p /= p.sum()
    draws = [engine.prefill(prompt, SamplingParams(temperature=temperature, seed=s)).first_token for s in range(400)]
    top = np.argsort(p)[::-1][:5]
    for t in top:
        freq = np.mean(np.array(draws) == t)
        assert abs(freq - p[t]) < 4 * np.sqrt(p[t] * (1 - p[t]) / 400) + 0.01, (t, freq, p[t])
