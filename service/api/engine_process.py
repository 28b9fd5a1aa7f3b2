"""The engine and its scheduler in a process of their own, seen by the server as a scheduler.

The scheduler must hold the GIL to launch each step, and the gRPC server's event loop holds it for
every message it sends. In one process the two take turns, and while the scheduler waits its turn
the devices idle: through gRPC the longest gap between two tokens read 35-130 ms where the
scheduler alone read 13 ms (benchmarks/NOTES.md). So ``switchyard serve`` runs the engine in a child
process: nothing there wants the GIL but the scheduler, and the server's process keeps the network,
the tokenizer's text conversions and the traces.

Between the two, one pipe carries pickled messages. To the engine: go ahead and load (once the server
has seen its devices), a request to begin (the
:class:`~switchyard.service.engine.scheduler.GenerationRequest` without its callback), a cancel, a
stop. To the server: the devices the child sees, then either the engine's facts (it is warm) or why
it could not start; per request, accepted or rejected (the scheduler's own validation error, raised
again here); after each engine step, every token event, finished request record and the queue, slot
and held-KV-block counts of that step, in one message.

:class:`EngineProcess` is what the server's bridge drives: ``submit`` (returns a future that the
acceptance settles), ``cancel``, and ``run(stop)``, the loop that reads the child's messages on the
bridge's thread and calls each request's ``on_event`` there, as an in-process scheduler would.
How the child builds its engine is a picklable ``builder(options) -> (engine, warm-up)``, its module
importable there: serve's from a checkpoint, a benchmark's from random weights. While it builds, the
builder may call :func:`report_startup` (loading weights, compiling N of M programs): the server keeps
the latest for ModelInfo. The child sees token ids only: text is the server's.
``prepare(options)``, when given, runs before the child looks at its devices: what must be set before
JAX starts its runtime (serve's chooses XLA's allocator; stage 0 of a pipeline group joins the group
there, as the distributed runtime must start before any device is used). Stage 0 also gives
``release(engine)``, run after a clean stop (it lets the group's other stages go).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn

from switchyard.service import errors
from switchyard.service.api.wire import Unavailable
from switchyard.service.engine.compile_cache import WarmUp
from switchyard.service.logs import quiet_known_noise
from switchyard.service.modelspec import ModelSpecError

log = logging.getLogger(__name__)

# builder(options) -> (engine, its warm-up), run in the child; picklable by reference.
Builder = Callable[[Any], tuple[Any, WarmUp]]
Prepare = Callable[[Any], None]  # prepare(options), in the child before it counts its devices
Release = Callable[[Any], None]  # release(engine), in the child after a clean stop

# The scheduler's validation errors, raised again on the server's side by name.
_REJECTIONS = {cls.__name__: cls for cls in (errors.InvalidRequestError, errors.OutOfRangeError,
                                             errors.QueueFullError, errors.DuplicateRequestError)}
STOP_TIMEOUT_S = 30.0


class EngineStartError(RuntimeError):
    """The engine process could not start its engine (the message says why)."""


class EngineProcessLost(RuntimeError):
    """The engine process ended or broke its pipe while serving."""


@dataclasses.dataclass(frozen=True)
class EngineFacts:
    """What the server needs to know of the engine: ModelInfo's sizes and the start-up log."""

    max_slots: int
    max_seq_len: int
    kv_tokens: int
    kv_block_size: int
    step_tokens: int
    warmup_s: float
    compile_cache: str  # what the warm-up compiled and what the compile cache gave


class StartupProgress(NamedTuple):
    """How far the engine's start is: ``phase`` (starting, loading weights, compiling step programs,
    ready), with ``done`` of ``total`` units where the phase counts any."""

    phase: str
    done: int = 0
    total: int = 0

    def describe(self) -> str:
        return f"{self.phase} ({self.done} of {self.total})" if self.total else self.phase


STARTING = StartupProgress("starting")
READY = "ready"


class Devices(NamedTuple):
    """The devices the engine process sees."""

    count: int
    platform: str  # "gpu", "cpu"
    kind: str  # "NVIDIA H200"

    @property
    def label(self) -> str:
        return f"{self.count}x {self.kind}"


class EngineProcess:
    """The parent's end: a scheduler to the bridge (module docstring)."""

    def __init__(self, builder: Builder, options: Any, *, prepare: Prepare | None = None,
                 release: Release | None = None, scheduler_options: dict[str, Any] | None = None,
                 log_level: str = "INFO") -> None:
        context = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA or threads
        self._conn, child_end = context.Pipe()
        # Never written: when this process ends, however it ends, the child reads EOF on it and exits,
        # also in the middle of loading or compiling.
        lifeline, self._lifeline = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_child_main,
            args=(_Recipe(builder, options, prepare, release), scheduler_options or {}, child_end, lifeline, log_level),
            name="switchyard-engine", daemon=True)
        self._process.start()
        child_end.close()
        lifeline.close()
        self._send_lock = threading.Lock()
        # request id -> its on_event, from submit until its final event or refusal (never replaced).
        self._callbacks: dict[str, Callable[[Any], None]] = {}
        self._accepting: dict[str, concurrent.futures.Future[None]] = {}
        self._requests_lock = threading.Lock()
        self.on_finish: Callable[[Any], None] | None = None  # a finished request's record (the recorder's)
        self.facts: EngineFacts | None = None
        self.startup = STARTING
        self.active_slots = 0
        self.kv_blocks_held = 0
        self.queue_depth = 0
        self._devices_seen = False

    # ---- start-up (one reader: the caller) -------------------------------------------------------
    def wait_devices(self, timeout: float | None = None) -> Devices:
        """The devices the child sees, once it has looked (it loads nothing before :meth:`wait_ready`);
        raises GroupFormationError when its ``prepare`` could not join a pipeline group."""
        kind, *rest = self._receive(timeout)
        if kind == "failed":
            raise self._start_error(*rest)
        if kind != "devices":
            raise EngineProcessLost(f"the engine process said {kind!r} before its devices")
        self._devices_seen = True
        return rest[0]

    def wait_ready(self, timeout: float | None = None) -> EngineFacts:
        """Let the child build its engine (it waits for this after counting its devices) and block
        until the engine is warm; raises ModelSpecError or EngineStartError if it cannot start."""
        kind, *rest = ("devices",) if self._devices_seen else self._receive(timeout)
        if kind == "devices":
            self._send(("load",))
            kind, *rest = self._receive(timeout)
        while kind == "startup":
            self.startup = rest[0]
            kind, *rest = self._receive(timeout)
        if kind == "failed":
            raise self._start_error(*rest)
        if kind != "ready":
            raise EngineProcessLost(f"the engine process said {kind!r} before it was ready")
        self.facts = rest[0]
        self.startup = StartupProgress(READY)
        return self.facts

    @staticmethod
    def _start_error(reason: str, message: str) -> Exception:
        return {"model": ModelSpecError, "group": errors.GroupFormationError}.get(reason, EngineStartError)(message)

    def _receive(self, timeout: float | None) -> tuple[Any, ...]:
        if not self._conn.poll(timeout):
            raise EngineStartError(f"the engine process said nothing in {timeout:.0f} s")
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            raise EngineProcessLost(f"the engine process exited (code {self._exit_code()})") from None

    # ---- as a scheduler --------------------------------------------------------------------------
    @property
    def engine(self) -> EngineFacts | None:
        """The facts, where code reads a scheduler's engine (sizes for ModelInfo and the log)."""
        return self.facts

    @property
    def max_seq_len(self) -> int:
        assert self.facts is not None
        return self.facts.max_seq_len

    @property
    def max_slots(self) -> int:
        assert self.facts is not None
        return self.facts.max_slots

    def submit(self, request: Any) -> concurrent.futures.Future[None]:
        """Send ``request`` to the engine's scheduler; the future raises its validation error, if any.
        A request id the engine still holds is refused here: its events never change hands."""
        accepted: concurrent.futures.Future[None] = concurrent.futures.Future()
        request_id = request.request_id
        with self._requests_lock:
            if request_id in self._callbacks:
                accepted.set_exception(errors.DuplicateRequestError(
                    f"request id {errors.quoted(request_id)} is already in flight"))
                return accepted
            self._callbacks[request_id] = request.on_event
            self._accepting[request_id] = accepted
        try:
            self._send(("submit", dataclasses.replace(request, on_event=None)))
        except Unavailable as err:
            with self._requests_lock:
                self._callbacks.pop(request_id, None)
                self._accepting.pop(request_id, None)
            _settle(accepted, err)
        return accepted

    def cancel(self, request_id: str) -> None:
        # A lost engine process has nothing left to cancel.
        with contextlib.suppress(Unavailable):
            self._send(("cancel", request_id))

    def run(self, stop: threading.Event) -> None:
        """Read the engine's messages until ``stop``; raises EngineProcessLost if the engine goes."""
        try:
            while not stop.is_set():
                if self._conn.poll(0.05):
                    self._handle(self._receive(None))
        except BaseException:
            with self._requests_lock:
                pending, self._accepting = self._accepting, {}
            for accepted in pending.values():
                _settle(accepted, Unavailable("the engine process is gone"))
            raise

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "step":
            _, events, records, (self.active_slots, self.queue_depth, self.kv_blocks_held) = message
            for record in records:  # before the final events: a client that sees its end finds the trace
                if self.on_finish is not None:
                    _call(self.on_finish, record, "recording a finished request")
            for event in events:
                with self._requests_lock:
                    if event.finish_reason is None:
                        callback = self._callbacks.get(event.request_id)
                    else:
                        callback = self._callbacks.pop(event.request_id, None)
                if callback is not None:
                    _call(callback, event, "delivering a token event")
        elif kind in ("accepted", "rejected"):
            request_id = message[1]
            with self._requests_lock:
                accepted = self._accepting.pop(request_id, None)
                if kind == "rejected":
                    self._callbacks.pop(request_id, None)
            if accepted is not None:
                _settle(accepted, _REJECTIONS.get(message[2], RuntimeError)(message[3]) if kind == "rejected"
                        else None)
        elif kind == "loop_failed":
            raise EngineProcessLost(f"the engine loop failed: {message[1]}")

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (BrokenPipeError, OSError):
            raise Unavailable("the engine process is gone; this server is going away") from None

    # ---- the end ---------------------------------------------------------------------------------
    def close(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the engine process (its scheduler finishes nothing more) and wait for it."""
        with contextlib.suppress(Unavailable):
            self._send(("stop",))
        self._process.join(timeout)
        if self._process.is_alive():
            log.warning("the engine process did not stop in %.0f s: terminating it", timeout)
            self._process.terminate()
            self._process.join(5)
        self._conn.close()
        self._lifeline.close()

    def _exit_code(self) -> int | None:
        self._process.join(1)
        return self._process.exitcode


def _settle(future: concurrent.futures.Future[None], error: BaseException | None) -> None:
    """Answer a submission once; a future already answered (or cancelled by a caller that gave up
    on it) is left as it is: no caller's action may end the loop that reads the engine."""
    if future.done() or not future.set_running_or_notify_cancel():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _call(callback: Callable[[Any], None], argument: Any, what: str) -> None:
    """One request's callback; its failure is logged and the loop reads on."""
    try:
        callback(argument)
    except Exception:
        log.exception("%s failed", what)


# ---- the child -----------------------------------------------------------------------------------


class _Outbox:
    """The child's end of the pipe: one message per engine step with its events and records."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._lock = threading.Lock()
        self._events: list[Any] = []
        self._records: list[Any] = []
        self._counts = (0, 0, 0)

    def event(self, event: Any) -> None:  # scheduler thread
        self._events.append(event)

    def record(self, record: Any) -> None:  # scheduler thread
        self._records.append(record)

    def flush(self, scheduler: Any) -> None:  # scheduler thread, after each step
        counts = (scheduler.active_slots, scheduler.queue_depth, scheduler.kv_blocks_held)
        if self._events or self._records or counts != self._counts:  # the counts for ModelInfo and metrics
            events, self._events = self._events, []
            records, self._records = self._records, []
            self._counts = counts
            self.send(("step", events, records, counts))

    def send(self, message: tuple[Any, ...]) -> None:
        with self._lock:
            self._conn.send(message)


@dataclasses.dataclass(frozen=True)
class _Recipe:
    """How the child makes its engine (the module docstring), each function picklable by reference."""

    build: Builder
    options: Any
    prepare: Prepare | None
    release: Release | None


def _ignore_terminal_signals() -> None:
    """A terminal's Ctrl-C, or a SIGTERM to the whole process group, reaches this process too: the
    server drains first and then stops it, and if the server is gone the lifeline ends it."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


_startup_outbox: _Outbox | None = None  # the engine's process: where report_startup sends


def report_startup(phase: str, done: int = 0, total: int = 0) -> None:
    """In the engine's process, while its builder runs: tell the server how far start-up is (nothing
    anywhere else)."""
    if _startup_outbox is not None:
        with contextlib.suppress(OSError):
            _startup_outbox.send(("startup", StartupProgress(phase, done, total)))


def _child_main(recipe: _Recipe, scheduler_options: dict[str, Any], conn: Any, lifeline: Any, log_level: str) -> None:
    global _startup_outbox
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_known_noise()
    _ignore_terminal_signals()
    threading.Thread(target=_exit_with_parent, args=(lifeline,), name="switchyard-lifeline", daemon=True).start()
    outbox = _Outbox(conn)
    try:
        if recipe.prepare is not None:
            recipe.prepare(recipe.options)
            _ignore_terminal_signals()  # the distributed runtime installs a SIGTERM handler of its own
        import jax
        from switchyard.service.engine.scheduler import Scheduler

        devices = jax.local_devices()
        outbox.send(("devices", Devices(len(devices), devices[0].platform, devices[0].device_kind)))
        if conn.recv()[0] != "load":  # the server may find the devices too few, and stop here
            _exit_now(0)
        _startup_outbox = outbox
        engine, warmup = recipe.build(recipe.options)
        _startup_outbox = None
        scheduler = Scheduler(engine, on_finish=outbox.record, **scheduler_options)
    except (EOFError, OSError):  # the server's end closed before loading
        return
    except ModelSpecError as err:  # the model or layout asks for what these devices cannot give
        outbox.send(("failed", "model", str(err)))
        return
    except errors.GroupFormationError as err:  # the pipeline group did not form: the reason, in one line
        outbox.send(("failed", "group", str(err)))
        return
    except Exception as err:
        log.exception("the engine could not start")
        outbox.send(("failed", "error", f"{type(err).__name__}: {err}"))
        return
    facts = EngineFacts(engine.max_slots, engine.max_seq_len, engine.kv_tokens, engine.kv_block_size,
                        engine.step_tokens, warmup.seconds, warmup.describe())
    stop = threading.Event()
    threading.Thread(target=_take_commands, args=(conn, scheduler, outbox, stop), name="switchyard-commands",
                     daemon=True).start()
    outbox.send(("ready", facts))
    try:
        scheduler.run(stop, after_step=lambda: outbox.flush(scheduler))
    except Exception as err:
        log.exception("the engine loop failed")
        with contextlib.suppress(OSError):
            outbox.flush(scheduler)
            outbox.send(("loop_failed", f"{type(err).__name__}: {err}"))
        _exit_now(1)
    if recipe.release is not None:
        recipe.release(engine)


def _take_commands(conn: Any, scheduler: Any, outbox: _Outbox, stop: threading.Event) -> None:
    """Requests and cancels from the server; the server's end closing (it exited) stops the engine."""
    try:
        while True:
            kind, *rest = conn.recv()
            if kind == "submit":
                request = rest[0]
                request.on_event = outbox.event
                try:
                    scheduler.submit(request)
                except Exception as err:  # a validation error, raised again by name (others as INTERNAL)
                    outbox.send(("rejected", request.request_id, type(err).__name__, str(err)))
                else:
                    outbox.send(("accepted", request.request_id))
            elif kind == "cancel":
                scheduler.cancel(rest[0])
            elif kind == "stop":
                break
    except (EOFError, OSError):
        log.warning("the server's end of the engine pipe closed: stopping")
    finally:
        stop.set()


def _exit_now(code: int) -> NoReturn:
    """End the engine process at once: an orderly exit would wait in a pipeline group's runtime for
    stages that are gone, or that are still waiting for this one."""
    logging.shutdown()
    os._exit(code)


def _exit_with_parent(lifeline: Any) -> None:
    """Wait for the server's process to end (EOF on a pipe it never writes), then end this one at once."""
    with contextlib.suppress(EOFError, OSError):
        lifeline.recv()
    log.warning("the server's process is gone: the engine process exits")
    _exit_now(1)
