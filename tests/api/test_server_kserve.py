"""The KServe v2 / Triton protocol, driven by the real ``tritonclient.grpc`` client."""

from __future__ import annotations

import json
import queue

import numpy as np
import pytest
from helpers.serving_harness import serving
from switchyard.service.api import kserve
from switchyard.service.api.client import DecodeClient, make_request

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def served():
    with serving() as s:
        yield s


@pytest.fixture(scope="module")
def triton(served):
    client = grpcclient.InferenceServerClient(url=served.target)
    yield client
    client.close()


def _inputs(text: str, max_tokens: int, **extra: tuple[str, np.ndarray]) -> list:
    tensors = {
        "text_input": ("BYTES", np.array([[text.encode()]], dtype=object)),
        "max_tokens": ("INT32", np.array([[max_tokens]], dtype=np.int32)),
        **extra,
    }
    out = []
    for name, (dtype, value) in tensors.items():
        tensor = grpcclient.InferInput(name, list(value.shape), dtype)
        tensor.set_data_from_numpy(value)
        out.append(tensor)
    return out


def test_health_and_metadata(triton) -> None:
    assert triton.is_server_live() and triton.is_server_ready()
    assert triton.is_model_ready("tiny")
    assert not triton.is_model_ready("llama-70b")
    assert triton.get_server_metadata().name == "switchyard"
    meta = triton.get_model_metadata("tiny")
    assert {t.name for t in meta.inputs} >= {"text_input", "max_tokens", "temperature", "stream"}
    assert [(t.name, t.datatype) for t in meta.outputs] == [("text_output", "BYTES")]
    with pytest.raises(InferenceServerException, match="unknown model"):
        triton.get_model_metadata("nope")


def test_infer_returns_the_same_text_as_the_decode_api(triton, served) -> None:
    result = triton.infer("tiny", _inputs("Hello world", 12), request_id="k-1")
    text = result.as_numpy("text_output")
    assert text.shape == (1, 1)
    with DecodeClient(served.target) as c:
        expected = c.stub.GenerateUnary(make_request("Hello world", max_tokens=12), timeout=60).text
    assert text[0, 0].decode() == expected
    assert result.get_response().id == "k-1"


def test_sampling_inputs_are_honoured(triton) -> None:
    extra = {
        "temperature": ("FP32", np.array([[0.8]], dtype=np.float32)),
        "top_k": ("INT32", np.array([[20]], dtype=np.int32)),
        "random_seed": ("UINT64", np.array([[7]], dtype=np.uint64)),
    }
    a = triton.infer("tiny", _inputs("Once upon", 10, **extra)).as_numpy("text_output")[0, 0]
    b = triton.infer("tiny", _inputs("Once upon", 10, **extra)).as_numpy("text_output")[0, 0]
    assert a == b, "same seed, same text"


def test_bad_inputs_are_reported(triton) -> None:
    only_max_tokens = [_inputs("hi", 4)[1]]
    with pytest.raises(InferenceServerException, match=r"missing required input.*text_input"):
        triton.infer("tiny", only_max_tokens)
    with pytest.raises(InferenceServerException, match="temperature"):
        triton.infer("tiny", _inputs("hi", 4, temperature=("FP32", np.array([[-2.0]], dtype=np.float32))))
    with pytest.raises(InferenceServerException, match="beam_width"):
        triton.infer("tiny", _inputs("hi", 4, beam_width=("INT32", np.array([[4]], dtype=np.int32))))
    with pytest.raises(InferenceServerException, match="unexpected input"):
        triton.infer("tiny", _inputs("hi", 4, bogus=("INT32", np.array([[1]], dtype=np.int32))))
    with pytest.raises(InferenceServerException, match="does not fit") as err:
        triton.infer("tiny", _inputs("hi", 100000))
    assert err.value.status() == "StatusCode.OUT_OF_RANGE"
    with pytest.raises(InferenceServerException) as err:
        triton.infer("tiny", _inputs("hi", 4, top_p=("FP32", np.array([[0.0]], dtype=np.float32))))
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"


def _stream(triton, requests: list[tuple[str, list]], empty_final: bool) -> dict[str, list]:
    responses: queue.Queue = queue.Queue()
    triton.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        for request_id, inputs in requests:
            triton.async_stream_infer("tiny", inputs, request_id=request_id, enable_empty_final_response=empty_final)
        by_id: dict[str, list] = {rid: [] for rid, _ in requests}
        finals = 0
        while finals < len(requests):
            result, error = responses.get(timeout=60)
            assert error is None, error
            response = result.get_response()
            by_id[response.id].append(result)
            finals += response.parameters["triton_final_response"].bool_param
        return by_id
    finally:
        triton.stop_stream()


def _text(result) -> str:
    out = result.as_numpy("text_output")
    return "" if out is None else out.reshape(-1)[0].decode()


@pytest.mark.parametrize("empty_final", [False, True])
def test_decoupled_stream_sends_a_response_per_token(triton, served, empty_final) -> None:
    stream_flag = {"stream": ("BOOL", np.array([[True]], dtype=bool))}
    requests = [(f"s{i}", _inputs(f"stream number {i}", 10, **stream_flag)) for i in range(3)]
    by_id = _stream(triton, requests, empty_final)
    with DecodeClient(served.target) as c:
        for i in range(3):
            expected = c.generate(make_request(f"stream number {i}", max_tokens=10), timeout=60)
            results = by_id[f"s{i}"]
            token_responses = results[:-1] if empty_final else results
            assert len(token_responses) == len(expected.token_ids)
            assert "".join(_text(r) for r in results) == expected.text
            flags = [r.get_response().parameters[kserve.FINAL].bool_param for r in results]
            assert flags == [False] * (len(results) - 1) + [True]
            if empty_final:
                assert results[-1].as_numpy("text_output") is None


def test_stream_without_stream_flag_sends_one_response_and_errors_in_band(triton) -> None:
    requests = [("whole", _inputs("one response", 6)), ("bad", _inputs("", 6))]
    responses: queue.Queue = queue.Queue()
    triton.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        for request_id, inputs in requests:
            triton.async_stream_infer("tiny", inputs, request_id=request_id)
        got = [responses.get(timeout=60) for _ in range(2)]
    finally:
        triton.stop_stream()
    errors = [e for _, e in got if e is not None]
    results = [r for r, e in got if e is None]
    assert len(errors) == 1 and "empty" in str(errors[0])
    assert len(results) == 1 and results[0].get_response().id == "whole" and _text(results[0])


def test_raw_bytes_codec_round_trip_and_rejects_garbage() -> None:
    values = [b"", b"abc", "héllo".encode()]
    raw = kserve.serialize_bytes(values)
    assert kserve.deserialize_bytes(raw, 3, "x") == values
    with pytest.raises(ValueError, match="left over"):
        kserve.deserialize_bytes(raw + b"z", 3, "x")
    with pytest.raises(ValueError, match="past the end"):
        kserve.deserialize_bytes(raw[:-1], 3, "x")


def test_exclude_input_in_output_false_puts_the_prompt_first(triton) -> None:
    flag = {"exclude_input_in_output": ("BOOL", np.array([[False]], dtype=bool))}
    plain = triton.infer("tiny", _inputs("Hello world", 6)).as_numpy("text_output")[0, 0].decode()
    echoed = triton.infer("tiny", _inputs("Hello world", 6, **flag)).as_numpy("text_output")[0, 0].decode()
    assert echoed == "Hello world" + plain
    streamed = _stream(triton, [("e", _inputs("Hello world", 6, stream=("BOOL", np.array([[True]], dtype=bool)),
                                                **flag))], empty_final=False)["e"]
    assert "".join(_text(r) for r in streamed) == "Hello world" + plain


def test_model_config_is_decoupled_and_lists_every_input(triton) -> None:
    config = triton.get_model_config("tiny").config
    assert config.name == "tiny" and config.model_transaction_policy.decoupled
    meta = triton.get_model_metadata("tiny")
    assert [i.name for i in config.input] == [i.name for i in meta.inputs]
    optional = {i.name: i.optional for i in config.input}
    assert optional.pop("text_input") is False and all(optional.values())
    assert {i.name for i in config.input} >= {"sampling_parameters", "min_length", "ignore_eos", "max_tokens"}
    assert [(o.name, o.dims) for o in config.output] == [("text_output", [-1])]
    with pytest.raises(InferenceServerException, match="unknown model"):
        triton.get_model_config("nope")


def test_statistics_count_finished_requests_and_the_index_lists_the_model(triton, served) -> None:
    def successes() -> int:
        served.recorder.flush()
        (stats,) = triton.get_inference_statistics("tiny").model_stats
        return stats.inference_stats.success.count

    before = successes()
    for n in range(3):
        triton.infer("tiny", _inputs(f"count {n}", 4))
    assert successes() == before + 3
    (stats,) = triton.get_inference_statistics("tiny").model_stats
    assert stats.inference_stats.success.ns > 0 and stats.last_inference > 0
    assert [(m.name, m.state) for m in triton.get_model_repository_index().models] == [("tiny", "READY")]


def _sampling(**params) -> tuple[str, np.ndarray]:
    return ("BYTES", np.array([[json.dumps(params).encode()]], dtype=object))


def test_vllm_backend_inputs_with_numbers_as_strings(triton, served) -> None:
    """genai-perf --backend vllm: text_input, stream, exclude_input_in_output and sampling_parameters,
    whose numbers are strings; no max_tokens tensor."""
    text_input = _inputs("Once upon a time", 1)[0]
    rest = _inputs("x", 1, sampling_parameters=_sampling(max_tokens="24", min_tokens="24", ignore_eos="true",
                                                         temperature="0"),
                   exclude_input_in_output=("BOOL", np.array([[True]], dtype=bool)))[2:]
    inputs = [text_input, *rest]
    text = triton.infer("tiny", inputs).as_numpy("text_output").reshape(-1)[0].decode()
    with DecodeClient(served.target) as client:
        same = client.generate(make_request("Once upon a time", max_tokens=24, ignore_eos=True), timeout=60)
    assert text == same.text and len(same.token_ids) == 24
    for bad, match in (({"temperature": "hot"}, "temperature"), ({"best_of": 3}, "best_of"),
                       ({"frobnicate": 1}, "frobnicate")):
        with pytest.raises(InferenceServerException, match=match):
            triton.infer("tiny", [inputs[0], *_inputs("x", 1, sampling_parameters=_sampling(**bad))[2:]])


def test_trtllm_inputs_with_min_length_and_empty_word_lists(triton, served) -> None:
    """genai-perf --output-tokens-mean-deterministic: min_length beside max_tokens; empty word lists."""
    empty = ("BYTES", np.array([[b""]], dtype=object))
    inputs = _inputs("Once upon a time", 20, min_length=("INT32", np.array([[20]], dtype=np.int32)),
                     bad_words=empty, stop_words=empty, ignore_eos=("BOOL", np.array([[True]], dtype=bool)))
    text = triton.infer("tiny", inputs).as_numpy("text_output").reshape(-1)[0].decode()
    with DecodeClient(served.target) as client:
        same = client.generate(make_request("Once upon a time", max_tokens=20, min_tokens=20, ignore_eos=True),
                               timeout=60)
    assert text == same.text and len(same.token_ids) == 20
    with pytest.raises(InferenceServerException, match="bad_words"):
        triton.infer("tiny", _inputs("hi", 4, bad_words=("BYTES", np.array([[b"no"]], dtype=object))))
    with pytest.raises(InferenceServerException, match="min_tokens"):
        triton.infer("tiny", _inputs("hi", 4, min_length=("INT32", np.array([[9]], dtype=np.int32))))
