"""Request messages that do not parse get INVALID_ARGUMENT, not UNKNOWN.

gRPC answers a request deserializer that raises with UNKNOWN and logs a traceback per call. Our
deserializers never raise: a message that fails to parse (truncated, a broken varint, bad UTF-8 in
a string field) becomes :class:`Malformed`, which the handler answers with INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc


@dataclasses.dataclass(frozen=True)
class Malformed:
    """A request message that did not parse; ``reason`` is the status message."""

    reason: str


def parser(message_type: Any) -> Callable[[bytes], Any]:
    """A deserializer for ``message_type`` that returns :class:`Malformed` instead of raising."""
    name = message_type.DESCRIPTOR.full_name

    def parse(data: bytes) -> Any:
        try:
            return message_type.FromString(data)
        except Exception as err:  # DecodeError; the message text is protobuf's, never the client's bytes
            return Malformed(f"the {name} message ({len(data)} bytes) does not parse: {str(err)[:200]}")

    return parse


def unary(fn: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
    """``fn`` for a unary response, with Malformed requests answered INVALID_ARGUMENT."""

    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        return await fn(request, context)

    return handle


def streaming(fn: Callable[[Any, Any], AsyncIterator[Any]]) -> Callable[[Any, Any], AsyncIterator[Any]]:
    """``fn`` for a streamed response, with Malformed requests answered INVALID_ARGUMENT."""

    async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        async for response in fn(request, context):
            yield response

    return handle


def service_handler(service: Any, servicer: Any, message_class: Callable[[Any], type]) -> grpc.GenericRpcHandler:
    """Every method of the service descriptor ``service`` (unary or server-streaming requests),
    served by ``servicer``'s method of the same name; ``message_class(descriptor)`` gives each message's class."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for method in service.methods:
        if method.client_streaming:
            raise ValueError(f"{method.full_name}: client-streaming methods parse their own messages")
        request, response = message_class(method.input_type), message_class(method.output_type)
        fn = getattr(servicer, method.name)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            streaming(fn) if method.server_streaming else unary(fn),
            request_deserializer=parser(request),
            response_serializer=response.SerializeToString,
        )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)
