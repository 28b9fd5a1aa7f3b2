"""Prefix-cache opt-out on both APIs (down to the scheduler's GenerationRequest), and the KV pool in
ModelInfo and the start-up log."""

from __future__ import annotations

import argparse
import asyncio
import types

import grpc
import numpy as np
import pytest
from helpers.serving_harness import serving
from switchyard.cli import generate as generate_cli
from switchyard.service.api import kserve
from switchyard.service.api.client import DecodeClient, make_request
from switchyard.service.api.server import engine_summary
from switchyard.service.api.wire import Limits, from_generate_request
from switchyard.service.errors import InvalidRequestError

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

pytestmark = pytest.mark.timeout(300)


# ---- conversion, without a server ----------------------------------------------------------------


@pytest.mark.parametrize("opt_out", [False, True])
def test_decode_request_flag_becomes_reuse_prefix(opt_out: bool) -> None:
    msg = make_request([5, 6, 7], max_tokens=4, no_prefix_cache=opt_out)
    spec = from_generate_request(msg, tokenizer=None, limits=Limits())
    assert spec.reuse_prefix is (not opt_out)
    request = spec.to_generation_request(deadline=None, on_event=None)
    assert request.reuse_prefix is (not opt_out)


def test_an_old_client_that_never_sets_the_field_keeps_reuse_on() -> None:
    from switchyard.service.proto import decode_pb2

    msg = decode_pb2.GenerateRequest(token_ids=decode_pb2.TokenIds(ids=[1, 2]))
    assert not msg.no_prefix_cache
    assert from_generate_request(msg, None, Limits()).reuse_prefix is True


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [1 + len(word) for word in text.split()]


def _infer_request(**parameters: object):
    request = kserve.ModelInferRequest(model_name="tiny")
    text = request.inputs.add(name="text_input", datatype="BYTES", shape=[1, 1])
    text.contents.bytes_contents.append(b"hello there")
    limit = request.inputs.add(name="max_tokens", datatype="INT32", shape=[1, 1])
    limit.contents.int_contents.append(4)
    for name, value in parameters.items():
        param = request.parameters[name]
        if value is None:
            param.SetInParent()  # given, with no value set
        elif isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int):
            param.int64_param = value
        elif isinstance(value, float):
            param.double_param = value
        else:
            param.string_param = str(value)
    return request


@pytest.mark.parametrize(("given", "expected"), [({}, True), ({"reuse_prefix": True}, True),
                                                 ({"reuse_prefix": False}, False)])
def test_kserve_parameter_becomes_reuse_prefix(given: dict, expected: bool) -> None:
    spec, _ = kserve.request_spec(_infer_request(**given), _Tokenizer(), Limits())
    assert spec.reuse_prefix is expected
    assert spec.to_generation_request(deadline=None, on_event=None).reuse_prefix is expected


@pytest.mark.parametrize(("value", "said"), [(0, "int64_param 0"), ("false", "string_param 'false'"),
                                             (1.0, "double_param 1.0"), (None, "no value")])
def test_kserve_parameter_of_another_type_is_refused(value: object, said: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        kserve.request_spec(_infer_request(reuse_prefix=value), _Tokenizer(), Limits())
    assert str(err.value) == f"parameter 'reuse_prefix' must be a bool (bool_param), got {said}"


def test_engine_summary_names_the_kv_pool_and_how_prompts_go_in() -> None:
    engine = types.SimpleNamespace(max_slots=8, max_seq_len=4096, kv_tokens=65536, kv_block_size=16, step_tokens=512)
    assert engine_summary(engine) == ("8 slots, context 4096 tokens, KV pool 65536 tokens in blocks of 16, "
                                      "prompts in chunks of up to 512 tokens per step")
    engine.step_tokens = 0
    assert engine_summary(engine).endswith("KV pool 65536 tokens in blocks of 16, prompts prefilled whole")


def test_generate_cli_has_the_opt_out_flag() -> None:
    parser = argparse.ArgumentParser()
    generate_cli.add_arguments(parser)
    assert parser.parse_args(["hi"]).no_prefix_cache is False
    assert parser.parse_args(["hi", "--no-prefix-cache"]).no_prefix_cache is True


# ---- a real server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served():
    with serving() as s:
        yield s


@pytest.fixture
def submitted(served, monkeypatch) -> dict:
    """Every GenerationRequest the scheduler takes, by request id."""
    seen: dict = {}
    submit = served.scheduler.submit

    def record(request) -> None:
        seen[request.request_id] = request
        submit(request)

    monkeypatch.setattr(served.scheduler, "submit", record)
    return seen


def test_decode_api_opt_out_reaches_the_scheduler(served, submitted) -> None:
    with DecodeClient(served.target) as client:
        kept = client.generate(make_request("same prompt", max_tokens=3), timeout=60)
        fresh = client.generate(make_request("same prompt", max_tokens=3, no_prefix_cache=True), timeout=60)
        unary = client.stub.GenerateUnary(make_request("same prompt", max_tokens=3, no_prefix_cache=True), timeout=60)
    assert submitted[kept.request_id].reuse_prefix is True
    assert submitted[fresh.request_id].reuse_prefix is False
    assert submitted[unary.request_id].reuse_prefix is False
    assert fresh.token_ids == kept.token_ids == list(unary.token_ids), "the opt-out changes no output"


def _kserve_inputs(text: str, max_tokens: int) -> list:
    out = []
    for name, dtype, value in (("text_input", "BYTES", np.array([[text.encode()]], dtype=object)),
                               ("max_tokens", "INT32", np.array([[max_tokens]], dtype=np.int32))):
        tensor = grpcclient.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        out.append(tensor)
    return out


def test_kserve_opt_out_reaches_the_scheduler_and_bad_types_are_refused(served, submitted) -> None:
    triton = grpcclient.InferenceServerClient(url=served.target)
    try:
        triton.infer("tiny", _kserve_inputs("same prompt", 3))
        assert [r.reuse_prefix for r in submitted.values()] == [True]
        submitted.clear()
        triton.infer("tiny", _kserve_inputs("same prompt", 3), parameters={"reuse_prefix": False})
        assert [r.reuse_prefix for r in submitted.values()] == [False]
        submitted.clear()
        for bad in (0, "no"):
            with pytest.raises(InferenceServerException, match="'reuse_prefix' must be a bool") as err:
                triton.infer("tiny", _kserve_inputs("same prompt", 3), parameters={"reuse_prefix": bad})
            assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert not submitted, "a refused request never reaches the scheduler"
    finally:
        triton.close()


def test_generate_cli_flag_reaches_the_scheduler(served, submitted, capsys) -> None:
    parser = argparse.ArgumentParser()
    generate_cli.add_arguments(parser)
    for flags, expected in (([], True), (["--no-prefix-cache"], False)):
        submitted.clear()
        args = parser.parse_args(["a prompt", "--target", served.target, "--max-tokens", "2", *flags])
        assert generate_cli.run(args) == 0
        assert [r.reuse_prefix for r in submitted.values()] == [expected]
    capsys.readouterr()


def test_model_info_reports_the_engines_kv_pool(served) -> None:
    engine = served.scheduler.engine
    with DecodeClient(served.target) as client:
        info = client.model_info()
    assert (info.kv_tokens, info.kv_block_size, info.step_tokens) == (
        engine.kv_tokens, engine.kv_block_size, engine.step_tokens)
    assert info.kv_tokens > 0 and info.kv_block_size > 0


def test_model_info_follows_the_engine(served, monkeypatch) -> None:
    """Not one engine's numbers copied: whatever the engine reports is what ModelInfo says."""
    engine = served.scheduler.engine
    for name, value in (("kv_tokens", 123_456), ("kv_block_size", 16), ("step_tokens", 512)):
        monkeypatch.setattr(engine, name, value)
    with DecodeClient(served.target) as client:
        info = client.model_info()
    assert (info.kv_tokens, info.kv_block_size, info.step_tokens) == (123_456, 16, 512)


def test_model_info_before_the_model_is_loaded_has_no_pool() -> None:
    from switchyard.service.api.server import DecodeApp, DecodeService

    class Context:
        async def abort(self, code: grpc.StatusCode, text: str) -> None:
            raise AssertionError(text)

    info = asyncio.run(DecodeService(DecodeApp(model_name="tiny")).ModelInfo(None, Context()))
    assert (info.kv_tokens, info.kv_block_size, info.step_tokens, info.ready) == (0, 0, 0, False)
