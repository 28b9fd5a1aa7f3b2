"""KServe v2 / Triton ``inference.GRPCInferenceService`` over the same engine.

Speaks the tensors of Triton's two LLM backends, as benchmark clients (genai-perf, perf_analyzer)
send them. TensorRT-LLM's ensemble: ``text_input`` (BYTES) and optionally ``max_tokens`` (INT32; the
server's default when absent), ``temperature``, ``top_k``, ``top_p``, ``random_seed``, ``stop_words``,
``bad_words`` (empty only), ``min_length`` (no stop before that many tokens), ``end_id``, ``pad_id``
(accepted, unused: no padding here), ``beam_width`` (1 only), ``stream``, ``exclude_input_in_output``,
and our ``ignore_eos`` (BOOL). vLLM's backend: ``sampling_parameters``, one BYTES element of JSON
(``max_tokens``, ``min_tokens``, ``ignore_eos``, ``temperature``, ``top_p``, ``top_k``, ``seed``,
``stop``, ``stop_token_ids``; numbers and booleans as JSON values or as strings, as that backend's
clients send them); a tensor given as well wins. Output ``text_output`` (BYTES), the generated text,
after the prompt only when ``exclude_input_in_output`` is false. ``ModelStreamInfer`` is decoupled
(``ModelConfig`` says so): with ``stream`` true, one response per token carrying the text delta;
otherwise one response with the whole text. Every streamed response carries the
``triton_final_response`` parameter as Triton's does, and a request with
``triton_enable_empty_final_response`` gets an empty final response. The request parameter
``reuse_prefix`` (bool, default true) set false computes the whole prompt's KV afresh instead of
reusing the cached KV of a shared prompt prefix. ``ModelConfig`` lists every input (all but
``text_input`` optional), ``ModelStatistics`` counts finished requests from the same records as the
metrics, ``RepositoryIndex`` lists the one model.

The messages come from a private descriptor pool (see ``proto/grpc_service.proto`` for why).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import struct
from collections.abc import AsyncIterator, Callable
from importlib import metadata
from typing import Any

import grpc
import numpy as np
from google.protobuf import descriptor_pool, message_factory
from switchyard.service.api import parsing
from switchyard.service.api.text import check_stop_strings
from switchyard.service.api.wire import (
    Limits,
    RequestSpec,
    check_max_tokens,
    check_request_id,
    sampling_from,
)
from switchyard.service.errors import InvalidRequestError, quoted
from switchyard.service.proto import kserve_descriptor

SERVICE = "inference.GRPCInferenceService"
FINAL = "triton_final_response"
ENABLE_EMPTY_FINAL = "triton_enable_empty_final_response"
REUSE_PREFIX = "reuse_prefix"

_pool = descriptor_pool.DescriptorPool()
FILE = _pool.AddSerializedFile(kserve_descriptor.SERIALIZED)


def message(name: str) -> type:
    return message_factory.GetMessageClass(_pool.FindMessageTypeByName(f"inference.{name}"))


def pool() -> descriptor_pool.DescriptorPool:
    return _pool


ModelInferRequest = message("ModelInferRequest")
ModelInferResponse = message("ModelInferResponse")
ModelStreamInferResponse = message("ModelStreamInferResponse")

_INTEGERS = ("INT32", "INT64", "UINT32", "UINT64")
# name -> (datatypes accepted, shape reported in metadata); ModelConfig states each without its batch
# dimension, every one but REQUIRED optional.
INPUTS: dict[str, tuple[tuple[str, ...], list[int]]] = {
    "text_input": (("BYTES",), [-1, 1]),
    "max_tokens": (_INTEGERS, [-1, 1]),
    "temperature": (("FP32", "FP64"), [-1, 1]),
    "top_k": (_INTEGERS, [-1, 1]),
    "top_p": (("FP32", "FP64"), [-1, 1]),
    "random_seed": (("UINT64", "INT64", "INT32", "UINT32"), [-1, 1]),
    "stop_words": (("BYTES",), [-1, -1]),
    "bad_words": (("BYTES",), [-1, -1]),
    "min_length": (_INTEGERS, [-1, 1]),
    "ignore_eos": (("BOOL",), [-1, 1]),
    "end_id": (_INTEGERS, [-1, 1]),
    "pad_id": (_INTEGERS, [-1, 1]),
    "beam_width": (_INTEGERS, [-1, 1]),
    "stream": (("BOOL",), [-1, 1]),
    "exclude_input_in_output": (("BOOL",), [-1, 1]),
    "sampling_parameters": (("BYTES",), [-1, 1]),
}
REQUIRED = ("text_input",)
# sampling_parameters keys (vLLM's SamplingParams names) -> their kind; others are refused by name.
SAMPLING_KEYS = {"max_tokens": "int", "min_tokens": "int", "ignore_eos": "bool", "temperature": "float",
                 "top_p": "float", "top_k": "int", "seed": "int", "stop": "strings", "stop_token_ids": "ints"}
# Keys a client may send at their neutral value (a value that asks for nothing this server lacks).
SAMPLING_NEUTRAL = {"n": (1, "1"), "best_of": (1, "1", None), "presence_penalty": (0, 0.0, "0", "0.0"),
                    "frequency_penalty": (0, 0.0, "0", "0.0"), "repetition_penalty": (1, 1.0, "1", "1.0"),
                    "logprobs": (None,), "skip_special_tokens": (True, "true", "True"),
                    "spaces_between_special_tokens": (True, "true", "True")}
MAX_SAMPLING_PARAMETERS_BYTES = 64 << 10
_DATA_TYPES = {"BOOL": "TYPE_BOOL", "INT32": "TYPE_INT32", "INT64": "TYPE_INT64", "UINT32": "TYPE_UINT32",
               "UINT64": "TYPE_UINT64", "FP32": "TYPE_FP32", "FP64": "TYPE_FP64", "BYTES": "TYPE_STRING"}
MAX_DIMS = 8  # per input tensor
MAX_ELEMENTS = 4096  # per input tensor
OUTPUT = "text_output"

_NUMPY = {
    "BOOL": np.bool_,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


# ---- tensors (pure) ------------------------------------------------------------------------------


def deserialize_bytes(raw: bytes, count: int, name: str) -> list[bytes]:
    """Triton's raw BYTES encoding: each element a 4-byte little-endian length, then the bytes."""
    out, offset = [], 0
    for _ in range(count):
        if offset + 4 > len(raw):
            raise InvalidRequestError(f"input {quoted(name)}: raw BYTES data ends inside an element length")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        if offset + length > len(raw):
            raise InvalidRequestError(f"input {quoted(name)}: raw BYTES element runs past the end of the data")
        out.append(raw[offset : offset + length])
        offset += length
    if offset != len(raw):
        raise InvalidRequestError(
            f"input {quoted(name)}: {len(raw) - offset} bytes left over after {count} elements"
        )
    return out


def serialize_bytes(values: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def decode_inputs(request: Any) -> dict[str, np.ndarray]:
    """The request's input tensors as arrays (BYTES as object arrays of bytes), checked against
    their declared datatype and shape."""
    use_raw = len(request.raw_input_contents) > 0
    if use_raw and len(request.raw_input_contents) != len(request.inputs):
        raise InvalidRequestError(
            f"{len(request.inputs)} inputs but {len(request.raw_input_contents)} raw_input_contents entries"
        )
    tensors: dict[str, np.ndarray] = {}
    for n, tensor in enumerate(request.inputs):
        name, dtype = tensor.name, tensor.datatype
        if name in tensors:
            raise InvalidRequestError(f"input {quoted(name)} is given twice")
        if name not in INPUTS:
            raise InvalidRequestError(f"unexpected input {quoted(name)}; this model takes {', '.join(INPUTS)}")
        if dtype not in INPUTS[name][0]:
            raise InvalidRequestError(
                f"input {quoted(name)} has datatype {quoted(dtype)}; expected {' or '.join(INPUTS[name][0])}"
            )
        shape = list(tensor.shape)
        if len(shape) > MAX_DIMS:
            raise InvalidRequestError(f"input {quoted(name)} has {len(shape)} dimensions; at most {MAX_DIMS}")
        if any(d < 0 for d in shape):
            raise InvalidRequestError(f"input {quoted(name)} has a negative dimension in shape {shape}")
        if any(d > MAX_ELEMENTS for d in shape):
            # Checked before the product, which a shape like [0, 2**62] would make useless.
            raise InvalidRequestError(
                f"input {quoted(name)} has shape {shape}; no dimension may exceed {MAX_ELEMENTS}")
        count = math.prod(shape)  # Python integers: no overflow, unlike numpy's product
        if count > MAX_ELEMENTS:
            raise InvalidRequestError(
                f"input {quoted(name)} has {count} elements; at most {MAX_ELEMENTS} are accepted")
        if dtype == "BYTES":
            values = (
                deserialize_bytes(request.raw_input_contents[n], count, name)
                if use_raw
                else list(tensor.contents.bytes_contents)
            )
            array = np.empty(len(values), dtype=object)
            array[:] = values
        elif use_raw:
            np_type = np.dtype(_NUMPY[dtype]).newbyteorder("<")
            raw = request.raw_input_contents[n]
            if len(raw) != count * np_type.itemsize:
                raise InvalidRequestError(
                    f"input {quoted(name)}: {len(raw)} raw bytes do not hold {count} {dtype} elements"
                )
            array = np.frombuffer(raw, dtype=np_type)
        else:
            array = np.asarray(getattr(tensor.contents, _CONTENTS_FIELD[dtype]), dtype=_NUMPY[dtype])
        if array.size != count:
            raise InvalidRequestError(
                f"input {quoted(name)} has {array.size} elements but its shape {shape} needs {count}"
            )
        tensors[name] = array.reshape(shape) if shape else array.reshape(())
    return tensors


def _scalar(tensors: dict[str, np.ndarray], name: str, kind: Callable[[Any], Any]) -> Any:
    if name not in tensors:
        return None
    array = tensors[name]
    if array.size != 1:
        raise InvalidRequestError(f"input {quoted(name)} must hold one value (a batch of one), got {array.size}")
    value = array.reshape(-1)[0]
    return kind(value)


def _text(value: Any, name: str) -> str:
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as err:
        raise InvalidRequestError(f"input {quoted(name)} is not valid UTF-8: {err}") from err


def bool_parameter(request: Any, name: str, default: bool) -> bool:
    """The request parameter ``name``, which must be a ``bool_param`` when given."""
    if name not in request.parameters:
        return default
    param = request.parameters[name]
    which = param.WhichOneof("parameter_choice")
    if which != "bool_param":
        value = getattr(param, which) if which else None
        got = f"{which} {quoted(value) if isinstance(value, str) else value}" if which else "no value"
        raise InvalidRequestError(f"parameter {quoted(name)} must be a bool (bool_param), got {got}")
    return bool(param.bool_param)


@dataclasses.dataclass(frozen=True)
class Options:
    stream: bool = False  # one response per token (else one with the whole text)
    prefix: str = ""  # text before the generated text: the prompt when exclude_input_in_output is false


def _sampling_value(key: str, kind: str, value: Any) -> Any:
    """One ``sampling_parameters`` value; numbers and booleans may come as strings."""
    where = f"sampling_parameters.{key}"
    try:
        if kind == "bool":
            if isinstance(value, str) and value.strip().lower() in ("true", "false"):
                return value.strip().lower() == "true"
            if isinstance(value, bool):
                return value
        elif kind == "int":
            if isinstance(value, str):
                value = float(value) if "." in value or "e" in value.lower() else int(value)
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        elif kind == "float":
            number = float(value) if isinstance(value, str | int | float) and not isinstance(value, bool) else None
            if number is not None and math.isfinite(number):
                return number
        elif kind == "strings":
            value = [value] if isinstance(value, str) else value
            if isinstance(value, list) and all(isinstance(v, str) for v in value):
                return [v for v in value if v]
        elif kind == "ints" and isinstance(value, list) and \
                all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return value
    except (ValueError, OverflowError):
        pass
    expected = {"bool": "true or false", "int": "an integer", "float": "a number", "strings": "a string or strings",
                "ints": "a list of integers"}[kind]
    raise InvalidRequestError(f"{where} must be {expected}, got {quoted(repr(value))}")


def sampling_parameters(raw: bytes | None) -> dict[str, Any]:
    """vLLM's backend's ``sampling_parameters`` JSON as values (InvalidRequestError names a bad key)."""
    if raw is None or not raw:
        return {}
    if len(raw) > MAX_SAMPLING_PARAMETERS_BYTES:
        raise InvalidRequestError(f"sampling_parameters is {len(raw)} bytes; at most {MAX_SAMPLING_PARAMETERS_BYTES}")
    try:
        given = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise InvalidRequestError(f"sampling_parameters is not valid JSON: {str(err)[:200]}") from None
    if not isinstance(given, dict):
        raise InvalidRequestError(f"sampling_parameters must be a JSON object, got {type(given).__name__}")
    out: dict[str, Any] = {}
    for key, value in given.items():
        if key in SAMPLING_KEYS:
            if value is not None:
                out[key] = _sampling_value(key, SAMPLING_KEYS[key], value)
        elif key in SAMPLING_NEUTRAL:
            if value not in SAMPLING_NEUTRAL[key]:
                raise InvalidRequestError(f"sampling_parameters.{key} = {quoted(repr(value))} is not supported")
        else:
            raise InvalidRequestError(
                f"sampling_parameters.{quoted(key)} is not supported; this server takes {', '.join(SAMPLING_KEYS)}")
    return out


def request_spec(
    request: Any, tokenizer: Any, limits: Limits, max_seq_len: int | None = None
) -> tuple[RequestSpec, Options]:
    """A ModelInferRequest -> (RequestSpec, Options). ``max_tokens`` absent or 0 means the server's
    default, as on the Decode API."""
    tensors = decode_inputs(request)
    missing = [n for n in REQUIRED if n not in tensors]
    if missing:
        raise InvalidRequestError(f"missing required input(s) {', '.join(missing)}")
    reuse_prefix = bool_parameter(request, REUSE_PREFIX, True)
    text = _text(_scalar(tensors, "text_input", lambda v: v), "text_input")
    if not text:
        raise InvalidRequestError("text_input is empty")
    beam = _scalar(tensors, "beam_width", int)
    if beam not in (None, 1):
        raise InvalidRequestError(f"beam_width {beam} is not supported; only 1 (no beam search)")
    if any(bytes(v) for v in tensors.get("bad_words", np.empty(0, object)).reshape(-1)):
        raise InvalidRequestError("bad_words is not supported; send it empty")
    params = sampling_parameters(_scalar(tensors, "sampling_parameters", bytes))

    def given(tensor: str, key: str, kind: Callable[[Any], Any]) -> Any:
        value = _scalar(tensors, tensor, kind)
        return params.get(key) if value is None else value

    sampling = sampling_from(
        given("temperature", "temperature", float),
        given("top_k", "top_k", int),
        given("top_p", "top_p", float),
        given("random_seed", "seed", int),
    )
    stops = tuple(_text(v, "stop_words") for v in tensors.get("stop_words", np.empty(0, object)).reshape(-1))
    stops = check_stop_strings([s for s in stops if s] + params.get("stop", []))
    end_id = _scalar(tensors, "end_id", int)
    # the scheduler adds the model's EOS ids (unless ignore_eos) and checks the ranges
    stop_ids = tuple(params.get("stop_token_ids", ())) + (() if end_id is None else (end_id,))
    prompt_ids = tokenizer.encode(text)
    room = None if max_seq_len is None else max_seq_len - len(prompt_ids)
    spec = RequestSpec(
        request_id=check_request_id(""),
        prompt_ids=prompt_ids,
        max_tokens=check_max_tokens(given("max_tokens", "max_tokens", int) or 0, limits, room),
        sampling=sampling,
        stop_token_ids=stop_ids,
        stop_strings=stops,
        reuse_prefix=reuse_prefix,
        ignore_eos=bool(given("ignore_eos", "ignore_eos", bool) or False),
        min_tokens=int(given("min_length", "min_tokens", int) or 0),  # the scheduler checks it
    )
    exclude_input = _scalar(tensors, "exclude_input_in_output", bool)
    options = Options(
        stream=bool(_scalar(tensors, "stream", bool) or False),
        prefix="" if exclude_input is None or exclude_input else text,
    )
    return spec, options


def text_response(request: Any, model_name: str, text: str, shape: list[int], final: bool | None) -> Any:
    response = ModelInferResponse(model_name=model_name, model_version="1", id=request.id)
    out = response.outputs.add(name=OUTPUT, datatype="BYTES", shape=shape)
    del out  # contents go in raw_output_contents, as Triton sends them
    response.raw_output_contents.append(serialize_bytes([text.encode("utf-8")]))
    if final is not None:
        response.parameters[FINAL].bool_param = final
    return response


def _output_shape(request: Any) -> list[int]:
    for tensor in request.inputs:
        if tensor.name == "text_input":
            return [1] * max(1, len(tensor.shape))
    return [1, 1]


# ---- the servicer --------------------------------------------------------------------------------


class KServeService:
    """Handlers of ``inference.GRPCInferenceService``, sharing the Decode service's state."""

    def __init__(self, app: Any) -> None:
        self.app = app  # switchyard.service.api.server.DecodeApp

    # health-like RPCs
    async def ServerLive(self, request: Any, context: Any) -> Any:
        return message("ServerLiveResponse")(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return message("ServerReadyResponse")(ready=self.app.ready)

    async def ModelReady(self, request: Any, context: Any) -> Any:
        return message("ModelReadyResponse")(
            ready=self.app.ready and self._known(request.name, request.version)
        )

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        try:
            version = metadata.version("switchyard")
        except metadata.PackageNotFoundError:
            version = "0"
        return message("ServerMetadataResponse")(name="switchyard", version=version, extensions=[])

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        await self._check_model(request.name, request.version, context)
        response = message("ModelMetadataResponse")(
            name=self.app.model_name, versions=["1"], platform="switchyard"
        )
        for name, (types, shape) in INPUTS.items():
            response.inputs.add(name=name, datatype=types[0], shape=shape)
        response.outputs.add(name=OUTPUT, datatype="BYTES", shape=[-1, -1])
        return response

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        await self._check_model(request.name, request.version, context)
        config = message("ModelConfig")(
            name=self.app.model_name, platform="switchyard", backend="switchyard",
            max_batch_size=1,  # one request per message; the engine batches across requests
        )
        config.model_transaction_policy.decoupled = True  # ModelStreamInfer: a response per token
        for name, (types, shape) in INPUTS.items():
            config.input.add(name=name, data_type=_DATA_TYPES[types[0]], dims=shape[1:], optional=name not in REQUIRED)
        config.output.add(name=OUTPUT, data_type="TYPE_STRING", dims=[-1])
        return message("ModelConfigResponse")(config=config)

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        response = message("ModelStatisticsResponse")()
        if not request.name:  # every model: the one
            request = message("ModelStatisticsRequest")(name=self.app.model_name)
        await self._check_model(request.name, request.version, context)
        t = self.app.metrics.statistics()
        stats = response.model_stats.add(name=self.app.model_name, version="1", last_inference=t["last_ms"],
                                         inference_count=t["success"], execution_count=t["success"])
        infer = stats.inference_stats
        infer.success.count, infer.success.ns = t["success"], t["success_ns"]
        infer.fail.count, infer.fail.ns = t["fail"], t["fail_ns"]
        infer.queue.count, infer.queue.ns = t["success"], t["queue_ns"]
        infer.compute_infer.count, infer.compute_infer.ns = t["success"], t["compute_ns"]
        return response

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        response = message("RepositoryIndexResponse")()
        ready = self.app.ready
        if ready or not request.ready:
            response.models.add(name=self.app.model_name, version="1", state="READY" if ready else "UNAVAILABLE",
                                reason="" if ready else "loading, draining or failed")
        return response

    def _known(self, name: str, version: str) -> bool:
        return name == self.app.model_name and version in ("", "1")

    async def _check_model(self, name: str, version: str, context: Any) -> None:
        if not self._known(name, version):
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"unknown model {quoted(name)} version {quoted(version)}; "
                f"this server serves {self.app.model_name!r} version 1",
            )

    # inference
    async def ModelInfer(self, request: Any, context: Any) -> Any:
        await self._check_model(request.model_name, request.model_version, context)
        pieces: list[str] = []
        try:
            spec, options = await self.app.convert(request_spec, request, self.app.max_seq_len)
            pieces.append(options.prefix)
            async with contextlib.aclosing(self.app.events(spec, context)) as events:
                async for event in events:
                    pieces.append(event.text)
        except Exception as err:
            await self.app.abort_for(err, context)
        return text_response(request, self.app.model_name, "".join(pieces), _output_shape(request), None)

    async def _stream_one(self, received: parsing.Received, out: asyncio.Queue[Any], context: Any) -> None:
        """Run one request of a ModelStreamInfer call (in a task of its own), putting its responses on ``out``."""
        request = received.message
        parsing.set_request_bytes(received.size)

        def error(text: str) -> None:
            out.put_nowait(ModelStreamInferResponse(error_message=text))

        if not self._known(request.model_name, request.model_version):
            error(f"unknown model {quoted(request.model_name)}; this server serves {self.app.model_name!r}")
            return
        param = request.parameters.get(ENABLE_EMPTY_FINAL)
        empty_final = bool(param is not None and param.bool_param)
        shape = _output_shape(request)
        try:
            spec, options = await self.app.convert(request_spec, request, self.app.max_seq_len)
            pieces: list[str] = [options.prefix]
            prefix = options.prefix  # streamed: goes in front of the first response's text
            async with contextlib.aclosing(self.app.events(spec, context)) as events:
                async for event in events:
                    last = event.finish_reason is not None
                    if not options.stream:
                        pieces.append(event.text)
                        if last:
                            response = text_response(
                                request, self.app.model_name, "".join(pieces), shape, not empty_final
                            )
                            out.put_nowait(ModelStreamInferResponse(infer_response=response))
                        continue
                    if event.token_id is None and not event.text and not (last and not empty_final):
                        continue  # a final event without a token: only the flag matters
                    response = text_response(
                        request, self.app.model_name, prefix + event.text, shape, last and not empty_final
                    )
                    prefix = ""
                    out.put_nowait(ModelStreamInferResponse(infer_response=response))
        except asyncio.CancelledError:
            raise
        except Exception as err:
            error(self.app.message_for(err))
            return
        if empty_final:
            final = ModelInferResponse(model_name=self.app.model_name, model_version="1", id=request.id)
            final.parameters[FINAL].bool_param = True
            out.put_nowait(ModelStreamInferResponse(infer_response=final))

    async def ModelStreamInfer(self, requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
        out: asyncio.Queue[Any] = asyncio.Queue()
        done = object()
        tasks: set[asyncio.Task[None]] = set()
        malformed: list[parsing.Malformed] = []

        async def read_all() -> None:
            try:
                async for request in requests:
                    if isinstance(request, parsing.Malformed):
                        # Read no further; what was accepted still finishes, then the stream fails.
                        malformed.append(request)
                        break
                    task = asyncio.create_task(self._stream_one(request, out, context))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                # Half-close from the client (or a message that did not parse): finish what was
                # asked, then end the stream.
                while tasks:
                    await asyncio.gather(*list(tasks), return_exceptions=True)
            finally:
                out.put_nowait(done)

        reader = asyncio.create_task(read_all())
        try:
            while True:
                item = await out.get()
                if item is done:
                    break
                yield item
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()
        if malformed:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, malformed[0].reason)

    def handler(self, max_bytes: int | None = None) -> grpc.GenericRpcHandler:
        """The service's methods; requests over ``max_bytes`` are refused unparsed."""

        def unary(fn: Any, req: str, resp: str) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                parsing.unary(fn),
                request_deserializer=parsing.parser(message(req), max_bytes),
                response_serializer=message(resp).SerializeToString,
            )

        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "ServerLive": unary(self.ServerLive, "ServerLiveRequest", "ServerLiveResponse"),
                "ServerReady": unary(self.ServerReady, "ServerReadyRequest", "ServerReadyResponse"),
                "ModelReady": unary(self.ModelReady, "ModelReadyRequest", "ModelReadyResponse"),
                "ServerMetadata": unary(
                    self.ServerMetadata, "ServerMetadataRequest", "ServerMetadataResponse"
                ),
                "ModelMetadata": unary(self.ModelMetadata, "ModelMetadataRequest", "ModelMetadataResponse"),
                "ModelInfer": unary(self.ModelInfer, "ModelInferRequest", "ModelInferResponse"),
                "ModelConfig": unary(self.ModelConfig, "ModelConfigRequest", "ModelConfigResponse"),
                "ModelStatistics": unary(self.ModelStatistics, "ModelStatisticsRequest", "ModelStatisticsResponse"),
                "RepositoryIndex": unary(self.RepositoryIndex, "RepositoryIndexRequest", "RepositoryIndexResponse"),
                "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
                    self.ModelStreamInfer,
                    request_deserializer=parsing.parser(ModelInferRequest, max_bytes),
                    response_serializer=ModelStreamInferResponse.SerializeToString,
                ),
            },
        )
