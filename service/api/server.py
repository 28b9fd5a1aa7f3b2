"""The decode service: ``switchyard.v1.Decode``, KServe v2, health and reflection on the gRPC port, and
the OpenAI-compatible HTTP API with ``/health`` and ``/metrics`` on the HTTP port (``http/``).

:class:`DecodeApp` holds what the handlers share (tokenizer, scheduler bridge, limits, traces);
:func:`build_server` puts every service on a ``grpc.aio`` server; :func:`serve` is the pod's whole
life: listen at once (both ports) with health NOT_SERVING, load and warm the model, report SERVING,
and on SIGTERM drain (NOT_SERVING, refuse new calls, let in-flight streams of either protocol finish
within the grace period).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import signal
import sys
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from switchyard.service.api import kserve, parsing
from switchyard.service.api.bridge import EngineBridge
from switchyard.service.api.engine_process import EngineStartError
from switchyard.service.api.http.app import HttpFrontEnd
from switchyard.service.api.http.chat_template import ChatTemplate
from switchyard.service.api.http.metrics import Metrics
from switchyard.service.api.tokenizing import PromptEncoder, TextPool
from switchyard.service.api.wire import (
    Limits,
    RequestSpec,
    Unavailable,
    check_final_event,
    from_generate_request,
    status_for,
)
from switchyard.service.errors import quoted
from switchyard.service.modelspec import ModelSpecError
from switchyard.service.proto import decode_pb2, decode_pb2_grpc
from switchyard.service.telemetry import tracing
from switchyard.service.telemetry.traces import RequestTrace

log = logging.getLogger(__name__)

DECODE_SERVICE = decode_pb2.DESCRIPTOR.services_by_name["Decode"].full_name
HEALTH_SERVICES = ("", DECODE_SERVICE, kserve.SERVICE)
# serve()'s exit status when stopped (SIGTERM / SIGINT) before the model was loaded; the loading
# thread is still running, so the process should end at once (os._exit) rather than wait for it.
STOPPED_WHILE_LOADING = 130
CUT_IDS_LOGGED = 20  # request ids named in the log line of a drain that ran out of time
# A request ends this long before its call's deadline, so that its last message is not written just
# as gRPC ends the call: the client is told "deadline passed after N tokens" by us, not by a race.
DEADLINE_MARGIN_S = 0.05
_FINISH = {"stop": decode_pb2.FINISH_REASON_STOP, "length": decode_pb2.FINISH_REASON_LENGTH}


class DecodeApp:
    """State shared by the Decode, KServe and HTTP handlers. Not ready until :meth:`attach`."""

    def __init__(
        self,
        *,
        model_name: str,
        limits: Limits | None = None,
        recorder: tracing.RequestRecorder | None = None,
        info: dict[str, Any] | None = None,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        self.model_name = model_name
        self.limits = limits or Limits()
        self.recorder = recorder or tracing.RequestRecorder()
        self.info = info or {}  # tensor_parallel, allreduce_strategy, max_queue for ModelInfo
        self.chat_template = chat_template or ChatTemplate.missing("this server was started without a chat template")
        # Prometheus metrics from the same finished-request records as the traces (http/metrics.py).
        self.metrics = Metrics(model_name)
        self.recorder.add_sink(functools.partial(self.metrics.observe, wall_offset_ns=self.recorder.wall_offset_ns))
        self.health = health.aio.HealthServicer()
        self.failed: asyncio.Event | None = None  # set if the scheduler loop dies
        self.tokenizer: Any = None
        self.encoder: PromptEncoder | None = None  # the tokenizer as request conversion uses it
        self.text_pool = TextPool()
        self.bridge: EngineBridge | None = None
        self.ready = False
        # How far the engine's start is, as (phase, done, total); serve's reads its engine process.
        self.startup: Callable[[], tuple[str, int, int]] | None = None

    async def set_health(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in HEALTH_SERVICES:
            await self.health.set(name, status)

    async def attach(self, scheduler: Any, tokenizer: Any) -> None:
        """Start serving ``scheduler`` (a Scheduler or an EngineProcess; its finished records go to the
        recorder through the bridge), with ``tokenizer`` for text."""
        self.tokenizer = tokenizer
        self.encoder = PromptEncoder(tokenizer, scheduler.max_seq_len - 1)
        loop = asyncio.get_running_loop()

        self.failed = asyncio.Event()

        def on_failure() -> None:  # scheduler thread: the loop died; report it, let serve() exit
            self.ready = False
            asyncio.run_coroutine_threadsafe(self.set_health(False), loop)
            loop.call_soon_threadsafe(self.failed.set)

        self.bridge = EngineBridge(scheduler, tokenizer, on_failure=on_failure, on_record=self.recorder.on_finish)
        self.bridge.start()
        if self.recorder.telemetry is not None:
            self.recorder.telemetry.observe_scheduler(lambda: (scheduler.active_slots, scheduler.queue_depth))
        self.metrics.counts = functools.partial(scheduler_counts, scheduler)
        self.ready = True
        await self.set_health(True)

    async def drain(self) -> None:
        """Stop taking requests: NOT_SERVING for every service, new calls get UNAVAILABLE."""
        self.ready = False
        if self.bridge is not None:
            self.bridge.accepting = False
        await self.health.enter_graceful_shutdown()

    async def finish_in_flight(self, server: grpc.aio.Server, grace: float) -> int:
        """After :meth:`drain`: wait up to ``grace`` for the accepted generations, then stop the
        server. Not ``server.stop(grace)`` alone: long-lived calls that are not generations (a health
        Watch, an idle KServe stream) would hold the process for the whole grace period. Returns how
        many accepted generations the grace period cut short (each is logged)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self.bridge is not None and self.bridge.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        cut = self.bridge.in_flight_ids() if self.bridge is not None else []
        if cut:
            shown = ", ".join(quoted(request_id) for request_id in cut[:CUT_IDS_LOGGED])
            more = f" and {len(cut) - CUT_IDS_LOGGED} more" if len(cut) > CUT_IDS_LOGGED else ""
            log.warning("the drain grace period (%.1f s) ran out: cutting %d unfinished request(s): %s%s",
                        grace, len(cut), shown, more)
        # A moment for the last messages to reach their clients, then cancel whatever is left.
        await server.stop(min(1.0, max(0.0, deadline - loop.time())))
        return len(cut)

    def close(self) -> None:
        if self.bridge is not None:
            self.bridge.stop()
        self.text_pool.close()
        self.recorder.close()

    # ---- helpers for handlers --------------------------------------------------------------------
    def message_for(self, err: BaseException) -> str:
        code, text = status_for(err)
        if code is grpc.StatusCode.INTERNAL:
            log.error("request failed", exc_info=err)
        return text

    async def abort_for(self, err: BaseException, context: grpc.aio.ServicerContext) -> None:
        """End the call with ``err``'s status; a call that gRPC has already ended (the client
        cancelled, its deadline passed) is not answered: the handler just stops."""
        code, text = status_for(err)
        if code is grpc.StatusCode.INTERNAL:
            log.error("request failed", exc_info=err)
        if context.done():
            raise asyncio.CancelledError
        await context.abort(code, text)

    async def convert(self, convert: Callable[..., Any], request: Any, *args: Any) -> Any:
        """``convert(request, encoder, limits, *args)``: a wire request to what the scheduler takes,
        in the text pool (``tokenizing.py``: tokenizing up to a megabyte of text never holds up the
        streams being served). Its size was checked before it was parsed (``parsing.py``)."""
        self.require_ready()
        return await self.text_pool.run(parsing.request_bytes(), convert, request, self.encoder, self.limits, *args)

    @property
    def max_seq_len(self) -> int | None:
        return None if self.bridge is None else self.bridge.scheduler.max_seq_len

    def require_ready(self) -> None:
        if self.bridge is not None and self.bridge.failed:
            raise Unavailable("the engine loop has failed; this server is going away")
        if not self.ready or self.bridge is None:
            raise Unavailable("the model is not ready (loading, or the server is draining)")

    async def events(self, spec: RequestSpec, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """:meth:`generate` for a gRPC call: the call's deadline becomes the request's (for a KServe
        stream, the whole stream's), its ``traceparent`` metadata the span's parent."""
        async with contextlib.aclosing(self.generate(
                spec, timeout=request_timeout(context.time_remaining()),
                parent=tracing.parent_context(context.invocation_metadata()))) as events:
            async for event in events:
                yield event

    async def generate(self, spec: RequestSpec, *, timeout: float | None, parent: Any = None) -> AsyncIterator[Any]:
        """OutputEvents of ``spec`` (any protocol); raises GenerationEnded for deadline / error / cancel
        finishes. Leaving early cancels the request in the engine."""
        self.require_ready()
        assert self.bridge is not None
        self.recorder.set_parent(spec.request_id, parent)
        try:
            async with contextlib.aclosing(self.bridge.stream(spec, timeout=timeout)) as events:
                async for event in events:
                    check_final_event(event, spec.request_id)
                    yield event
        except BaseException:
            self.recorder.forget(spec.request_id)
            raise


class DecodeService(decode_pb2_grpc.DecodeServicer):
    def __init__(self, app: DecodeApp) -> None:
        self.app = app

    async def _spec(self, request: Any, context: grpc.aio.ServicerContext) -> RequestSpec:
        try:
            self.app.require_ready()
            assert self.app.bridge is not None
            return await self.app.convert(from_generate_request, request, self.app.max_seq_len)
        except Exception as err:
            await self.app.abort_for(err, context)
            raise  # not reached: abort raises

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        spec = await self._spec(request, context)
        produced = 0
        try:
            async with contextlib.aclosing(self.app.events(spec, context)) as events:
                async for event in events:
                    response = decode_pb2.GenerateResponse(
                        request_id=spec.request_id,
                        index=event.index,
                        text=event.text,
                        step=event.step,
                        batch_size=event.batch_size,
                    )
                    if event.token_id is not None:
                        response.token_ids.append(event.token_id)
                        produced += 1
                    if event.finish_reason is not None:
                        response.finish_reason = _FINISH[event.finish_reason]
                        response.usage.input_tokens = len(spec.prompt_ids)
                        response.usage.output_tokens = produced
                    yield response
        except Exception as err:
            await self.app.abort_for(err, context)

    async def GenerateUnary(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        spec = await self._spec(request, context)
        response = decode_pb2.GenerateUnaryResponse(request_id=spec.request_id)
        pieces = []
        try:
            async with contextlib.aclosing(self.app.events(spec, context)) as events:
                async for event in events:
                    pieces.append(event.text)
                    if event.token_id is not None:
                        response.token_ids.append(event.token_id)
                    if event.finish_reason is not None:
                        response.finish_reason = _FINISH[event.finish_reason]
        except Exception as err:
            await self.app.abort_for(err, context)
        response.text = "".join(pieces)
        response.usage.input_tokens = len(spec.prompt_ids)
        response.usage.output_tokens = len(response.token_ids)
        return response

    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            ids = await self.app.convert(lambda r, encoder, _: encoder.encode_any(r.text), request)
        except Exception as err:
            await self.app.abort_for(err, context)
        return decode_pb2.TokenizeResponse(token_ids=ids)

    async def ModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        app = self.app
        response = decode_pb2.ModelInfoResponse(
            model_name=app.model_name,
            ready=app.ready,
            default_max_tokens=app.limits.default_max_tokens,
            tensor_parallel=int(app.info.get("tensor_parallel", 0)),
            allreduce_strategy=str(app.info.get("allreduce_strategy", "")),
            max_queue=int(app.info.get("max_queue", 0)),
            compile_cache=str(app.info.get("compile_cache", "")),
            weights=str(app.info.get("weights", "")),
            kv_cache=str(app.info.get("kv_cache", "")),
        )
        phase, done, total = ("ready", 0, 0) if app.ready else app.startup() if app.startup else ("starting", 0, 0)
        response.startup, response.startup_done, response.startup_total = phase, done, total
        if app.bridge is not None and app.tokenizer is not None:
            s = app.bridge.scheduler
            response.max_seq_len = s.max_seq_len
            response.batch_slots = s.max_slots
            response.active_slots = s.active_slots
            response.queue_depth = s.queue_depth
            response.vocab_size = app.tokenizer.vocab_size
            response.eos_token_ids.extend(app.tokenizer.eos_token_ids)
            response.kv_tokens = s.engine.kv_tokens
            response.kv_block_size = s.engine.kv_block_size
            response.step_tokens = s.engine.step_tokens
            response.kv_blocks_held = s.kv_blocks_held
        return response

    async def GetTraces(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request.request_id and self.app.bridge is not None:
            await self.app.bridge.recorded(request.request_id)
        found = self.app.recorder.recent(request.request_id, request.limit)
        if request.request_id and not found:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no finished request {quoted(request.request_id)} among the last ones kept by this server",
            )
        return decode_pb2.GetTracesResponse(traces=[trace_to_proto(t) for t in found])


def scheduler_counts(scheduler: Any) -> tuple[int, int, int, int, int] | None:
    """(running, waiting, KV blocks held, KV blocks in the pool, block size) of a Scheduler or an
    EngineProcess (whose counts come with every step's message), for the metrics' gauges."""
    engine = scheduler.engine
    if engine is None:
        return None
    block = int(engine.kv_block_size)
    return (int(scheduler.active_slots), int(scheduler.queue_depth), int(scheduler.kv_blocks_held),
            int(engine.kv_tokens) // block if block else 0, block)


def request_timeout(remaining: float | None) -> float | None:
    """The request's time from its call's (``DEADLINE_MARGIN_S`` before the call's own deadline)."""
    return None if remaining is None else max(0.0, remaining - DEADLINE_MARGIN_S)


class _EndedCallFilter(logging.Filter):
    """gRPC logs a traceback at ERROR when a handler writes to a call that gRPC itself has just ended
    (its deadline passed between the handler's check and its write). Nobody is there to answer and
    the server is not at fault, so the record is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("ExecuteBatchError raised in core")


def _quiet_ended_calls() -> None:
    grpc_log = logging.getLogger("grpc._cython.cygrpc")
    if not any(isinstance(f, _EndedCallFilter) for f in grpc_log.filters):
        grpc_log.addFilter(_EndedCallFilter())


def engine_summary(engine: Any) -> str:
    """What the start-up log says of the engine: slots, context, the KV pool and how prompts go in."""
    prompts = (
        f"prompts in chunks of up to {engine.step_tokens} tokens per step"
        if engine.step_tokens
        else "prompts prefilled whole"
    )
    return (
        f"{engine.max_slots} slots, context {engine.max_seq_len} tokens, KV pool {engine.kv_tokens} tokens "
        f"in blocks of {engine.kv_block_size}, {prompts}"
    )


def trace_to_proto(t: RequestTrace) -> Any:
    return decode_pb2.RequestTrace(
        request_id=t.request_id,
        model=t.model,
        prompt_tokens=t.prompt_tokens,
        finish_reason=t.finish_reason,
        start_unix_nano=t.start_unix_nano,
        queue_seconds=t.queue_s,
        prefill_seconds=t.prefill_s,
        duration_seconds=t.duration_s,
        token_seconds=t.token_s.tolist(),
        token_steps=t.steps.tolist(),
        token_batch_sizes=t.batch_sizes.tolist(),
        max_tokens=t.max_tokens,
        chunk_seconds=t.chunk_s.tolist(),
        chunk_steps=t.chunk_steps.tolist(),
        chunk_tokens=t.chunk_tokens.tolist(),
        cached_tokens=t.cached_tokens,
        preemptions=t.preemptions,
    )


def trace_from_proto(m: Any) -> RequestTrace:
    import numpy as np

    return RequestTrace(
        request_id=m.request_id,
        model=m.model,
        prompt_tokens=m.prompt_tokens,
        finish_reason=m.finish_reason,
        start_unix_nano=m.start_unix_nano,
        queue_s=m.queue_seconds,
        prefill_s=m.prefill_seconds,
        duration_s=m.duration_seconds,
        token_s=np.asarray(m.token_seconds, np.float64),
        steps=np.asarray(m.token_steps, np.int64),
        batch_sizes=np.asarray(m.token_batch_sizes, np.int32),
        max_tokens=m.max_tokens,
        chunk_s=np.asarray(m.chunk_seconds, np.float64),
        chunk_steps=np.asarray(m.chunk_steps, np.int64),
        chunk_tokens=np.asarray(m.chunk_tokens, np.int32),
        cached_tokens=m.cached_tokens,
        preemptions=m.preemptions,
    )


def reflection_pool() -> Any:
    """One descriptor pool with every service we serve, for server reflection (grpcurl)."""
    from google.protobuf import descriptor_pool
    from grpc_reflection.v1alpha import reflection_pb2

    pool = descriptor_pool.DescriptorPool()
    for module in (decode_pb2, health_pb2, reflection_pb2):
        pool.AddSerializedFile(module.DESCRIPTOR.serialized_pb)
    from switchyard.service.proto import kserve_descriptor

    pool.AddSerializedFile(kserve_descriptor.SERIALIZED)
    return pool


def build_server(app: DecodeApp, *, options: list[tuple[str, Any]] | None = None) -> grpc.aio.Server:
    _quiet_ended_calls()
    # gRPC rejects messages above its transport limit with RESOURCE_EXHAUSTED before parsing them;
    # keep it well above our own limit so that ordinary oversize prompts get our INVALID_ARGUMENT.
    transport_limit = max(4 * app.limits.max_request_bytes, 4 << 20)
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", transport_limit),
            ("grpc.so_reuseport", 0),
            *(options or []),
        ]
    )
    server.add_generic_rpc_handlers((parsing.service_handler(
        decode_pb2.DESCRIPTOR.services_by_name["Decode"], DecodeService(app),
        lambda descriptor: getattr(decode_pb2, descriptor.name), app.limits.max_request_bytes),))
    server.add_generic_rpc_handlers((kserve.KServeService(app).handler(app.limits.max_request_bytes),))
    health_pb2_grpc.add_HealthServicer_to_server(app.health, server)
    names = (DECODE_SERVICE, kserve.SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server, pool=reflection_pool())
    return server


def tune_interpreter(switch_interval: float | None = None) -> None:
    """CPython's GIL switch interval for the server's process (5 ms by default): how long a thread
    that wants the GIL waits before the one holding it is asked to let go. It mattered most while the
    scheduler shared this process; ``benchmarks/serve.py --switch-interval`` measures it. None: CPython's."""
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)


@dataclasses.dataclass
class ServeOptions:
    host: str = "[::]"
    port: int = 8001
    grace_period: float = 30.0
    http_port: int | None = 8000  # the OpenAI-compatible HTTP API, /health and /metrics; None: none


async def serve(
    app: DecodeApp,
    load: Callable[[], tuple[Any, Any]],
    options: ServeOptions,
    *,
    stop: asyncio.Event | None = None,
    on_listening: Callable[[int], None] | None = None,
) -> int:
    """Run until SIGTERM/SIGINT (or ``stop``): listen, load with ``load() -> (scheduler, tokenizer)``
    in a worker thread, serve, drain. Returns the process exit code."""
    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    server = build_server(app)
    try:
        port = server.add_insecure_port(f"{options.host}:{options.port}")
    except RuntimeError:  # recent grpcio raises where older versions returned 0
        port = 0
    if port == 0:
        log.error("could not listen on %s:%s (the port is in use, or the host is not an address of this machine)",
                  options.host, options.port)
        return 1
    await app.set_health(False)
    await server.start()
    http = HttpFrontEnd(app)
    if options.http_port is not None:
        try:
            http_port = await http.start(options.host, options.http_port)
        except OSError as err:
            log.error("could not listen for HTTP on %s:%s: %s", options.host, options.http_port, err.strerror or err)
            await server.stop(0)
            return 1
        log.info("HTTP (OpenAI API, /health, /metrics) on %s:%d", options.host, http_port)
    log.info("listening on %s:%d (NOT_SERVING until the model is warm)", options.host, port)
    if on_listening is not None:
        on_listening(port)
    loader = _in_daemon_thread(load, "switchyard-load")
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loader, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if not loader.done():
        # Loading and compiling cannot be interrupted; the caller exits without waiting for them.
        log.warning("stopped while loading the model")
        await server.stop(0)
        await http.stop()
        return STOPPED_WHILE_LOADING
    try:
        scheduler, tokenizer = loader.result()
    except (ModelSpecError, EngineStartError) as err:  # what these devices cannot give; the engine process's reason
        log.error("loading the model failed: %s", err)
        await server.stop(0)
        await http.stop()
        return 1
    except Exception:
        log.exception("loading the model failed")
        await server.stop(0)
        await http.stop()
        return 1
    await app.attach(scheduler, tokenizer)
    log.info("serving %s: %s", app.model_name, engine_summary(scheduler.engine))
    assert app.failed is not None
    failure = asyncio.ensure_future(app.failed.wait())
    await asyncio.wait({waiter, failure}, return_when=asyncio.FIRST_COMPLETED)
    if failure.done():
        log.error("the engine loop failed: stopping so that the pod restarts")
        await app.drain()
        await app.finish_in_flight(server, 1.0)
        await http.stop()
        await asyncio.to_thread(app.close)
        return 1
    failure.cancel()
    log.info(
        "draining: %d request(s) in flight, grace period %.0f s",
        app.bridge.in_flight if app.bridge else 0,
        options.grace_period,
    )
    await app.drain()
    cut = await app.finish_in_flight(server, options.grace_period)
    await http.stop()
    await asyncio.to_thread(app.close)
    if cut:
        log.error("stopped with %d request(s) cut short by the drain grace period", cut)
        return 1
    log.info("stopped")
    return 0


def _in_daemon_thread(fn: Callable[[], Any], name: str) -> asyncio.Future[Any]:
    """``fn()`` in a daemon thread, as a future of the running loop. Not the loop's default executor:
    ``asyncio.run`` waits for that executor's threads at exit, so a stop during a long compile would
    wait for the whole compile."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(outcome: Callable[[], None]) -> None:
        if not future.done():
            outcome()

    def run() -> None:
        try:
            result = fn()
        except BaseException as err:  # handed to the loop, which re-raises it in serve()
            outcome = functools.partial(future.set_exception, err)
        else:
            outcome = functools.partial(future.set_result, result)
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
            loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class ServerThread:
    """A server on its own event-loop thread, for tests and benchmarks in one process."""

    def __init__(self, app: DecodeApp, scheduler: Any, tokenizer: Any, *, host: str = "127.0.0.1",
                 http: bool = False) -> None:
        self.app = app
        self._started = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._server: grpc.aio.Server | None = None
        self._http = HttpFrontEnd(app) if http else None
        self.port = 0
        self.http_port = 0
        self._thread = threading.Thread(
            target=self._run, args=(scheduler, tokenizer, host), name="switchyard-grpc", daemon=True
        )
        self._thread.start()
        if not self._started.wait(60):
            raise RuntimeError("the gRPC server did not start")

    def _run(self, scheduler: Any, tokenizer: Any, host: str) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> None:
            self._server = build_server(self.app)
            self.port = self._server.add_insecure_port(f"{host}:0")
            await self._server.start()
            if self._http is not None:
                self.http_port = await self._http.start(host, 0)
            await self.app.attach(scheduler, tokenizer)
            self._started.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()
        self._loop.close()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def call(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self, grace: float | None = 5.0) -> None:
        async def shutdown() -> None:
            await self.app.drain()
            assert self._server is not None
            await self.app.finish_in_flight(self._server, grace or 0.0)
            if self._http is not None:
                await self._http.stop()

        self.call(shutdown())
        self.app.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
