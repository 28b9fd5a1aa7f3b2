"""Errors a request can meet, each mapped by the server to a gRPC status, and those that stop an
engine from starting or running."""


class InvalidRequestError(ValueError):
    """The request is malformed (INVALID_ARGUMENT); the message says what and why."""


class OutOfRangeError(InvalidRequestError):
    """The request does not fit the model's limits (OUT_OF_RANGE): prompt or max_tokens too long."""


class QueueFullError(RuntimeError):
    """The admission queue is full (RESOURCE_EXHAUSTED)."""


class FatalEngineError(RuntimeError):
    """The engine can no longer run (a pipeline stage is gone): the process must stop and be restarted."""


class GroupFormationError(RuntimeError):
    """This stage cannot join its pipeline group: its coordinator (stage 0) does not answer, or the
    group does not form."""


class DuplicateRequestError(InvalidRequestError):
    """A request id that is already in flight (ALREADY_EXISTS), wherever it is found: the server's
    table of streams or the scheduler's, which holds a cancelled request until its next step."""


# The longest client string an error message repeats; gRPC drops status messages above ~16 KiB.
QUOTE_CHARS = 64


def quoted(value: object, limit: int = QUOTE_CHARS) -> str:
    """``repr`` of a client-supplied value, cut to ``limit`` characters with its full length said."""
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"
