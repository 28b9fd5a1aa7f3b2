"""A request's output as text, in the server's process: the engine sends token ids, this turns them
into text deltas that never split a UTF-8 character, and ends the request at a stop string.

Text that could be the start of a stop string is held back until it is known not to be; when a stop
string appears, the text before it is the request's last, its finish reason is ``stop``, and the
server cancels the request in the engine (tokens already made after it are dropped).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from switchyard.service.errors import InvalidRequestError, quoted

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


@dataclasses.dataclass
class OutputEvent:
    """What a caller receives per token: the engine's TokenEvent with the text it adds."""

    request_id: str
    index: int  # 0-based output position
    token_id: int | None  # None on a final event without a token
    text: str  # UTF-8-safe delta; held back while it could begin a stop string
    finish_reason: str | None  # None, "stop", "length", "cancelled", "deadline", "error"
    step: int
    batch_size: int
    time: float


def check_stop_strings(stops: Sequence[str]) -> tuple[str, ...]:
    """The stop strings, checked (InvalidRequestError says what is wrong)."""
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    for s in stops:
        if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
            raise InvalidRequestError(
                f"stop strings must be non-empty and at most {MAX_STOP_STRING_CHARS} characters, got {quoted(s)}")
    return tuple(stops)


class TextStream:
    """One request's tokens into text (module docstring). Not thread-safe: one thread pushes."""

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str] = (), min_tokens: int = 0) -> None:
        self._decoder = tokenizer.incremental()
        self._stops = tuple(stop_strings)
        # Stop strings count only from this many tokens on, as stop tokens do in the engine; text made
        # before then is sent at once (nothing of it is held back as a stop string's start).
        self._min_tokens = min_tokens
        self._pending = ""  # text held back because it may begin a stop string
        self.stopped_at: int | None = None  # tokens the caller received when a stop string ended it

    def push(self, event: Any) -> OutputEvent | None:
        """The caller's event for the engine's ``event``; None once a stop string has ended it."""
        if self.stopped_at is not None:
            return None
        text, reason = "", event.finish_reason
        if event.token_id is not None and reason != "stop":  # a stop token's own text is not output
            text, hit = self._push(event.token_id, event.index + 1 >= self._min_tokens)
            if hit:
                self.stopped_at = event.index + 1
                return self._output(event, text, "stop")
        if reason in ("stop", "length"):
            text += self._flush()
        return self._output(event, text, reason)

    def _output(self, event: Any, text: str, reason: str | None) -> OutputEvent:
        return OutputEvent(event.request_id, event.index, event.token_id, text, reason, event.step, event.batch_size,
                           event.time)

    def _push(self, token: int, stops_count: bool = True) -> tuple[str, bool]:
        """Append a token's text; returns (text safe to send, whether a stop string was reached)."""
        self._pending += self._decoder.push(token)
        if not self._stops or not stops_count:
            out, self._pending = self._pending, ""
            return out, False
        cut = min((p for s in self._stops if (p := self._pending.find(s)) >= 0), default=-1)
        if cut >= 0:
            out, self._pending = self._pending[:cut], ""
            return out, True
        hold = max((k for s in self._stops for k in range(1, len(s)) if self._pending.endswith(s[:k])), default=0)
        out = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(out):]
        return out, False

    def _flush(self) -> str:
        out = self._pending + self._decoder.flush()
        self._pending = ""
        return out
