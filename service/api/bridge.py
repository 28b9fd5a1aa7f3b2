"""Bridge between asyncio RPC handlers and the scheduler's thread.

The scheduler runs its continuous-batching loop on one dedicated thread and calls each request's
``on_event`` there; for an engine in its own process
(:class:`~switchyard.service.api.engine_process.EngineProcess`) that thread reads the engine's
messages and makes the same calls. There each token id becomes text (``text.py``: a stop string ends
the request), and :meth:`EngineBridge.stream` turns the results into an async iterator with
``loop.call_soon_threadsafe``; leaving the iterator early (client cancel, gRPC deadline, server
shutdown) cancels the request in the scheduler, which frees its slot at the next step. Request
identity (which ids are in flight, where their events go) is the :class:`RequestTable`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from switchyard.service.api.engine_process import EngineProcessLost
from switchyard.service.api.requests import RequestTable
from switchyard.service.api.text import OutputEvent, TextStream
from switchyard.service.api.wire import RequestSpec, Unavailable

log = logging.getLogger(__name__)


class _EventPump:
    """Hands TokenEvents from the scheduler thread to the event loop with one wake-up per burst.

    A step emits one event per active request; waking the loop once per event (``call_soon_threadsafe``
    writes to the loop's self-pipe each time) would cost a system call and a GIL hand-over per token.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue[Any], Any]] = []
        self._scheduled = False

    def put(self, queue: asyncio.Queue[Any], event: Any) -> None:  # scheduler thread
        with self._lock:
            self._pending.append((queue, event))
            if self._scheduled:
                return
            self._scheduled = True
        # RuntimeError: the event loop has closed, nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:  # event loop
        with self._lock:
            pending, self._pending = self._pending, []
            self._scheduled = False
        for queue, event in pending:
            queue.put_nowait(event)


class EngineBridge:
    """``scheduler``: a Scheduler in this process or an EngineProcess; ``tokenizer``: the model's, for
    the output text; ``on_record``: where finished requests' records go (traces). The scheduler's
    ``on_finish`` comes here first: a request that a stop string ended is recorded as the client saw it."""

    def __init__(self, scheduler: Any, tokenizer: Any, *, on_failure: Callable[[], None] | None = None,
                 on_record: Callable[[Any], None] | None = None) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.requests = RequestTable()  # ids in flight and where their events go
        self._pumps: dict[asyncio.AbstractEventLoop, _EventPump] = {}
        self._on_failure = on_failure  # called on the scheduler thread if its loop dies
        self._on_record = on_record
        # A finished request's record waits here for its final event, which says whether a stop string
        # ended it first (then the record is cut to what the client received).
        self._records: dict[str, Any] = {}
        self._stopped_at: dict[str, int] = {}
        # Requests whose caller a stop string already answered while the engine's final event (and so
        # their record) is still a step away: a trace lookup for one waits for it.
        self._unrecorded: dict[str, threading.Event] = {}
        scheduler.on_finish = self._records_until_final
        self.failed = False
        self.accepting = True

    def _records_until_final(self, record: Any) -> None:  # engine thread, just before the final event
        self._records[record.request_id] = record

    def _on_engine_event(self, event: Any) -> None:  # engine thread
        self.requests.event(event)
        if event.finish_reason is not None:
            self._flush_record(event.request_id)

    def _flush_record(self, request_id: str) -> None:
        recorded = self._unrecorded.pop(request_id, None)
        try:
            record = self._records.pop(request_id, None)
            if record is None:
                return
            stopped_at = self._stopped_at.pop(request_id, None)
            if stopped_at is not None:
                record = record.cut(stopped_at, "stop")
            if self._on_record is not None:
                self._on_record(record)
        finally:
            if recorded is not None:
                recorded.set()

    async def recorded(self, request_id: str, timeout: float = 5.0) -> None:
        """Return once ``request_id``'s record is kept, if its caller was answered before the engine
        finished it (a stop string); at once for any other id."""
        pending = self._unrecorded.get(request_id)
        if pending is not None:
            await asyncio.to_thread(pending.wait, timeout)

    # ---- the scheduler thread --------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="switchyard-scheduler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self.scheduler.run(self._stop)
        except BaseException as err:
            # A bug in the loop, or the engine process gone: nothing will ever finish the requests in
            # flight. End each with an error event (their callers get INTERNAL, not a hang) and report
            # the server unhealthy.
            if isinstance(err, EngineProcessLost):  # its own process logged what it knew
                log.error("%s; failing %d request(s) in flight", err, len(self.requests))
            else:
                log.exception("the scheduler loop failed; failing %d request(s) in flight", len(self.requests))
            self.failed = True
            self.accepting = False
            self._fail_in_flight()
            if self._on_failure is not None:
                self._on_failure()

    def _fail_in_flight(self) -> None:
        now = time.monotonic()
        self.requests.fail_all(lambda request_id: OutputEvent(request_id, 0, None, "", "error", -1, 0, now))

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def in_flight(self) -> int:
        """Requests the engine still holds, whether or not their callers are still there."""
        return len(self.requests)

    def in_flight_ids(self) -> list[str]:
        return self.requests.ids()

    # ---- requests --------------------------------------------------------------------------------
    async def stream(self, spec: RequestSpec, *, timeout: float | None = None) -> AsyncIterator[Any]:
        """Submit ``spec`` and yield its TokenEvents; the last one has ``finish_reason`` set.

        Raises the scheduler's errors (InvalidRequestError, OutOfRangeError, QueueFullError) before
        the first event, Unavailable when not accepting, DuplicateRequestError for a request id in
        flight. Leaving the iterator early, at any point, cancels the request in the engine.
        """
        if self.failed:
            raise Unavailable("the engine loop has failed; this server is restarting")
        if not self.accepting or not self.alive:
            raise Unavailable("the server is not accepting requests (starting up or draining)")
        loop = asyncio.get_running_loop()
        pump = self._pumps.get(loop) or self._pumps.setdefault(loop, _EventPump(loop))
        events: asyncio.Queue[Any] = asyncio.Queue()
        request_id = spec.request_id
        text = TextStream(self.tokenizer, spec.stop_strings, spec.min_tokens)

        def deliver(event: Any) -> None:  # the thread that reads the engine
            out = text.push(event)
            if out is None:
                return
            if text.stopped_at is not None:
                self._stopped_at[request_id] = text.stopped_at
            if event.finish_reason is not None:
                self._flush_record(request_id)  # the trace is there before the caller sees the end
            elif text.stopped_at is not None:
                self._unrecorded[request_id] = threading.Event()  # the record comes after the caller's end
            pump.put(events, out)
            # A stop string ended it before the engine did: stop the engine's generating.
            if text.stopped_at is not None and event.finish_reason is None and self.requests.leave(request_id):
                self.scheduler.cancel(request_id)

        self.requests.take(request_id, deliver)
        deadline = None if timeout is None else time.monotonic() + timeout
        request = spec.to_generation_request(deadline=deadline, on_event=self._on_engine_event)
        finished = False
        try:
            await self._submit(request)
            while True:
                event = await events.get()
                finished = event.finish_reason is not None
                yield event
                if finished:
                    return
        finally:
            if not finished and self.requests.leave(request_id):
                # The caller went away (cancel, deadline, shutdown): the engine frees the slot at its
                # next step, and the id stays taken until it says so.
                self.scheduler.cancel(request_id)

    async def _submit(self, request: Any) -> None:
        """Hand ``request`` to the scheduler; raise its refusal (the id is then free again)."""
        try:
            # A scheduler in this process raises its validation error here; one in the engine's own
            # process (EngineProcess) answers with a future that raises it.
            accepted = self.scheduler.submit(request)
        except BaseException:
            self.requests.rejected(request.request_id)
            raise
        if accepted is None:
            return
        answer = asyncio.wrap_future(accepted)
        try:
            # Shielded: a caller that leaves now must not cancel the engine's answer, which is still
            # coming (the request may already be running there).
            await asyncio.shield(answer)
        except asyncio.CancelledError:
            answer.add_done_callback(functools.partial(self._answered_after_leaving, request.request_id))
            raise
        except BaseException:
            self.requests.rejected(request.request_id)
            raise

    def _answered_after_leaving(self, request_id: str, answer: asyncio.Future[Any]) -> None:
        """The engine's answer to a request whose caller left while waiting for it: a refusal frees the
        id (an acceptance is followed by the final event of the cancel the caller sent)."""
        if answer.cancelled() or answer.exception() is not None:
            self.requests.rejected(request_id)
