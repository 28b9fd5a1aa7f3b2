"""Fuzzed requests (hypothesis) against the real server: every one is answered, with OK or a status
that names a client error, never INTERNAL / UNKNOWN, never a hang, and no slot is left behind."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from helpers.serving_harness import serving
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from switchyard.service.api import kserve
from switchyard.service.proto import decode_pb2, decode_pb2_grpc

pytestmark = pytest.mark.timeout(600)

CLIENT_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.NOT_FOUND,
}
FUZZ = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

int32 = st.integers(-(2**31), 2**31 - 1)
token_id = st.one_of(st.integers(0, 511), st.integers(-5, 600), int32)
f32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


@pytest.fixture(scope="module")
def served():
    with serving(max_queue=4) as s:
        yield s


FIELDS = ("request_id", "prompt", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop_strings",
          "stop_token_ids")


@st.composite
def generate_requests(draw) -> decode_pb2.GenerateRequest:
    """Half the time a valid request; otherwise one field (or several) drawn from anything."""
    wild = set(draw(st.one_of(st.just([]), st.lists(st.sampled_from(FIELDS), min_size=1, max_size=3))))

    def pick(field: str, valid, anything):
        return draw(anything if field in wild else valid)

    r = decode_pb2.GenerateRequest()
    r.request_id = pick("request_id", st.just("") | st.text("abcdef-0123", max_size=20), st.text(max_size=300))
    kind = pick("prompt", st.sampled_from(["text", "ids"]), st.sampled_from(["text", "ids", "none"]))
    if kind == "text":
        r.text = pick("prompt", st.text(min_size=1, max_size=200).filter(str.strip), st.text(max_size=400))
    elif kind == "ids":
        r.token_ids.ids.extend(pick("prompt", st.lists(st.integers(0, 511), min_size=1, max_size=100),
                                    st.lists(token_id, max_size=300)))
    r.max_tokens = pick("max_tokens", st.integers(0, 24), st.one_of(st.integers(-3, 300), int32))
    valid = {"temperature": st.floats(0, 2, width=32), "top_k": st.integers(0, 1024),
             "top_p": st.floats(0.0625, 1, width=32), "seed": st.integers(0, 2**31 - 1)}
    anything = {"temperature": f32, "top_k": int32, "top_p": f32, "seed": st.integers(0, 2**64 - 1)}
    for name in valid:
        value = draw(st.none() | (anything[name] if name in wild else valid[name]))
        if value is not None:
            setattr(r.sampling, name, value)
    r.stop_strings.extend(pick("stop_strings", st.lists(st.text(min_size=1, max_size=8), max_size=3),
                               st.lists(st.text(max_size=300), max_size=20)))
    r.stop_token_ids.extend(pick("stop_token_ids", st.lists(st.integers(0, 511), max_size=3),
                                 st.lists(token_id, max_size=70)))
    return r


@given(request=generate_requests(), unary=st.booleans(), cancel_after=st.none() | st.integers(0, 3))
@FUZZ
def test_fuzzed_generate_requests_get_a_proper_status(served, request, unary, cancel_after) -> None:
    with grpc.insecure_channel(served.target) as channel:
        _call_decode(decode_pb2_grpc.DecodeStub(channel), request, unary, cancel_after)
    served.assert_no_leaked_slots()


def _call_decode(stub, request, unary: bool, cancel_after: int | None) -> None:
    try:
        if unary:
            stub.GenerateUnary(request, timeout=60)
        else:
            call = stub.Generate(request, timeout=60)
            for n, _ in enumerate(call):
                if cancel_after is not None and n >= cancel_after:
                    call.cancel()
                    break
        event("OK")
    except grpc.RpcError as err:
        event(err.code().name)
        assert err.code() in CLIENT_ERRORS | {grpc.StatusCode.CANCELLED}, (err.code(), err.details())
        assert err.details(), "every refusal says why"


DATATYPES = ["BYTES", "INT32", "INT64", "UINT64", "FP32", "FP64", "BOOL", "FP16", "UINT8", ""]
NAMES = [*kserve.INPUTS, "bogus", ""]


@st.composite
def infer_requests(draw):
    r = kserve.ModelInferRequest(model_name=draw(st.sampled_from(["tiny"] * 6 + ["other", ""])))
    r.model_version = draw(st.sampled_from(["", "", "1", "1", "2"]))
    raw = draw(st.booleans())
    for _ in range(draw(st.integers(0, 6))):
        name = draw(st.sampled_from(NAMES))
        dtype = draw(st.sampled_from(DATATYPES))
        shape = draw(st.lists(st.integers(-1, 3), max_size=3))
        tensor = r.inputs.add(name=name, datatype=dtype, shape=shape)
        if raw:
            r.raw_input_contents.append(draw(st.binary(max_size=64)))
        elif dtype == "BYTES":
            tensor.contents.bytes_contents.extend(draw(st.lists(st.binary(max_size=20), max_size=3)))
        else:
            tensor.contents.int_contents.extend(draw(st.lists(int32, max_size=3)))
            tensor.contents.fp32_contents.extend(draw(st.lists(f32, max_size=3)))
    return r


def _valid_infer_request(text: bytes, max_tokens: int):
    r = kserve.ModelInferRequest(model_name="tiny")
    r.inputs.add(name="text_input", datatype="BYTES", shape=[1, 1])
    r.inputs.add(name="max_tokens", datatype="INT32", shape=[1, 1])
    r.raw_input_contents.append(kserve.serialize_bytes([text]))
    r.raw_input_contents.append(np.array([max_tokens], "<i4").tobytes())
    return r


@given(request=st.one_of(infer_requests(),
                         st.builds(_valid_infer_request, st.binary(max_size=40), st.integers(-2, 300)),
                         st.builds(_valid_infer_request, st.text(min_size=1, max_size=40).map(str.encode),
                                   st.integers(1, 24) | st.integers(240, 2**31 - 1))))
@FUZZ
def test_fuzzed_kserve_requests_get_a_proper_status(served, request) -> None:
    with grpc.insecure_channel(served.target) as channel:
        _call_infer(channel, request)
    served.assert_no_leaked_slots()


def _call_infer(channel: grpc.Channel, request) -> None:
    infer = channel.unary_unary(
        f"/{kserve.SERVICE}/ModelInfer",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=kserve.ModelInferResponse.FromString,
    )
    try:
        response = infer(request, timeout=60)
        assert response.outputs[0].name == "text_output"
        event("OK")
    except grpc.RpcError as err:
        event(err.code().name)
        assert err.code() in CLIENT_ERRORS, (err.code(), err.details())
        assert err.details()


# ---- bytes on the wire: valid messages mutated (truncated, bytes flipped, bytes inserted) ------------

RAW_METHODS = {
    "/switchyard.v1.Decode/GenerateUnary": lambda: decode_pb2.GenerateRequest(text="Once upon", max_tokens=4),
    "/switchyard.v1.Decode/Tokenize": lambda: decode_pb2.TokenizeRequest(text="Once upon"),
    f"/{kserve.SERVICE}/ModelInfer": lambda: _valid_infer_request(b"Once upon", 4),
}


@st.composite
def mutated(draw, valid: bytes) -> bytes:
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "insert", "truncate"]))
        if kind == "truncate" and data:
            del data[draw(st.integers(0, len(data) - 1)):]
        elif kind == "flip" and data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        else:
            at = draw(st.integers(0, len(data)))
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(data)


@given(path=st.sampled_from(sorted(RAW_METHODS)), data=st.data())
@FUZZ
def test_mutated_bytes_on_both_apis_get_a_proper_status(served, path, data) -> None:
    payload = data.draw(mutated(RAW_METHODS[path]().SerializeToString()))
    with grpc.insecure_channel(served.target) as channel:
        call = channel.unary_unary(path, request_serializer=None, response_deserializer=None)
        try:
            call(payload, timeout=60)
            event("OK")
        except grpc.RpcError as err:
            event(err.code().name)
            assert err.code() in CLIENT_ERRORS, (path, payload, err.code(), err.details())
            assert err.details()
        # The server is still there and healthy after every message.
        health = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None,
                                     response_deserializer=None)
        assert health(b"", timeout=10) == b"\x08\x01"  # status: SERVING
    served.assert_no_leaked_slots()
