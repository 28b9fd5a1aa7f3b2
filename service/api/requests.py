"""Which request ids are in flight, across the server's process and the engine's, and where their
events go.

An id is in flight from the moment it is submitted until the engine has said it is gone: its final
event (a finish, a cancel, a deadline, an error), its rejection, or the loss of the engine. A caller
that leaves earlier (cancel, deadline, a closed channel, a drain cut short) only *detaches*: its
events are dropped from then on, but the id stays taken until the engine's confirmation arrives, so a
new request under the same id is refused (ALREADY_EXISTS) instead of receiving the old one's tokens.
A delivery is never redirected: an entry's sink is set once, when the id is taken.

Every path that ends a request goes through :meth:`RequestTable.event` (the engine's final event),
:meth:`RequestTable.rejected` or :meth:`RequestTable.fail_all`; callers only ever :meth:`leave`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

from switchyard.service.errors import DuplicateRequestError, quoted

log = logging.getLogger(__name__)

Sink = Callable[[Any], None]  # receives a request's TokenEvents, on the thread that reads the engine


@dataclasses.dataclass
class _Entry:
    sink: Sink | None  # None once the caller has left


class RequestTable:
    """The one owner of request identity (module docstring). Thread-safe: the event loop takes and
    leaves ids, the thread that reads the engine delivers events."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}

    def take(self, request_id: str, sink: Sink) -> None:
        """Reserve ``request_id`` with ``sink`` for its events; DuplicateRequestError if it is in flight."""
        with self._lock:
            if request_id in self._entries:
                raise DuplicateRequestError(f"request id {quoted(request_id)} is already in flight")
            self._entries[request_id] = _Entry(sink)

    def event(self, event: Any) -> None:
        """A TokenEvent from the engine: to its caller, if still there; a final event frees the id."""
        with self._lock:
            entry = self._entries.get(event.request_id)
            if entry is None:
                return
            if event.finish_reason is not None:
                del self._entries[event.request_id]
            sink = entry.sink
        if sink is not None:
            try:
                sink(event)
            except Exception:  # one caller's sink must not stop the deliveries to the others
                log.exception("delivering an event of %s failed", quoted(event.request_id))

    def rejected(self, request_id: str) -> None:
        """The engine refused the request (or it never reached the engine): the id is free."""
        with self._lock:
            self._entries.pop(request_id, None)

    def leave(self, request_id: str) -> bool:
        """The caller is gone: drop its events from now on. True while the engine still holds the
        request (the caller then asks the engine to cancel it)."""
        with self._lock:
            entry = self._entries.get(request_id)
            if entry is None:
                return False
            entry.sink = None
            return True

    def fail_all(self, final_event: Callable[[str], Any]) -> int:
        """The engine is gone: every caller still there gets ``final_event(request_id)``, and every id
        is free. Returns how many requests were in flight."""
        with self._lock:
            entries, self._entries = self._entries, {}
        for request_id, entry in entries.items():
            if entry.sink is not None:
                try:
                    entry.sink(final_event(request_id))
                except Exception:
                    log.exception("failing %s failed", quoted(request_id))
        return len(entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._entries

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    def attached_ids(self) -> list[str]:
        """Ids whose callers are still waiting for events."""
        with self._lock:
            return [rid for rid, entry in self._entries.items() if entry.sink is not None]
