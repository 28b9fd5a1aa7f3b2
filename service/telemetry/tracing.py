"""OpenTelemetry for the decode service: a span and metric points per finished request.

The scheduler calls :meth:`RequestRecorder.on_finish` on its own thread once per request with a
``RequestRecord`` whose per-token data are preallocated arrays. ``on_finish`` only appends the record
to a ring buffer (for the ``GetTraces`` RPC) and to a queue; a background thread turns records into
spans and histogram points, so the engine loop never waits on the SDK.

Exporters come from the standard environment: ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER``
(``otlp``, ``console``, ``none``; default ``otlp`` when an ``OTEL_EXPORTER_OTLP_*ENDPOINT`` is set,
otherwise ``none``), ``OTEL_EXPORTER_OTLP_PROTOCOL`` (``grpc`` or ``http/protobuf``), endpoints,
headers and timeouts as the exporters read them, ``OTEL_SERVICE_NAME`` / ``OTEL_RESOURCE_ATTRIBUTES``
for the resource, ``OTEL_SDK_DISABLED``. A trace file (OTLP-JSON lines: spans, and metric points every
``OTEL_METRIC_EXPORT_INTERVAL`` ms and at shutdown) can be added on top.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from switchyard.service.telemetry import traces as T
from switchyard.service.telemetry.otlp_json import OtlpJsonFileMetricExporter, OtlpJsonFileSpanExporter

log = logging.getLogger(__name__)

# Metric names: the GenAI semantic conventions' server metrics, and ours under "switchyard.".
TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token"
TIME_PER_OUTPUT_TOKEN = "gen_ai.server.time_per_output_token"
REQUEST_DURATION = "gen_ai.server.request.duration"
QUEUE_DURATION = "switchyard.server.queue.duration"
TOKENS = "switchyard.server.tokens"
ACTIVE_SLOTS = "switchyard.server.active_slots"
QUEUE_DEPTH = "switchyard.server.queue_depth"

# Bucket advice: the conventions' boundaries, extended downwards because a decode step on an HGX node
# takes a few milliseconds and the conventions' smallest time-per-token bucket is 10 ms.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (
    0.001,
    0.002,
    0.003,
    0.004,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)

_PROPAGATOR = TraceContextTextMapPropagator()

# A request span carries ~20 bytes of OTLP protobuf per output token (42 KB at 2048 tokens). The SDK's
# default export batch of 512 spans would then be ~20 MB, over the 4 MiB a collector's gRPC receiver
# takes by default; 16 spans of 8192 tokens stay under it. OTEL_BSP_MAX_EXPORT_BATCH_SIZE overrides.
DEFAULT_EXPORT_BATCH = 16


def batch_processor(exporter: SpanExporter) -> BatchSpanProcessor:
    explicit = os.environ.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE")
    return BatchSpanProcessor(exporter, max_export_batch_size=None if explicit else DEFAULT_EXPORT_BATCH)


def _exporter_names(kind: str) -> list[str]:
    explicit = os.environ.get(f"OTEL_{kind.upper()}_EXPORTER")
    if explicit is not None:
        return [n.strip() for n in explicit.split(",") if n.strip() and n.strip() != "none"]
    endpoints = ("OTEL_EXPORTER_OTLP_ENDPOINT", f"OTEL_EXPORTER_OTLP_{kind.upper()}_ENDPOINT")
    return ["otlp"] if any(os.environ.get(e) for e in endpoints) else []


def _protocol(kind: str) -> str:
    return os.environ.get(
        f"OTEL_EXPORTER_OTLP_{kind.upper()}_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    )


def span_exporters_from_env() -> list[SpanExporter]:
    exporters: list[SpanExporter] = []
    for name in _exporter_names("traces"):
        if name == "console":
            exporters.append(ConsoleSpanExporter())
        elif name == "otlp" and _protocol("traces") == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporters.append(OTLPSpanExporter())
        elif name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

            exporters.append(HttpExporter())
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER: unsupported exporter {name!r} (otlp, console, none)")
    return exporters


def metric_readers_from_env() -> list[MetricReader]:
    readers: list[MetricReader] = []
    for name in _exporter_names("metrics"):
        if name == "console":
            readers.append(PeriodicExportingMetricReader(ConsoleMetricExporter()))
        elif name == "otlp" and _protocol("metrics") == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
        elif name == "otlp":
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                OTLPMetricExporter as HttpExporter,
            )

            readers.append(PeriodicExportingMetricReader(HttpExporter()))
        else:
            raise ValueError(f"OTEL_METRICS_EXPORTER: unsupported exporter {name!r} (otlp, console, none)")
    return readers


class Telemetry:
    """Tracer and meter providers of the service, with the request span and instruments."""

    def __init__(
        self,
        *,
        span_exporters: Sequence[SpanExporter] = (),
        metric_readers: Sequence[MetricReader] = (),
        resource: Resource | None = None,
        span_processor: Callable[[SpanExporter], Any] = batch_processor,
        span_processors: Sequence[Any] = (),
    ) -> None:
        resource = resource or Resource.create(
            {"service.name": os.environ.get("OTEL_SERVICE_NAME", "switchyard")}
        )
        self.tracer_provider = TracerProvider(resource=resource)
        for exporter in span_exporters:
            self.tracer_provider.add_span_processor(span_processor(exporter))
        for processor in span_processors:
            self.tracer_provider.add_span_processor(processor)
        self.meter_provider = MeterProvider(resource=resource, metric_readers=list(metric_readers))
        self.tracer = self.tracer_provider.get_tracer("switchyard.service")
        meter = self.meter_provider.get_meter("switchyard.service")
        self.ttft = meter.create_histogram(
            TIME_TO_FIRST_TOKEN,
            unit="s",
            description="Time to generate first token for successful responses.",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS,
        )
        self.tpot = meter.create_histogram(
            TIME_PER_OUTPUT_TOKEN,
            unit="s",
            description="Time per output token generated after the first token for successful responses.",
            explicit_bucket_boundaries_advisory=TPOT_BUCKETS,
        )
        self.duration = meter.create_histogram(
            REQUEST_DURATION,
            unit="s",
            description="Request duration, arrival to the last output token.",
            explicit_bucket_boundaries_advisory=DURATION_BUCKETS,
        )
        self.queue_time = meter.create_histogram(
            QUEUE_DURATION,
            unit="s",
            description="Time a request waited for a decode slot.",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS,
        )
        self.tokens = meter.create_counter(TOKENS, unit="{token}", description="Input and output tokens.")
        self._meter = meter
        self._gauges_registered = False

    @classmethod
    def from_env(cls, trace_file: str | None = None) -> Telemetry | None:
        """None when the SDK is disabled or nothing would receive the data."""
        if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return None
        exporters: list[SpanExporter] = span_exporters_from_env()
        readers = metric_readers_from_env()
        processors = []
        if trace_file:
            # A local file is read by a person right after a request: export within half a second
            # (the SDK's default batch delay is 5 s) unless OTEL_BSP_SCHEDULE_DELAY says otherwise.
            delay = int(os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "500"))
            processors.append(BatchSpanProcessor(OtlpJsonFileSpanExporter(trace_file), schedule_delay_millis=delay))
            # Metric points go to the same file (interval: OTEL_METRIC_EXPORT_INTERVAL, default 60 s,
            # plus a last export at shutdown).
            readers.append(PeriodicExportingMetricReader(OtlpJsonFileMetricExporter(trace_file)))
        if not exporters and not readers:
            return None
        return cls(span_exporters=exporters, metric_readers=readers, span_processors=processors)

    def observe_scheduler(self, sample: Callable[[], tuple[int, int]]) -> None:
        """Register gauges read at collection time: ``sample()`` -> (active slots, queue depth)."""
        if self._gauges_registered:
            return
        self._gauges_registered = True

        def active(_: CallbackOptions) -> Iterable[Observation]:
            yield Observation(sample()[0])

        def depth(_: CallbackOptions) -> Iterable[Observation]:
            yield Observation(sample()[1])

        self._meter.create_observable_gauge(
            ACTIVE_SLOTS, [active], unit="{request}", description="Decode slots in use."
        )
        self._meter.create_observable_gauge(
            QUEUE_DEPTH, [depth], unit="{request}", description="Requests waiting for a slot."
        )

    def record(self, trace: T.RequestTrace, request: dict[str, Any], parent: Any = None) -> None:
        """One span (start = arrival, end = final event) and the metric points of a finished request."""
        attrs: dict[str, Any] = {
            T.OPERATION: T.OPERATION_NAME,
            T.REQUEST_MODEL: trace.model,
            T.RESPONSE_MODEL: trace.model,
            T.RESPONSE_ID: trace.request_id,
            T.INPUT_TOKENS: trace.prompt_tokens,
            T.OUTPUT_TOKENS: trace.output_tokens,
            T.FINISH_REASONS: [trace.finish_reason],
            T.MAX_TOKENS: trace.max_tokens,
            **request,
            **trace.span_attributes(),
        }
        failed = trace.finish_reason == "error"
        if failed:
            attrs["error.type"] = "engine_error"
        start = trace.start_unix_nano
        end = start + int(trace.duration_s * 1e9)
        span = self.tracer.start_span(
            f"{T.OPERATION_NAME} {trace.model}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes=attrs,
            start_time=start,
        )
        span.add_event("admitted", timestamp=start + int(trace.queue_s * 1e9))
        # Trace viewers show events on the span's time line; the SDK keeps the first 128 events of a
        # span, so a prompt in more chunks loses the last ones here but never in the chunk arrays.
        for at, step, tokens in zip(trace.chunk_s, trace.chunk_steps, trace.chunk_tokens, strict=True):
            span.add_event(
                T.CHUNK_EVENT,
                {T.CHUNK_STEP: int(step), T.CHUNK_TOKENS: int(tokens)},
                timestamp=start + int(at * 1e9),
            )
        if trace.ttft_s is not None:
            span.add_event("first_token", timestamp=start + int(trace.ttft_s * 1e9))
        if failed:
            span.set_status(Status(StatusCode.ERROR, "engine error"))
        span.end(end_time=end)

        metric_attrs = {T.OPERATION: T.OPERATION_NAME, T.REQUEST_MODEL: trace.model}
        if failed:
            metric_attrs["error.type"] = "engine_error"
        self.duration.record(trace.duration_s, metric_attrs)
        self.queue_time.record(trace.queue_s, metric_attrs)
        self.tokens.add(trace.prompt_tokens, {**metric_attrs, "gen_ai.token.type": "input"})
        self.tokens.add(trace.output_tokens, {**metric_attrs, "gen_ai.token.type": "output"})
        # The conventions define these two for successful responses only.
        if not failed and trace.ttft_s is not None:
            self.ttft.record(trace.ttft_s, metric_attrs)
            if trace.output_tokens > 1:
                per_token = (trace.token_s[-1] - trace.token_s[0]) / (trace.output_tokens - 1)
                self.tpot.record(float(per_token), metric_attrs)

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def parent_context(metadata: Iterable[tuple[str, Any]] | None) -> Any:
    """The caller's trace context from W3C ``traceparent`` gRPC metadata, or None."""
    carrier = {k: v for k, v in (metadata or ()) if k in ("traceparent", "tracestate") and isinstance(v, str)}
    if "traceparent" not in carrier:
        return None
    ctx = _PROPAGATOR.extract(carrier)
    return None if ctx == otel_context.Context() else ctx


def _sampling_attributes(sampling: Any) -> dict[str, Any]:
    return {
        T.TEMPERATURE: float(sampling.temperature),
        T.TOP_K: int(sampling.top_k),
        T.TOP_P: float(sampling.top_p),
        T.SEED: int(sampling.seed),
    }


class RequestRecorder:
    """The scheduler's ``on_finish`` sink: recent traces in memory, spans and metrics in the background."""

    def __init__(self, telemetry: Telemetry | None = None, *, keep: int = 256) -> None:
        self.telemetry = telemetry
        # What every span also says of the engine that served it (the weights' and KV cache's
        # formats), once the engine is known.
        self.served: dict[str, str] = {}
        # Monotonic -> wall clock, sampled once: spans of one process stay consistent with each other.
        self.wall_offset_ns = time.time_ns() - time.monotonic_ns()
        self._recent: collections.deque[Any] = collections.deque(maxlen=keep)
        self._parents: dict[str, Any] = {}
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self._lock = threading.Lock()
        self._sinks: list[Callable[[Any], None]] = []
        if telemetry is not None:
            self._start()

    def _start(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._run, name="switchyard-telemetry", daemon=True)
            self._worker.start()

    def add_sink(self, sink: Callable[[Any], None]) -> None:
        """``sink(record)`` for every finished request, on the background thread (Prometheus metrics:
        the scheduler's thread only appends)."""
        self._sinks.append(sink)
        self._start()

    def set_parent(self, request_id: str, parent: Any) -> None:
        """Remember the caller's trace context so the request span joins the caller's trace."""
        if parent is not None and self.telemetry is not None:
            self._parents[request_id] = parent

    def forget(self, request_id: str) -> None:
        self._parents.pop(request_id, None)

    def on_finish(self, record: Any) -> None:
        # Runs on the scheduler thread: two appends, nothing else.
        self._recent.append(record)
        if self._worker is not None:
            with self._lock:
                self._pending += 1
                self._idle.clear()
            self._queue.put(record)

    def _run(self) -> None:
        while True:
            record = self._queue.get()
            if record is None:
                return
            try:
                for sink in self._sinks:
                    sink(record)
                if self.telemetry is not None:
                    trace = T.RequestTrace.from_record(record, self.wall_offset_ns)
                    parent = self._parents.pop(trace.request_id, None)
                    self.telemetry.record(trace, {**_sampling_attributes(record.sampling), **self.served}, parent)
            except Exception:  # a broken record must not stop telemetry for every later request
                log.exception("could not export the trace of request %s", getattr(record, "request_id", "?"))
            finally:
                with self._lock:
                    self._pending -= 1
                    if self._pending == 0:
                        self._idle.set()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every finished request has reached the SDK, then flush its exporters."""
        done = self._idle.wait(timeout)
        if self.telemetry is not None:
            self.telemetry.tracer_provider.force_flush(int(timeout * 1000))
            self.telemetry.meter_provider.force_flush(int(timeout * 1000))
        return done

    def recent(self, request_id: str = "", limit: int = 0) -> list[T.RequestTrace]:
        records = list(self._recent)
        if request_id:
            records = [r for r in records if r.request_id == request_id]
        if limit:
            records = records[-limit:]
        return [T.RequestTrace.from_record(r, self.wall_offset_ns) for r in records]

    def close(self) -> None:
        if self._worker is not None:
            self.flush()
            self._queue.put(None)
            self._worker.join(timeout=10)
            self._worker = None
        if self.telemetry is not None:
            self.telemetry.shutdown()
