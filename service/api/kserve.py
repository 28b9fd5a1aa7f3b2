"""KServe v2 / Triton ``inference.GRPCInferenceService`` over the same engine.

Speaks the tensors of Triton's TensorRT-LLM ensemble: inputs ``text_input`` (BYTES), ``max_tokens``
(INT32) and optionally ``temperature``, ``top_k``, ``top_p``, ``random_seed``, ``stop_words``,
``end_id``, ``pad_id`` (accepted, unused: no padding here), ``beam_width`` (1 only), ``stream``,
``exclude_input_in_output``; output ``text_output`` (BYTES), the generated text, after the prompt
only when ``exclude_input_in_output`` is false. ``ModelStreamInfer`` is decoupled: with ``stream`` true, one
response per token carrying the text delta; otherwise one response with the whole text. Every
streamed response carries the ``triton_final_response`` parameter as Triton's does, and a request
with ``triton_enable_empty_final_response`` gets an empty final response. The request parameter
``reuse_prefix`` (bool, default true) set false computes the whole prompt's KV afresh instead of
reusing the cached KV of a shared prompt prefix.

The messages come from a private descriptor pool (see ``proto/grpc_service.proto`` for why).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
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

# name -> (datatypes accepted, shape reported in metadata)
INPUTS: dict[str, tuple[tuple[str, ...], list[int]]] = {
    "text_input": (("BYTES",), [-1, 1]),
    "max_tokens": (("INT32", "INT64", "UINT32", "UINT64"), [-1, 1]),
    "temperature": (("FP32", "FP64"), [-1, 1]),
    "top_k": (("INT32", "INT64", "UINT32", "UINT64"), [-1, 1]),
    "top_p": (("FP32", "FP64"), [-1, 1]),
    "random_seed": (("UINT64", "INT64", "INT32", "UINT32"), [-1, 1]),
    "stop_words": (("BYTES",), [-1, -1]),
    "end_id": (("INT32", "INT64", "UINT32", "UINT64"), [-1, 1]),
    "pad_id": (("INT32", "INT64", "UINT32", "UINT64"), [-1, 1]),
    "beam_width": (("INT32", "INT64", "UINT32", "UINT64"), [-1, 1]),
    "stream": (("BOOL",), [-1, 1]),
    "exclude_input_in_output": (("BOOL",), [-1, 1]),
}
REQUIRED = ("text_input", "max_tokens")
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


def request_spec(
    request: Any, tokenizer: Any, limits: Limits, max_seq_len: int | None = None
) -> tuple[RequestSpec, Options]:
    """A ModelInferRequest -> (RequestSpec, Options). ``max_tokens`` 0 means the server's default, as
    on the Decode API."""
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
    sampling = sampling_from(
        _scalar(tensors, "temperature", float),
        _scalar(tensors, "top_k", int),
        _scalar(tensors, "top_p", float),
        _scalar(tensors, "random_seed", int),
    )
    stops = tuple(_text(v, "stop_words") for v in tensors.get("stop_words", np.empty(0, object)).reshape(-1))
    stops = check_stop_strings([s for s in stops if s])
    end_id = _scalar(tensors, "end_id", int)
    stop_ids = () if end_id is None else (end_id,)  # the scheduler adds the model's EOS ids, checks ranges
    prompt_ids = tokenizer.encode(text)
    room = None if max_seq_len is None else max_seq_len - len(prompt_ids)
    spec = RequestSpec(
        request_id=check_request_id(""),
        prompt_ids=prompt_ids,
        max_tokens=check_max_tokens(_scalar(tensors, "max_tokens", int), limits, room),
        sampling=sampling,
        stop_token_ids=stop_ids,
        stop_strings=stops,
        reuse_prefix=reuse_prefix,
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
                "ModelStreamInfer": grpc.stream_stream_rpc_method_handler(
                    self.ModelStreamInfer,
                    request_deserializer=parsing.parser(ModelInferRequest, max_bytes),
                    response_serializer=ModelStreamInferResponse.SerializeToString,
                ),
            },
        )
