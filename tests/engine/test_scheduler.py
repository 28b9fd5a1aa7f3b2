"""The scheduler on the fake engine (no JAX): stops, limits, cancellation, deadlines, queue bounds,
validation, records; admission order, preemption and prefix reuse, with the fake engine checking every
plan's shape and reading every token back through the block tables."""

from __future__ import annotations

import time

import numpy as np
import pytest
from switchyard.service.engine import step_policy
from switchyard.service.engine.engine import EngineConfig
from switchyard.service.engine.fake import FakeEngine
from switchyard.service.engine.request import GenerationRequest, TokenEvent
from switchyard.service.engine.sampling import SamplingParams
from switchyard.service.engine.scheduler import Scheduler
from switchyard.service.errors import InvalidRequestError, OutOfRangeError, QueueFullError

PROMPT = [1, 40, 41, 42, 43]
BLOCK = 16
EOS = 2


def fake(slots: int = 4, max_seq_len: int = 64, kv_tokens: int = 0, step_tokens: int = BLOCK,
         idle_step_tokens: int = 4 * BLOCK) -> FakeEngine:
    return FakeEngine(config=EngineConfig(batch_slots=slots, max_seq_len=max_seq_len, step_tokens=step_tokens,
                                          block_size=BLOCK, idle_step_tokens=idle_step_tokens), kv_tokens=kv_tokens)


@pytest.fixture
def sched():
    records = []
    s = Scheduler(fake(), eos_token_ids=(EOS,), max_queue=3, on_finish=records.append)
    s.records = records
    yield s
    assert s.kv.free_slots() == list(range(s.max_slots)), "a slot leaked"
    assert s.kv.held_blocks() == 0, "a block leaked"


def run(s: Scheduler, *requests: GenerationRequest, limit: int = 2000) -> dict[str, list[TokenEvent]]:
    events: dict[str, list[TokenEvent]] = {}
    for r in requests:
        r.on_event = lambda e: events.setdefault(e.request_id, []).append(e)
        s.submit(r)
    for _ in range(limit):
        if not s.step() and s.in_flight == 0:
            break
    return events


def tokens_of(events: list[TokenEvent]) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


def greedy_tokens(s: Scheduler, n: int, prompt=PROMPT) -> list[int]:
    return tokens_of(run(s, GenerationRequest("probe", list(prompt), n, ignore_eos=True))["probe"])


def test_max_tokens_and_single_final_event(sched):
    ev = run(sched, GenerationRequest("a", PROMPT, 7, ignore_eos=True))["a"]
    assert [e.index for e in ev] == list(range(7))
    assert [e.finish_reason for e in ev] == [None] * 6 + ["length"]
    rec = sched.records[-1]
    assert rec.output_tokens == 7 and rec.finish_reason == "length" and rec.prompt_tokens == len(PROMPT)
    assert (rec.token_times[1:] >= rec.token_times[:-1]).all() and rec.token_steps[0] == rec.chunk_steps[-1]
    assert rec.t_submit <= rec.t_admit <= rec.t_first_token <= rec.t_end


def test_stop_token_id_ends_with_stop_but_not_before_min_tokens(sched):
    tokens = greedy_tokens(sched, 10)
    stop_at = tokens[4]
    first = tokens.index(stop_at)
    ev = run(sched, GenerationRequest("b", PROMPT, 10, stop_token_ids=(stop_at,), ignore_eos=True))["b"]
    assert ev[-1].finish_reason == "stop" and ev[-1].token_id == stop_at and len(ev) == first + 1
    ev = run(sched, GenerationRequest("c", PROMPT, 10, stop_token_ids=(stop_at,), min_tokens=first + 2,
                                      ignore_eos=True))["c"]
    assert len(ev) > first + 1 and tokens_of(ev)[: first + 1] == tokens[: first + 1]


def test_the_models_end_of_sequence_stops_unless_ignored():
    assert Scheduler(fake()).eos_token_ids == fake().spec.eos_token_ids == (EOS,), "the checkpoint's, by default"
    s = Scheduler(fake(), eos_token_ids=(), max_queue=8)
    tokens = greedy_tokens(s, 20)
    eos = tokens[3]
    s = Scheduler(fake(), eos_token_ids=(eos,), max_queue=8)
    assert tokens_of(run(s, GenerationRequest("a", PROMPT, 20))["a"]) == tokens[: tokens.index(eos) + 1]
    assert tokens_of(run(s, GenerationRequest("b", PROMPT, 20, ignore_eos=True))["b"]) == tokens


def test_cancel_frees_the_slot_and_reports_cancelled(sched):
    events: list[TokenEvent] = []
    sched.submit(GenerationRequest("d", PROMPT, 40, on_event=events.append, ignore_eos=True))
    for _ in range(4):
        sched.step()
    sched.cancel("d")
    while sched.step():
        pass
    assert events[-1].finish_reason == "cancelled" and events[-1].token_id is None
    assert sum(e.finish_reason is not None for e in events) == 1


def test_deadline_expires_queued_and_running_requests(sched):
    events: list[TokenEvent] = []
    sched.submit(GenerationRequest("e", PROMPT, 40, deadline=time.monotonic() - 1, on_event=events.append))
    while sched.step():
        pass
    assert [e.finish_reason for e in events] == ["deadline"]
    running: list[TokenEvent] = []
    sched.submit(GenerationRequest("f", PROMPT, 40, on_event=running.append, ignore_eos=True))
    sched.step()
    sched.step()
    sched._live["f"].req.deadline = time.monotonic() - 1
    while sched.step():
        pass
    assert running[-1].finish_reason == "deadline" and len(running) > 1


def test_queue_bound_gives_resource_exhausted(sched):
    for i in range(3):
        sched.submit(GenerationRequest(f"q{i}", PROMPT, 2))
    with pytest.raises(QueueFullError, match="queue is full"):
        sched.submit(GenerationRequest("q3", PROMPT, 2))
    while sched.step():
        pass


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [({"prompt_ids": []}, InvalidRequestError, "prompt is empty"),
     ({"prompt_ids": [1] * 64}, OutOfRangeError, "at most 63"),
     ({"prompt_ids": [1, 600]}, InvalidRequestError, r"token ids must be in \[0, 512\)"),
     ({"max_tokens": 0}, InvalidRequestError, "max_tokens must be a positive integer"),
     ({"max_tokens": 60}, OutOfRangeError, "leaving room for 59"),
     ({"min_tokens": 5}, InvalidRequestError, "min_tokens must be an integer from 0 to max_tokens"),
     ({"sampling": SamplingParams(temperature=-1)}, InvalidRequestError, "temperature"),
     ({"sampling": SamplingParams(top_p=0)}, InvalidRequestError, "top_p"),
     ({"sampling": SamplingParams(top_k=5000)}, InvalidRequestError, "top_k"),
     ({"stop_token_ids": (9999,)}, InvalidRequestError, "stop token ids must be in"),
     ({"request_id": ""}, InvalidRequestError, "request_id")],
)
def test_bad_requests_are_rejected_before_queueing(sched, kwargs, error, message):
    base = {"request_id": "x", "prompt_ids": PROMPT, "max_tokens": 4}
    with pytest.raises(error, match=message):
        sched.submit(GenerationRequest(**{**base, **kwargs}))
    assert sched.queue_depth == 0


def test_a_request_larger_than_the_pool_is_out_of_range():
    s = Scheduler(fake(max_seq_len=128, kv_tokens=4 * BLOCK))
    with pytest.raises(OutOfRangeError, match="needs 80 tokens of KV cache; this deployment's pool holds 64"):
        s.submit(GenerationRequest("big", [1] * 70, 10))


def test_duplicate_request_id_in_flight_is_rejected(sched):
    sched.submit(GenerationRequest("dup", PROMPT, 3))
    with pytest.raises(InvalidRequestError, match="already in flight"):
        sched.submit(GenerationRequest("dup", PROMPT, 3))
    while sched.step():
        pass


_RNG = np.random.default_rng(7)
PROMPTS = [[int(t) for t in _RNG.integers(3, 500, n)] for n in (1, 15, 16, 17, 32, 33, 50, 70)]


def alone(n: int = 12, **engine) -> list[list[int]]:
    return [greedy_tokens(Scheduler(fake(max_seq_len=128, **engine)), n, p) for p in PROMPTS]


def test_tokens_are_those_of_each_prompt_alone_whatever_the_batch_and_chunking():
    expected = alone()
    for step_tokens in (BLOCK, BLOCK + BLOCK // 2, 4 * BLOCK):
        s = Scheduler(fake(max_seq_len=128, step_tokens=step_tokens), max_queue=16)
        events = run(s, *[GenerationRequest(f"r{i}", list(p), 12, ignore_eos=True) for i, p in enumerate(PROMPTS)])
        assert [tokens_of(events[f"r{i}"]) for i in range(len(PROMPTS))] == expected, step_tokens
        assert s.kv.held_blocks() == 0


def test_preemption_gives_blocks_back_and_recomputes_the_same_tokens():
    records = []
    s = Scheduler(fake(max_seq_len=96, kv_tokens=6 * BLOCK), max_queue=16, on_finish=records.append)
    chosen = [p for p in PROMPTS if len(p) in (16, 17, 32, 33)]
    events = run(s, *[GenerationRequest(f"r{i}", list(p), 12, ignore_eos=True) for i, p in enumerate(chosen)])
    expected = [greedy_tokens(Scheduler(fake(max_seq_len=96)), 12, p) for p in chosen]
    assert [tokens_of(events[f"r{i}"]) for i in range(len(chosen))] == expected
    assert sum(r.preemptions for r in records) > 0, "the pool was meant to run short"
    assert s.kv.held_blocks() == 0


def test_a_shared_prefix_is_read_from_the_cache_and_gives_the_same_tokens():
    records = {}
    s = Scheduler(fake(max_seq_len=128), on_finish=lambda r: records.__setitem__(r.request_id, r))
    base = PROMPTS[-1]
    first = tokens_of(run(s, GenerationRequest("first", list(base), 12, ignore_eos=True))["first"])
    again = tokens_of(run(s, GenerationRequest("again", list(base), 12, ignore_eos=True))["again"])
    assert first == again and records["again"].cached_tokens == 4 * BLOCK
    assert records["again"].chunk_tokens.sum() == len(base) - 4 * BLOCK
    run(s, GenerationRequest("fresh", list(base), 2, reuse_prefix=False))
    assert records["fresh"].cached_tokens == 0
    run(s, GenerationRequest("exact", list(base[: 4 * BLOCK]), 2))
    assert records["exact"].cached_tokens == 3 * BLOCK  # its last block stays computed: it gives the first token


def test_a_long_prompt_is_not_starved_by_a_stream_of_short_ones():
    first_token: dict[str, float] = {}
    s = Scheduler(fake(slots=2, max_seq_len=128), max_queue=64)

    def submit(rid: str, length: int) -> None:
        s.submit(GenerationRequest(rid, [5] * length, 4, ignore_eos=True,
                                   on_event=lambda e: first_token.setdefault(rid, e.time)))

    submit("short-0", 3)
    submit("long", 100)
    for i in range(1, 40):  # a new short request every step
        submit(f"short-{i}", 3)
        s.step()
    for _ in range(500):
        if not s.step() and s.in_flight == 0:
            break
    later = [t for rid, t in first_token.items() if rid.startswith("short-") and rid != "short-0"]
    assert first_token["long"] < min(later), "a request submitted after the long prompt went first"


def test_decoding_slots_run_as_the_first_rows_in_the_narrowest_width():
    engine = fake(slots=8, max_seq_len=128)
    s = Scheduler(engine, max_queue=16)
    # Fill slots 0..5 with short requests, then two long ones land in high slots once those finish.
    run(s, *[GenerationRequest(f"s{i}", [5, 6], 1, ignore_eos=True) for i in range(6)])
    events = run(s, GenerationRequest("a", PROMPTS[3], 12, ignore_eos=True),
                 GenerationRequest("b", PROMPTS[6], 12, ignore_eos=True))
    decode_only = [p for p in engine.plans if not p.chunks]
    assert decode_only and {p.shape.width for p in decode_only if p.rows.size <= 2} == {2}
    assert tokens_of(events["a"]) == alone()[3] and tokens_of(events["b"]) == alone()[6]


def test_a_burst_of_short_prompts_shares_steps_and_each_gets_its_own_tokens():
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(3, 500, n)] for n in (3, 16, 1, 9, 12, 5, 2, 16, 7, 4)]
    sampling = [SamplingParams(temperature=0.8, seed=i) if i % 3 == 0 else SamplingParams() for i in range(10)]
    requests = lambda: [GenerationRequest(f"r{i}", list(p), 6, sampling[i], ignore_eos=True)  # noqa: E731
                        for i, p in enumerate(prompts)]
    solo = [tokens_of(run(Scheduler(fake(slots=8, max_seq_len=128, step_tokens=4 * BLOCK)), r)[r.request_id])
            for r in requests()]
    engine = fake(slots=8, max_seq_len=128, step_tokens=4 * BLOCK)
    records = {}
    s = Scheduler(engine, max_queue=16, on_finish=lambda r: records.__setitem__(r.request_id, r))
    events = run(s, *requests())
    assert [tokens_of(events[f"r{i}"]) for i in range(10)] == solo
    packed = [p for p in engine.plans if len(p.chunks) > 1]
    assert packed and max(len(p.chunks) for p in packed) == 4
    # Ten prompts of at most the small chunk each: their first tokens come from three steps, not ten.
    assert len({int(r.chunk_steps[-1]) for r in records.values()}) == 3
    assert all(len(r.chunk_steps) == 1 for r in records.values())


def test_idle_steps_carry_the_larger_chunk_and_nothing_decodes_beside_it():
    engine = fake(max_seq_len=128, idle_step_tokens=2 * BLOCK)
    records = {}
    s = Scheduler(engine, max_queue=16, on_finish=lambda r: records.__setitem__(r.request_id, r))
    longest = PROMPTS[-1]
    run(s, GenerationRequest("alone", list(longest), 4, ignore_eos=True))
    assert list(records["alone"].chunk_tokens) == [2 * BLOCK, 2 * BLOCK, len(longest) - 4 * BLOCK]
    for plan in engine.plans:
        if plan.chunks and plan.chunks[0].length > BLOCK:
            assert plan.rows.size == 0, "a sequence decoded beside an idle-step chunk"


def test_a_backlog_of_more_than_the_surge_budgets_doubles_the_chunk(monkeypatch):
    monkeypatch.setattr(step_policy, "SURGE_BACKLOG_BUDGETS", 0)
    engine = fake(max_seq_len=128)
    records = {}
    s = Scheduler(engine, max_queue=16, on_finish=lambda r: records.__setitem__(r.request_id, r))
    events = run(s, *[GenerationRequest(f"r{i}", list(p), 12, ignore_eos=True) for i, p in enumerate(PROMPTS)])
    assert [tokens_of(events[f"r{i}"]) for i in range(len(PROMPTS))] == alone()
    assert max(max(r.chunk_tokens) for r in records.values()) == 2 * BLOCK


def test_the_scheduler_counts_queued_prompts_in_the_backlog(monkeypatch):
    # One slot: only the queue's prompts can take the backlog past the longest prompt's own budgets.
    longest = PROMPTS[-1]
    monkeypatch.setattr(step_policy, "SURGE_BACKLOG_BUDGETS", -(-len(longest) // BLOCK))
    records = {}
    s = Scheduler(fake(slots=1, max_seq_len=128, idle_step_tokens=128), max_queue=16,
                  on_finish=lambda r: records.__setitem__(r.request_id, r))
    run(s, GenerationRequest("alone", list(longest), 4, ignore_eos=True, reuse_prefix=False))
    assert max(records["alone"].chunk_tokens) == BLOCK
    run(s, GenerationRequest("first", list(longest), 4, ignore_eos=True, reuse_prefix=False),
        *[GenerationRequest(f"r{i}", list(p), 4, ignore_eos=True) for i, p in enumerate(PROMPTS[:-1])])
    assert max(records["first"].chunk_tokens) == 2 * BLOCK


def test_sampled_tokens_follow_their_seed_not_their_batch():
    sampling = SamplingParams(temperature=1.0, seed=7)
    solo = tokens_of(run(Scheduler(fake()), GenerationRequest("solo", PROMPT, 10, sampling, ignore_eos=True))["solo"])
    s = Scheduler(fake(), max_queue=8)
    events = run(s, *[GenerationRequest(f"r{i}", PROMPT, 10, SamplingParams(temperature=1.0, seed=7 + i),
                                        ignore_eos=True) for i in range(3)])
    assert tokens_of(events["r0"]) == solo != tokens_of(events["r1"])
