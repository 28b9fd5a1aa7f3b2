"""Request messages as they arrive: too large or not parsing, INVALID_ARGUMENT (never UNKNOWN).

gRPC answers a request deserializer that raises with UNKNOWN and logs a traceback per call. Our
deserializers never raise: a message over the server's size limit (refused before it is parsed) or
that fails to parse (truncated, a broken varint, bad UTF-8 in a string field) becomes
:class:`Malformed`, which the handler answers with INVALID_ARGUMENT. A message that parses comes with
its size on the wire (:class:`Received`), which the handler's task can read as :func:`request_bytes`:
asking protobuf for a parsed message's size serializes it again (milliseconds for a megabyte, on the
event loop).
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple

import grpc

_REQUEST_BYTES: contextvars.ContextVar[int] = contextvars.ContextVar("switchyard_request_bytes", default=0)


class Received(NamedTuple):
    """A request message that parsed, and its size on the wire."""

    message: Any
    size: int


def request_bytes() -> int:
    """The wire size of the request the current handler task serves (0 outside one)."""
    return _REQUEST_BYTES.get()


def set_request_bytes(size: int) -> None:
    _REQUEST_BYTES.set(size)


@dataclasses.dataclass(frozen=True)
class Malformed:
    """A request message that did not parse; ``reason`` is the status message."""

    reason: str


def parser(message_type: Any, max_bytes: int | None = None) -> Callable[[bytes], Any]:
    """A deserializer for ``message_type`` that returns :class:`Malformed` instead of raising; a
    message over ``max_bytes`` is Malformed without being parsed at all."""
    name = message_type.DESCRIPTOR.full_name

    def parse(data: bytes) -> Any:
        if max_bytes is not None and len(data) > max_bytes:
            return Malformed(f"request is {len(data)} bytes; this server accepts at most {max_bytes} bytes")
        try:
            return Received(message_type.FromString(data), len(data))
        except Exception as err:  # DecodeError; the message text is protobuf's, never the client's bytes
            return Malformed(f"the {name} message ({len(data)} bytes) does not parse: {str(err)[:200]}")

    return parse


def unary(fn: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
    """``fn`` for a unary response, with Malformed requests answered INVALID_ARGUMENT."""

    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        set_request_bytes(request.size)
        return await fn(request.message, context)

    return handle


def streaming(fn: Callable[[Any, Any], AsyncIterator[Any]]) -> Callable[[Any, Any], AsyncIterator[Any]]:
    """``fn`` for a streamed response, with Malformed requests answered INVALID_ARGUMENT."""

    async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        set_request_bytes(request.size)
        async for response in fn(request.message, context):
            yield response

    return handle


def service_handler(service: Any, servicer: Any, message_class: Callable[[Any], type],
                    max_bytes: int | None = None) -> grpc.GenericRpcHandler:
    """Every method of the service descriptor ``service`` (unary or server-streaming requests),
    served by ``servicer``'s method of the same name; ``message_class(descriptor)`` gives each message's
    class; requests over ``max_bytes`` are refused unparsed."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in service.methods:
        if method.client_streaming:
            raise ValueError(f"{method.full_name}: client-streaming methods parse their own messages")
        request, response = message_class(method.input_type), message_class(method.output_type)
        fn = getattr(servicer, method.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            streaming(fn) if method.server_streaming else unary(fn),
            request_deserializer=parser(request, max_bytes),
            response_serializer=response.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)
