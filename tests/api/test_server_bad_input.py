"""Bad input at the wire, on both gRPC APIs: messages that do not parse, tensor shapes whose element
count overflows, client strings of any length quoted in errors, request ids reused right after a
cancel, megabyte prompts, and a drain whose grace period runs out. Every answer is a status that
says what is wrong, with a bounded message; nothing is logged as a server error; nothing accepted is
dropped without a response."""

from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest
from helpers.serving_harness import serving
from switchyard.service.api import kserve
from switchyard.service.api.client import DecodeClient, make_request
from switchyard.service.proto import decode_pb2

pytestmark = pytest.mark.timeout(300)

# Byte strings no request message parses: a truncated length-delimited field, a varint that never
# ends; and, per method, a string field holding bytes that are not UTF-8 (field 1 is a string in
# every request below that has fields, except GenerateRequest, whose field 1 is the request id too).
MALFORMED = {
    "truncated": b"\x12\x10abc",
    "broken varint": b"\x18" + b"\xff" * 11,
    "bad utf-8": b"\x0a\x02\xc3\x28",
}
MAX_MESSAGE = 1024  # no status message of ours comes near this


@pytest.fixture(scope="module")
def served():
    with serving() as s:
        yield s


@pytest.fixture(scope="module")
def channel(served):
    with grpc.insecure_channel(served.target) as ch:
        yield ch


@pytest.fixture()
def server_errors(caplog):
    """Records the server's ERROR log lines: a client's mistake must never produce one."""
    caplog.set_level(logging.ERROR)
    yield caplog
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


def _raw_unary(channel, path: str):
    return channel.unary_unary(path, request_serializer=None, response_deserializer=None)


def _raw_stream(channel, path: str):
    return channel.unary_stream(path, request_serializer=None, response_deserializer=None)


UNARY_METHODS = [
    "/switchyard.v1.Decode/GenerateUnary", "/switchyard.v1.Decode/Tokenize", "/switchyard.v1.Decode/ModelInfo",
    "/switchyard.v1.Decode/GetTraces", "/inference.GRPCInferenceService/ModelInfer",
    "/inference.GRPCInferenceService/ModelMetadata", "/inference.GRPCInferenceService/ModelReady",
]


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_messages_that_do_not_parse_get_invalid_argument(channel, server_errors, kind) -> None:
    data = MALFORMED[kind]
    for path in UNARY_METHODS:
        if kind == "bad utf-8" and path.endswith("/ModelInfo"):
            continue  # ModelInfoRequest has no fields: an unknown field's bytes are never checked
        with pytest.raises(grpc.RpcError) as err:
            _raw_unary(channel, path)(data, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (path, err.value.details())
        assert "does not parse" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        list(_raw_stream(channel, "/switchyard.v1.Decode/Generate")(data, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _infer_request(text: str, max_tokens: int, *, stream: bool = True, request_id: str = "") -> bytes:
    request = kserve.ModelInferRequest(model_name="tiny", id=request_id)
    for name, datatype, contents in (("text_input", "BYTES", [text.encode()]), ("max_tokens", "INT32", [max_tokens]),
                                     ("stream", "BOOL", [stream])):
        tensor = request.inputs.add(name=name, datatype=datatype, shape=[1, 1])
        getattr(tensor.contents, kserve._CONTENTS_FIELD[datatype]).extend(contents)
    return request.SerializeToString()


def test_stream_with_a_later_bad_message_finishes_what_it_accepted_then_fails(channel, served, server_errors) -> None:
    """The requests sent before the bad message are answered to their final response; the stream then
    ends with INVALID_ARGUMENT, not OK."""
    call = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer",
                                 request_serializer=None,
                                 response_deserializer=kserve.ModelStreamInferResponse.FromString)
    sent = threading.Event()

    def requests():
        yield _infer_request("first", 40, request_id="a")
        yield _infer_request("second", 30, request_id="b")
        time.sleep(0.2)  # both accepted and generating
        sent.set()
        yield MALFORMED["truncated"]

    responses = []
    with pytest.raises(grpc.RpcError) as err:
        for response in call(requests(), timeout=60):
            responses.append(response)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert sent.is_set()
    by_id: dict[str, list] = {}
    for r in responses:
        assert not r.error_message, r.error_message
        by_id.setdefault(r.infer_response.id, []).append(r.infer_response)
    assert set(by_id) == {"a", "b"}
    for request_id, expected in (("a", 40), ("b", 30)):
        got = by_id[request_id]
        assert got[-1].parameters[kserve.FINAL].bool_param, f"request {request_id} got no final response"
        assert len(got) >= expected  # one response per token (a stop token may end it sooner only by EOS)
    served.assert_no_leaked_slots()


def _infer_with_shape(channel, shape: list[int]):
    request = kserve.ModelInferRequest(model_name="tiny")
    tensor = request.inputs.add(name="text_input", datatype="BYTES", shape=shape)
    tensor.contents.bytes_contents.append(b"hello")
    request.inputs.add(name="max_tokens", datatype="INT32", shape=[1, 1]).contents.int_contents.append(4)
    return _raw_unary(channel, "/inference.GRPCInferenceService/ModelInfer")(request.SerializeToString(), timeout=10)


@pytest.mark.parametrize("shape", [[2**32, 2**32], [0, 2**62], [2**62, 0], [1] * 9, [4097], [65, 64]])
def test_tensor_shapes_that_overflow_or_exceed_the_limits_get_invalid_argument(channel, server_errors, shape) -> None:
    with pytest.raises(grpc.RpcError) as err:
        _infer_with_shape(channel, shape)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "text_input" in err.value.details()


def test_client_strings_are_quoted_with_a_bound(channel, served, server_errors) -> None:
    long = "x" * 100_000
    client = DecodeClient(served.target)
    cases = []
    # A model name the server does not serve (NOT_FOUND), on both the unary and the streaming API.
    request = kserve.ModelInferRequest(model_name=long)
    with pytest.raises(grpc.RpcError) as err:
        _raw_unary(channel, "/inference.GRPCInferenceService/ModelInfer")(request.SerializeToString(), timeout=10)
    cases.append((err.value, grpc.StatusCode.NOT_FOUND))
    # An input name, a stop string, a trace id: each far longer than anything we echo.
    request = kserve.ModelInferRequest(model_name="tiny")
    request.inputs.add(name=long, datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"a")
    with pytest.raises(grpc.RpcError) as err:
        _raw_unary(channel, "/inference.GRPCInferenceService/ModelInfer")(request.SerializeToString(), timeout=10)
    cases.append((err.value, grpc.StatusCode.INVALID_ARGUMENT))
    with pytest.raises(grpc.RpcError) as err:
        client.generate(make_request("hi", max_tokens=2, stop=["y" * 20_000]), timeout=10)
    cases.append((err.value, grpc.StatusCode.INVALID_ARGUMENT))
    with pytest.raises(grpc.RpcError) as err:
        client.stub.GetTraces(decode_pb2.GetTracesRequest(request_id=long), timeout=10)
    cases.append((err.value, grpc.StatusCode.NOT_FOUND))
    for error, code in cases:
        assert error.code() == code, error.details()
        assert len(error.details()) < MAX_MESSAGE, len(error.details())
        assert "100000 characters" in error.details() or "20000 characters" in error.details()


def test_request_id_reused_right_after_a_cancel_is_taken_or_already_exists(served, server_errors) -> None:
    client = DecodeClient(served.target)
    codes = set()
    for i in range(20):
        request_id = f"reuse-{i}"
        stream = client.stub.Generate(make_request("cancel me", max_tokens=200, request_id=request_id), timeout=30)
        next(stream)
        stream.cancel()
        try:
            list(client.stub.Generate(make_request("again", max_tokens=2, request_id=request_id), timeout=30))
            codes.add(grpc.StatusCode.OK)
        except grpc.RpcError as err:
            codes.add(err.code())
    assert codes <= {grpc.StatusCode.OK, grpc.StatusCode.ALREADY_EXISTS}, codes
    served.assert_no_leaked_slots()


def test_prompts_are_tokenized_off_the_event_loop(served, server_errors, monkeypatch) -> None:
    tokenizer = served.app.tokenizer
    threads = []
    encode = tokenizer.encode

    def recording_encode(text, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", recording_encode)
    client = DecodeClient(served.target)
    client.generate(make_request("where does this run", max_tokens=2), timeout=30)
    with grpc.insecure_channel(served.target) as channel:
        _raw_unary(channel, "/inference.GRPCInferenceService/ModelInfer")(_infer_request("and this", 2, stream=False),
                                                                         timeout=30)
    assert len(threads) == 2 and "switchyard-grpc" not in threads, threads


def test_a_megabyte_prompt_is_refused_by_size_before_tokenizing(served, server_errors, monkeypatch) -> None:
    tokenizer = served.app.tokenizer
    calls = []
    monkeypatch.setattr(tokenizer, "encode", lambda text, *a, **k: calls.append(len(text)) or [1])
    client = DecodeClient(served.target)
    with pytest.raises(grpc.RpcError) as err:
        client.generate(make_request("a" * (2 << 20), max_tokens=2), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "bytes" in err.value.details()
    assert calls == []


def test_drain_that_runs_out_of_grace_logs_every_request_it_cuts(caplog) -> None:
    caplog.set_level(logging.WARNING)
    with serving() as s:
        client = DecodeClient(s.target)
        results = []

        def run(i: int) -> None:
            try:
                results.append(client.generate(make_request("a long story", max_tokens=240, request_id=f"cut-{i}"),
                                               timeout=60))
            except grpc.RpcError as err:
                results.append(err)

        # Greedy on the tiny model, this prompt makes 240 tokens without meeting an end-of-sequence token.
        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while s.app.bridge.in_flight < 2 and time.monotonic() < deadline:
            time.sleep(0.01)

        async def drain() -> int:
            await s.app.drain()
            return await s.app.finish_in_flight(s.server._server, 0.0)

        assert s.server.call(drain()) == 2
        for t in threads:
            t.join(30)
    lines = [r.getMessage() for r in caplog.records if "ran out" in r.getMessage()]
    assert lines and "'cut-0'" in lines[0] and "'cut-1'" in lines[0], lines
    assert len(results) == 2 and all(isinstance(r, grpc.RpcError) for r in results)
    # The client sees the server go away, a status it retries elsewhere.
    assert [r.code() for r in results] == [grpc.StatusCode.UNAVAILABLE] * 2, [r.details() for r in results]


def test_unary_call_whose_deadline_passes_is_no_server_error(served, server_errors) -> None:
    client = DecodeClient(served.target)
    expired = 0
    for timeout in (0.01, 0.03, 0.1, 0.3, 1.0):
        try:
            client.stub.GenerateUnary(make_request("a long story", max_tokens=240), timeout=timeout)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.details()
            expired += 1
    assert expired >= 2  # the shortest deadlines pass long before 240 tokens
    served.assert_no_leaked_slots()


def test_max_tokens_zero_means_the_server_default_on_both_apis(channel, served, server_errors) -> None:
    client = DecodeClient(served.target)
    decode = client.stub.GenerateUnary(make_request("Once upon a time", max_tokens=0), timeout=30)
    default = served.app.limits.default_max_tokens
    assert len(decode.token_ids) == default or decode.finish_reason == decode_pb2.FINISH_REASON_STOP
    raw = _raw_unary(channel, "/inference.GRPCInferenceService/ModelInfer")(
        _infer_request("Once upon a time", 0, stream=False), timeout=30)
    text = kserve.deserialize_bytes(kserve.ModelInferResponse.FromString(raw).raw_output_contents[0], 1, "out")[0]
    assert text.decode() == decode.text  # text_output leaves the prompt out unless exclude_input_in_output is false
