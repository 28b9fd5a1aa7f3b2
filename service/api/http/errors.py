"""Errors as the OpenAI API shapes them: ``{"error": {"message", "type", "param", "code"}}`` with the
HTTP status a client library maps to its exception (400, 404, 409, 413, 429, 500, 503, 504).

The request errors are the service's own (``service/errors.py``), the same that the gRPC handlers map
to a gRPC status in ``wire.py``; here is only their HTTP status and OpenAI ``type``/``code``.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc
from switchyard.service.api.wire import GenerationEnded, Unavailable
from switchyard.service.errors import DuplicateRequestError, InvalidRequestError, OutOfRangeError, QueueFullError

log = logging.getLogger(__name__)


class HttpError(Exception):
    """An error answered with ``status`` and an OpenAI error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


class ModelNotFound(HttpError):
    def __init__(self, asked: str, served: str) -> None:
        super().__init__(404, f"the model {asked!r} does not exist here; this server serves {served!r}",
                         code="model_not_found", param="model")


def too_large(size: int | None, limit: int) -> HttpError:
    said = f"{size} bytes" if size is not None else "larger than that"
    return HttpError(413, f"request body is {said}; this server accepts at most {limit} bytes",
                     code="request_too_large")


# GenerationEnded carries the gRPC status of a generation that ended without finishing.
_ENDED = {
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout", "deadline_exceeded"),
    grpc.StatusCode.CANCELLED: (503, "service_unavailable", "cancelled"),
}


def http_error(err: BaseException) -> HttpError:
    """The HTTP answer to an error raised while taking or running a request."""
    if isinstance(err, HttpError):
        return err
    if isinstance(err, OutOfRangeError):
        return HttpError(400, str(err), code="context_length_exceeded")
    if isinstance(err, DuplicateRequestError):
        return HttpError(409, str(err), code="duplicate_request_id")
    if isinstance(err, InvalidRequestError):
        return HttpError(400, str(err))
    if isinstance(err, QueueFullError):
        return HttpError(429, str(err) or "the request queue is full; retry later", type="rate_limit_error",
                         code="queue_full")
    if isinstance(err, Unavailable):
        return HttpError(503, str(err), type="service_unavailable", code="not_ready")
    if isinstance(err, GenerationEnded):
        status, kind, code = _ENDED.get(err.code, (500, "server_error", "engine_error"))
        return HttpError(status, str(err), type=kind, code=code)
    log.error("request failed", exc_info=err)
    return HttpError(500, f"internal error: {type(err).__name__}: {err}", type="server_error",
                     code="internal_error")
