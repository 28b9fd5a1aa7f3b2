"""The Decode gRPC service end to end: real server on a localhost port, real engine and scheduler."""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time

import grpc
import pytest
from helpers.serving_harness import MAX_SEQ_LEN, SLOTS, serving, tiny_tokenizer
from switchyard.service.api.client import DecodeClient, make_request
from switchyard.service.proto import decode_pb2

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def served():
    with serving(max_queue=64) as s:
        yield s


@pytest.fixture(scope="module")
def client(served):
    with DecodeClient(served.target) as c:
        yield c


def test_generate_streams_tokens_then_a_final_message(client, served) -> None:
    messages = [m for m, _ in client.stream(make_request("Hello world", max_tokens=12), timeout=60)]
    tokens = [t for m in messages for t in m.token_ids]
    assert 1 <= len(tokens) <= 12
    assert [m.index for m in messages if m.token_ids] == list(range(len(tokens)))
    steps = [m.step for m in messages if m.token_ids]
    assert steps[0] >= 1, "the first token comes from the step that carried the prompt's last chunk"
    assert all(b > a for a, b in itertools.pairwise(steps)), "one token per step"
    assert all(m.batch_size >= 1 for m in messages if m.token_ids)
    final = messages[-1]
    assert final.finish_reason in (decode_pb2.FINISH_REASON_LENGTH, decode_pb2.FINISH_REASON_STOP)
    assert all(m.finish_reason == decode_pb2.FINISH_REASON_UNSPECIFIED for m in messages[:-1])
    tok = tiny_tokenizer()
    assert final.usage.input_tokens == len(tok.encode("Hello world"))
    assert final.usage.output_tokens == len(tokens)
    assert "".join(m.text for m in messages) == tok.decode(tokens)
    served.assert_no_leaked_slots()


def test_unary_text_and_token_id_prompts_give_the_same_tokens(client) -> None:
    ids = list(client.stub.Tokenize(decode_pb2.TokenizeRequest(text="The quick brown fox")).token_ids)
    assert ids == tiny_tokenizer().encode("The quick brown fox")
    by_text = client.stub.GenerateUnary(make_request("The quick brown fox", max_tokens=10), timeout=60)
    by_ids = client.stub.GenerateUnary(make_request(ids, max_tokens=10), timeout=60)
    streamed = client.generate(make_request(ids, max_tokens=10), timeout=60)
    assert list(by_text.token_ids) == list(by_ids.token_ids) == streamed.token_ids
    assert by_text.text == streamed.text
    assert by_text.usage.output_tokens == len(by_text.token_ids)


def test_model_info_reports_the_limits(client) -> None:
    info = client.model_info()
    assert (info.model_name, info.max_seq_len, info.batch_slots, info.max_queue) == ("tiny", MAX_SEQ_LEN, SLOTS, 64)
    assert info.ready and info.vocab_size == 512 and list(info.eos_token_ids) == [2]


def test_stop_string_ends_generation_without_emitting_it(client, served) -> None:
    free = client.generate(make_request("Once upon a time", max_tokens=40), timeout=60)
    assert len(free.text) > 4
    stop = free.text[len(free.text) // 2 :][:3]
    if not stop.strip():
        pytest.skip("generated text has no usable stop string")
    request = make_request("Once upon a time", max_tokens=40, stop=[stop])
    request.request_id = "stopped-by-text"
    # The engine takes its time to act on the cancel: its final event for the cut request (and so the
    # record) comes well after the client has its answer, and the trace lookup below must wait for it.
    scheduler = served.scheduler
    scheduler.cancel = lambda request_id: threading.Timer(0.3, type(scheduler).cancel, (scheduler, request_id)).start()
    try:
        cut = client.generate(request, timeout=60)
    finally:
        del scheduler.cancel
    assert cut.finish_reason == "stop"
    assert stop not in cut.text
    assert free.text.startswith(cut.text)
    # The engine was stopped there too, and the trace records what the client received.
    trace, = client.traces("stopped-by-text")
    assert trace.finish_reason == "stop" and trace.token_s.size == len(cut.token_ids)
    deadline = time.monotonic() + 10
    while (info := client.model_info()).active_slots or info.kv_blocks_held:
        assert time.monotonic() < deadline, "the engine kept generating after the stop string"
        time.sleep(0.01)


BAD_REQUESTS = {
    "empty text": (make_request("", max_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    "no prompt": (decode_pb2.GenerateRequest(max_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "empty"),
    "unknown token id": (make_request([1, 5, 512], max_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "512"),
    "negative token id": (make_request([-3], max_tokens=4), grpc.StatusCode.INVALID_ARGUMENT, "-3"),
    "negative max_tokens": (make_request("hi", max_tokens=-1), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    "max_tokens past context": (make_request("hi", max_tokens=MAX_SEQ_LEN), grpc.StatusCode.OUT_OF_RANGE,
                                "max_tokens"),
    "prompt past context": (make_request([5] * (MAX_SEQ_LEN + 1), max_tokens=1), grpc.StatusCode.OUT_OF_RANGE, ""),
    "negative temperature": (make_request("hi", temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    "nan temperature": (make_request("hi", temperature=float("nan")), grpc.StatusCode.INVALID_ARGUMENT,
                        "temperature"),
    "top_p zero": (make_request("hi", top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    "top_k too big": (make_request("hi", top_k=100000), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
    "seed too big": (make_request("hi", seed=2**40), grpc.StatusCode.INVALID_ARGUMENT, "seed"),
    "empty stop string": (make_request("hi", stop=[""]), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    "bad stop token": (make_request("hi", stop_token_ids=[99999]), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    "oversize prompt": (make_request("x" * (2 << 20), max_tokens=1), grpc.StatusCode.INVALID_ARGUMENT, "bytes"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_requests_get_a_status_that_says_what_and_why(client, served, name) -> None:
    request, code, words = BAD_REQUESTS[name]
    for call in (lambda: list(client.stub.Generate(request, timeout=30)),
                 lambda: client.stub.GenerateUnary(request, timeout=30)):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == code, err.value.details()
        assert words in err.value.details()
    served.assert_no_leaked_slots()


def test_request_over_the_transport_limit_is_refused_cleanly(client, served) -> None:
    with pytest.raises(grpc.RpcError) as err:
        client.stub.GenerateUnary(make_request("y" * (5 << 20), max_tokens=1), timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert client.generate(make_request("still serving", max_tokens=2), timeout=30).token_ids


def test_duplicate_request_id_in_flight_is_refused(client, served) -> None:
    first = client.stub.Generate(make_request("a long one", max_tokens=200, request_id="dup-1"), timeout=60)
    next(first)  # in flight now
    with pytest.raises(grpc.RpcError) as err:
        client.stub.GenerateUnary(make_request("again", max_tokens=2, request_id="dup-1"), timeout=30)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    first.cancel()
    served.assert_no_leaked_slots()


def test_a_thousand_cancels_leak_no_slot(client, served) -> None:
    """Cancel before admission, right after the first token, and mid-stream; 1000 in all. Each call asks
    for nearly the whole context, end-of-sequence tokens ignored, so that it is still running when
    cancelled; one that a slow client reaches only after its last token has ended well (OK, finished),
    which is no leak either."""
    stub = client.stub
    wave, cancelled = 40, 0
    for start in range(0, 1000, wave):
        calls = [stub.Generate(make_request(f"cancel me {start + i}", max_tokens=MAX_SEQ_LEN - 16, ignore_eos=True),
                               timeout=60) for i in range(wave)]
        read: list[list] = [[] for _ in calls]
        for i, call in enumerate(calls):
            for _ in range(i % 3):  # none, the first token, or two messages in
                read[i].append(next(call))
            call.cancel()
        for call, got in zip(calls, read, strict=True):
            try:
                got += list(call)
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.CANCELLED, err
                cancelled += 1
            else:
                assert call.code() == grpc.StatusCode.OK and got and got[-1].finish_reason, call.code()
    assert cancelled >= 900, f"only {cancelled} of 1000 calls were still running when cancelled"
    served.assert_no_leaked_slots()
    # Every slot is usable again: a full batch runs at once.
    with concurrent.futures.ThreadPoolExecutor(SLOTS) as pool:
        results = list(pool.map(lambda i: client.generate(make_request(f"after {i}", max_tokens=8), timeout=60),
                                range(SLOTS)))
    assert all(r.token_ids for r in results)


def test_deadline_ends_the_call_and_frees_the_slot(client, served) -> None:
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        client.generate(make_request([5] * 8, max_tokens=MAX_SEQ_LEN - 8), timeout=0.05)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 5
    served.assert_no_leaked_slots()


def _request(i: int):
    # A mix of greedy and seeded sampling, prompts of different lengths.
    prompt = f"request number {i}: " + "the sea and the sky " * (i % 5)
    if i % 2:
        return make_request(prompt, max_tokens=16, temperature=0.9, top_k=50 if i % 4 == 1 else None,
                            top_p=0.9 if i % 4 == 3 else None, seed=i)
    return make_request(prompt, max_tokens=16)


def test_64_concurrent_streams_match_the_same_requests_alone(client, served) -> None:
    alone = [client.generate(_request(i), timeout=120).token_ids for i in range(64)]
    barrier = threading.Barrier(64)

    def together(i: int):
        barrier.wait()
        return client.generate(_request(i), timeout=120)

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(together, range(64)))
    mismatched = [i for i in range(64) if results[i].token_ids != alone[i]]
    assert not mismatched, f"requests {mismatched} differ when batched"
    traces = served.wait_recorded([r.request_id for r in results])
    assert max(int(t.batch_sizes.max()) for t in traces) == SLOTS, "never ran a full batch"
    served.assert_no_leaked_slots()


def test_full_queue_answers_resource_exhausted() -> None:
    # Steps of 50 ms: the long streams' 200 tokens take 10 s, far longer than admitting them and filling
    # the queue, however busy this machine is.
    with serving(max_queue=2, step_seconds=0.05) as s, DecodeClient(s.target) as c:
        long = []
        for i in range(SLOTS):  # one at a time: the queue holds only two
            long.append(c.stub.Generate(make_request(f"long {i}", max_tokens=200), timeout=60))
            next(long[-1])  # admitted: it has its first token
        queued = [c.stub.Generate(make_request(f"queued {i}", max_tokens=2), timeout=60) for i in range(2)]
        deadline = time.monotonic() + 10
        while s.scheduler.queue_depth < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert s.scheduler.queue_depth == 2, "the two queued requests never queued"
        with pytest.raises(grpc.RpcError) as err:
            c.stub.GenerateUnary(make_request("one too many", max_tokens=2), timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in err.value.details()
        for call in long:
            call.cancel()
        for call in queued:
            assert [m for m in call][-1].finish_reason  # the queued ones still complete
        s.assert_no_leaked_slots()


def test_engine_step_failure_ends_the_stream_with_internal(client, served, monkeypatch) -> None:
    engine = served.scheduler.engine

    def broken(*args: object) -> None:
        raise RuntimeError("simulated device failure")

    # The scheduler launches a step with dispatch() and reads its tokens with collect().
    monkeypatch.setattr(engine, "collect", broken)
    with pytest.raises(grpc.RpcError) as err:
        client.generate(make_request("doomed", max_tokens=8), timeout=30)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "engine failed" in err.value.details()
    monkeypatch.undo()
    served.assert_no_leaked_slots()
    assert client.generate(make_request("recovered", max_tokens=4), timeout=30).token_ids


def test_scheduler_loop_crash_fails_in_flight_requests_and_health() -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with serving() as s, DecodeClient(s.target) as c:
        call = c.stub.Generate(make_request("in flight", max_tokens=200), timeout=60)
        next(call)
        original = s.scheduler.step

        def crash() -> bool:
            raise RuntimeError("simulated scheduler bug")

        s.scheduler.step = crash
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        health = health_pb2_grpc.HealthStub(c.channel)
        deadline = time.monotonic() + 5
        while health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == 2  # NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            c.generate(make_request("after", max_tokens=2), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "failed" in err.value.details()
        s.scheduler.step = original
