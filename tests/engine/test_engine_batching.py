"""Continuous batching with the real sampler: requests joining a running batch get the tokens they get
alone (greedy and sampled), short prompts packed into one step get their own logits and tokens, seeds
reproduce, top_k 1 is greedy, and sampled tokens follow the model's distribution."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.engine_fixtures import generate, tiny_engine
from switchyard.service.engine.kv_manager import KVManager
from switchyard.service.engine.request import GenerationRequest
from switchyard.service.engine.sampling import SamplingParams
from switchyard.service.engine.scheduler import Scheduler

PROMPTS = [[1, 40, 41, 42], [1, 7, 300, 12, 99, 5, 6], [1, 250], [1, *range(3, 18)]]
SAMPLING = [SamplingParams(), SamplingParams(temperature=0.9, seed=11),
            SamplingParams(temperature=1.2, top_k=20, seed=3), SamplingParams(temperature=0.7, top_p=0.8, seed=5)]


# No warm-up: each program compiles when a step first needs it (test_engine checks that the warm-up
# leaves serving nothing to compile).
@pytest.fixture(scope="module", params=[1, 2])
def engine(request, tiny_checkpoint_dir):
    return tiny_engine(tiny_checkpoint_dir, tp=request.param, slots=4, max_seq_len=64)


def alone(engine, prompt, sampling, n):
    return generate(engine, [prompt], n, sampling=sampling)[0]


def test_requests_joining_a_running_batch_get_the_tokens_they_get_alone(engine):
    n = 12
    solo = [alone(engine, p, s, n) for p, s in zip(PROMPTS, SAMPLING, strict=True)]
    # Staggered: request i joins after 2*i steps of the others.
    scheduler = Scheduler(engine)
    outputs: dict[str, list[int]] = {}
    pending = list(range(len(PROMPTS)))[::-1]
    step = 0
    while pending or scheduler.in_flight:
        if pending and step % 2 == 0:
            i = pending.pop()
            scheduler.submit(GenerationRequest(f"r{i}", PROMPTS[i], n, SAMPLING[i], ignore_eos=True,
                                               on_event=lambda e: outputs.setdefault(e.request_id, []).append(
                                                   e.token_id)))
        scheduler.step()
        step += 1
    assert [outputs[f"r{i}"] for i in range(len(PROMPTS))] == solo


def test_seed_reproduces_and_different_seeds_differ(engine):
    a = alone(engine, PROMPTS[0], SamplingParams(temperature=1.0, seed=1), 10)
    b = alone(engine, PROMPTS[0], SamplingParams(temperature=1.0, seed=1), 10)
    c = alone(engine, PROMPTS[0], SamplingParams(temperature=1.0, seed=2), 10)
    assert a == b and a != c


def test_top_k_one_is_greedy(engine):
    greedy = alone(engine, PROMPTS[1], SamplingParams(), 8)
    assert alone(engine, PROMPTS[1], SamplingParams(temperature=1.5, top_k=1, seed=9), 8) == greedy
    assert alone(engine, PROMPTS[1], SamplingParams(temperature=1.5, top_p=1e-6, seed=9), 8) == greedy


def first_token_logits(engine, prompt) -> np.ndarray:
    kv = KVManager(max_slots=engine.max_slots, max_seq_len=engine.max_seq_len, kv_tokens=engine.kv_tokens,
                   block_size=engine.kv_block_size)
    kv.begin(0, prompt, SamplingParams())
    return engine.logits(engine.policy.plan(kv, [0]))[-1].astype(np.float64)


def test_sampled_tokens_follow_the_distribution(engine):
    """Temperature sampling from the model's own distribution: empirical frequencies of the first token
    over many seeds match softmax(logits / T) (loose chi-square-style bound)."""
    prompt, temperature = PROMPTS[2], 2.0
    logits = first_token_logits(engine, prompt) / temperature
    p = np.exp(logits - logits.max())
    p /= p.sum()
    scheduler = Scheduler(engine, max_queue=400)
    got: dict[str, int] = {}
    for s in range(400):
        scheduler.submit(GenerationRequest(f"s{s}", prompt, 1, SamplingParams(temperature=temperature, seed=s),
                                           ignore_eos=True, reuse_prefix=False,
                                           on_event=lambda e: got.setdefault(e.request_id, e.token_id)))
    while scheduler.in_flight:
        scheduler.step()
    draws = [got[f"s{s}"] for s in range(400)]
    top = np.argsort(p)[::-1][:5]
    for t in top:
        freq = np.mean(np.array(draws) == t)
        assert abs(freq - p[t]) < 4 * np.sqrt(p[t] * (1 - p[t]) / 400) + 0.01, (t, freq, p[t])


@pytest.fixture(scope="module")
def packing_engine(tiny_checkpoint_dir):
    """Blocks of 4 and a budget of 16: prompt remainders of up to 4 tokens go four to a step."""
    engine = tiny_engine(tiny_checkpoint_dir, tp=2, slots=4, max_seq_len=64, step_tokens=16, block_size=4)
    assert engine.policy.packed_chunks == 4 and engine.policy.chunk_sizes[0] == 4
    return engine


def test_short_prompts_packed_into_one_step_get_their_own_logits_and_tokens(packing_engine, monkeypatch):
    engine = packing_engine
    short = [[1, 40, 41], [1, 250], [1, 7, 300, 12], [1]]
    kv = KVManager(max_slots=4, max_seq_len=64, kv_tokens=engine.kv_tokens, block_size=4)
    for slot, prompt in enumerate(short):
        kv.begin(slot, prompt, SamplingParams(), reuse_prefix=False)
    plan = engine.policy.plan(kv, [0, 1, 2, 3])
    assert plan.shape.chunks == 4 and len(plan.chunks) == 4
    packed = engine.logits(plan).astype(np.float64)
    for row, chunk in enumerate(plan.chunks):
        own = first_token_logits(engine, short[chunk.slot])
        assert np.abs(packed[row] - own).max() < 2e-2 * np.abs(own).max(), chunk.slot
    # Through the scheduler: a longer prompt decodes while the short ones arrive and are packed beside it.
    n = 10
    prompts = [[1, *range(3, 14)], *short[:3]]
    sampling = [SamplingParams(), SamplingParams(temperature=0.9, seed=11), SamplingParams(), SAMPLING[2]]
    solo = [alone(engine, p, s, n) for p, s in zip(prompts, sampling, strict=True)]
    launched = []
    launch = engine.launch
    monkeypatch.setattr(engine, "launch", lambda plan: (launched.append(plan), launch(plan))[1])
    scheduler = Scheduler(engine)
    outputs: dict[str, list[int]] = {}
    for i, (prompt, samp) in enumerate(zip(prompts, sampling, strict=True)):
        scheduler.submit(GenerationRequest(f"r{i}", prompt, n, samp, ignore_eos=True,
                                           on_event=lambda e: outputs.setdefault(e.request_id, []).append(e.token_id)))
        if i == 0:
            for _ in range(3):
                scheduler.step()
    while scheduler.in_flight:
        scheduler.step()
    assert [outputs[f"r{i}"] for i in range(len(prompts))] == solo
    assert any(len(p.chunks) == 3 and p.rows.size == 1 for p in launched), "the short prompts were not packed"

