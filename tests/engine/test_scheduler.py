"""The scheduler: stops, limits, cancellation, deadlines, queue bounds, validation, records."""

from __future__ import annotations

import time

import pytest
from helpers.engine_fixtures import tiny_engine, tiny_paged_engine
from switchyard.service.engine.sampling import SamplingParams
from switchyard.service.engine.scheduler import (
    GenerationRequest,
    InvalidRequestError,
    OutOfRangeError,
    QueueFullError,
    Scheduler,
    TokenEvent,
)
from switchyard.service.engine.tokenizer import Tokenizer

PROMPT = [1, 40, 41, 42, 43]


@pytest.fixture(scope="module", params=["slots", "paged"])
def parts(request, tiny_checkpoint_dir):
    if request.param == "slots":
        engine = tiny_engine(tiny_checkpoint_dir, tp=1, slots=4, max_seq_len=64)
    else:
        engine = tiny_paged_engine(tiny_checkpoint_dir, tp=1, slots=4, max_seq_len=64)
    engine.warmup()
    return engine, Tokenizer.from_dir(tiny_checkpoint_dir)


@pytest.fixture
def sched(parts):
    engine, tok = parts
    records = []
    s = Scheduler(engine, tok, max_queue=3, on_finish=records.append)
    s.records = records
    yield s
    assert engine.free_slots() == list(range(engine.max_slots)), "a slot leaked"


def run(s: Scheduler, *requests: GenerationRequest, limit: int = 500) -> dict[str, list[TokenEvent]]:
    events: dict[str, list[TokenEvent]] = {}
    for r in requests:
        r.on_event = lambda e: events.setdefault(e.request_id, []).append(e)
        s.submit(r)
    for _ in range(limit):
        if not s.step() and s.in_flight == 0:
            break
    return events


def greedy_tokens(s: Scheduler, n: int) -> list[int]:
    ev = run(s, GenerationRequest("probe", PROMPT, n))["probe"]
    return [e.token_id for e in ev]


def test_max_tokens_and_single_final_event(sched):
    ev = run(sched, GenerationRequest("a", PROMPT, 7))["a"]
    assert [e.index for e in ev] == list(range(7))
    assert [e.finish_reason for e in ev] == [None] * 6 + ["length"]
    rec = sched.records[-1]
    assert rec.output_tokens == 7 and rec.finish_reason == "length" and rec.prompt_tokens == len(PROMPT)
    assert (rec.token_times[1:] >= rec.token_times[:-1]).all() and rec.token_steps[0] == rec.chunk_steps[-1]
    assert rec.t_submit <= rec.t_admit <= rec.t_first_token <= rec.t_end


def test_stop_token_id_ends_with_stop(sched):
    tokens = greedy_tokens(sched, 10)
    stop_at = tokens[4]
    first = tokens.index(stop_at)
    ev = run(sched, GenerationRequest("b", PROMPT, 10, stop_token_ids=(stop_at,)))["b"]
    assert ev[-1].finish_reason == "stop" and ev[-1].token_id == stop_at and len(ev) == first + 1


def test_stop_string_cuts_text_and_holds_back_partial_matches(sched, parts):
    _, tok = parts
    tokens = greedy_tokens(sched, 12)
    full = tok.decode(tokens)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop
    ev = run(sched, GenerationRequest("c", PROMPT, 12, stop_strings=(stop,)))["c"]
    text = "".join(e.text for e in ev)
    assert ev[-1].finish_reason == "stop"
    assert text == full[: full.index(stop)]


def test_cancel_frees_the_slot_and_reports_cancelled(sched):
    events: list[TokenEvent] = []
    sched.submit(GenerationRequest("d", PROMPT, 40, on_event=events.append))
    sched.step()
    sched.step()
    sched.cancel("d")
    while sched.step():
        pass
    assert events[-1].finish_reason == "cancelled" and events[-1].token_id is None
    assert sum(e.finish_reason is not None for e in events) == 1


def test_deadline_expires_queued_and_running_requests(sched):
    events: list[TokenEvent] = []
    past = time.monotonic() - 1
    sched.submit(GenerationRequest("e", PROMPT, 40, deadline=past, on_event=events.append))
    while sched.step():
        pass
    assert [e.finish_reason for e in events] == ["deadline"]


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
     ({"max_tokens": 0}, InvalidRequestError, "max_tokens must be a positive integer"),
     ({"max_tokens": 60}, OutOfRangeError, "leaving room for 59"),
     ({"sampling": SamplingParams(temperature=-1)}, InvalidRequestError, "temperature"),
     ({"sampling": SamplingParams(top_p=0)}, InvalidRequestError, "top_p"),
     ({"sampling": SamplingParams(top_k=5000)}, InvalidRequestError, "top_k"),
     ({"stop_strings": ("",)}, InvalidRequestError, "stop strings must be non-empty"),
     ({"stop_token_ids": (9999,)}, InvalidRequestError, "stop token ids must be in"),
     ({"request_id": ""}, InvalidRequestError, "request_id")],
)
def test_bad_requests_are_rejected_before_queueing(sched, kwargs, error, message):
    base = {"request_id": "x", "prompt_ids": PROMPT, "max_tokens": 4}
    with pytest.raises(error, match=message):
        sched.submit(GenerationRequest(**{**base, **kwargs}))
    assert sched.queue_depth == 0


def test_duplicate_request_id_in_flight_is_rejected(sched):
    sched.submit(GenerationRequest("dup", PROMPT, 3))
    with pytest.raises(InvalidRequestError, match="already in flight"):
        sched.submit(GenerationRequest("dup", PROMPT, 3))
    while sched.step():
        pass


def test_more_requests_than_slots_all_finish_with_their_own_tokens(parts):
    engine, tok = parts
    s = Scheduler(engine, tok, max_queue=16)
    alone = {i: [e.token_id for e in run(s, GenerationRequest(f"solo{i}", [1, 50 + i, 60], 6))[f"solo{i}"]]
             for i in range(6)}
    together = run(s, *[GenerationRequest(f"r{i}", [1, 50 + i, 60], 6) for i in range(6)])
    assert {i: [e.token_id for e in together[f"r{i}"]] for i in range(6)} == alone
    assert engine.free_slots() == list(range(engine.max_slots))
