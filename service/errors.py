"""Errors a request can meet, each mapped by the server to a gRPC status."""


class InvalidRequestError(ValueError):
    """The request is malformed (INVALID_ARGUMENT); the message says what and why."""


class OutOfRangeError(InvalidRequestError):
    """The request does not fit the model's limits (OUT_OF_RANGE): prompt or max_tokens too long."""


class QueueFullError(RuntimeError):
    """The admission queue is full (RESOURCE_EXHAUSTED)."""


class FatalEngineError(RuntimeError):
    """The engine can no longer run (a pipeline stage is gone): the process must stop and be restarted."""
