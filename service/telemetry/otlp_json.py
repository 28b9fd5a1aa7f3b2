"""OTLP-JSON lines file exporters: one ``ExportTraceServiceRequest`` or ``ExportMetricsServiceRequest``
(JSON) per line.

The format is the OTLP/JSON encoding (hex trace and span ids, 64-bit integers and nanosecond times
as strings), the same the OpenTelemetry Collector's file exporter writes, so a collector's file and
ours are read by the same code (:func:`switchyard.service.telemetry.traces.read_trace_file`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind, StatusCode

# OTLP's enum numbers (opentelemetry/proto/trace/v1/trace.proto).
_KIND = {
    SpanKind.INTERNAL: 1,
    SpanKind.SERVER: 2,
    SpanKind.CLIENT: 3,
    SpanKind.PRODUCER: 4,
    SpanKind.CONSUMER: 5,
}
_STATUS = {StatusCode.UNSET: 0, StatusCode.OK: 1, StatusCode.ERROR: 2}


def any_value(value: Any) -> dict[str, Any]:
    if isinstance(value, bool):  # before int: bool is an int
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, str):
        return {"stringValue": value}
    if isinstance(value, bytes):
        return {"stringValue": value.decode("utf-8", "replace")}
    if isinstance(value, (list, tuple)):
        return {"arrayValue": {"values": [any_value(v) for v in value]}}
    return {"stringValue": str(value)}


def key_values(attributes: Any) -> list[dict[str, Any]]:
    return [{"key": k, "value": any_value(v)} for k, v in (attributes or {}).items()]


def span_json(span: ReadableSpan) -> dict[str, Any]:
    ctx = span.get_span_context()
    out: dict[str, Any] = {
        "traceId": f"{ctx.trace_id:032x}",
        "spanId": f"{ctx.span_id:016x}",
        "name": span.name,
        "kind": _KIND.get(span.kind, 0),
        "startTimeUnixNano": str(span.start_time or 0),
        "endTimeUnixNano": str(span.end_time or 0),
        "attributes": key_values(span.attributes),
    }
    if span.parent is not None:
        out["parentSpanId"] = f"{span.parent.span_id:016x}"
    if span.events:
        out["events"] = [
            {"timeUnixNano": str(e.timestamp), "name": e.name, "attributes": key_values(e.attributes)}
            for e in span.events
        ]
    if span.status.status_code is not StatusCode.UNSET:
        out["status"] = {"code": _STATUS[span.status.status_code], "message": span.status.description or ""}
    if span.dropped_attributes or span.dropped_events:
        out["droppedAttributesCount"] = span.dropped_attributes
        out["droppedEventsCount"] = span.dropped_events
    return out


def export_request_json(spans: Sequence[ReadableSpan]) -> dict[str, Any]:
    """Group spans by resource and instrumentation scope, as an ExportTraceServiceRequest."""
    by_resource: dict[int, tuple[Any, dict[tuple[str, str], list[ReadableSpan]]]] = {}
    for span in spans:
        resource_key = id(span.resource)
        _, scopes = by_resource.setdefault(resource_key, (span.resource, {}))
        scope = span.instrumentation_scope
        scopes.setdefault((scope.name if scope else "", (scope.version or "") if scope else ""), []).append(
            span
        )
    return {
        "resourceSpans": [
            {
                "resource": {"attributes": key_values(resource.attributes if resource else {})},
                "scopeSpans": [
                    {
                        "scope": {"name": name, "version": version},
                        "spans": [span_json(s) for s in scope_spans],
                    }
                    for (name, version), scope_spans in scopes.items()
                ],
            }
            for resource, scopes in by_resource.values()
        ]
    }


class _LineWriter:
    """One file, appended a line at a time by any thread; flushed after each line so that a reader
    (``switchyard trace``) can follow the file while the server runs. Exporters of one path share one
    writer (:func:`_writer`), so that lines from the span and metric exporters never interleave."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.users = 0
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by the last user

    def write(self, line: str) -> bool:
        with self._lock:
            if self._file.closed:
                return False
            self._file.write(line + "\n")
            self._file.flush()
        return True

    def close(self) -> None:
        with _writers_lock:
            self.users -= 1
            if self.users > 0:
                return
            _writers.pop(self.path, None)
        with self._lock:
            self._file.close()


_writers: dict[Path, _LineWriter] = {}
_writers_lock = threading.Lock()


def _writer(path: str | Path) -> _LineWriter:
    key = Path(path).resolve()
    with _writers_lock:
        writer = _writers.get(key) or _writers.setdefault(key, _LineWriter(key))
        writer.users += 1
        return writer


class OtlpJsonFileSpanExporter(SpanExporter):
    """Appends each exported batch of spans as one JSON line."""

    def __init__(self, path: str | Path) -> None:
        self._lines = _writer(path)
        self.path = self._lines.path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        ok = self._lines.write(json.dumps(export_request_json(spans), separators=(",", ":")))
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def shutdown(self) -> None:
        self._lines.close()


# ---- metrics -------------------------------------------------------------------------------------


def _number_point(p: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "attributes": key_values(p.attributes),
        "startTimeUnixNano": str(p.start_time_unix_nano or 0),
        "timeUnixNano": str(p.time_unix_nano),
    }
    if isinstance(p.value, int):
        out["asInt"] = str(p.value)
    else:
        out["asDouble"] = float(p.value)
    return out


def _histogram_point(p: Any) -> dict[str, Any]:
    out = {
        "attributes": key_values(p.attributes),
        "startTimeUnixNano": str(p.start_time_unix_nano),
        "timeUnixNano": str(p.time_unix_nano),
        "count": str(p.count),
        "sum": float(p.sum),
        "bucketCounts": [str(c) for c in p.bucket_counts],
        "explicitBounds": [float(b) for b in p.explicit_bounds],
    }
    if p.count:
        out["min"], out["max"] = float(p.min), float(p.max)
    return out


def metric_json(metric: Any) -> dict[str, Any]:
    from opentelemetry.sdk.metrics.export import Gauge, Histogram, Sum

    out: dict[str, Any] = {"name": metric.name, "description": metric.description or "", "unit": metric.unit or ""}
    data = metric.data
    if isinstance(data, Histogram):
        out["histogram"] = {
            "dataPoints": [_histogram_point(p) for p in data.data_points],
            "aggregationTemporality": int(data.aggregation_temporality),
        }
    elif isinstance(data, Sum):
        out["sum"] = {
            "dataPoints": [_number_point(p) for p in data.data_points],
            "aggregationTemporality": int(data.aggregation_temporality),
            "isMonotonic": bool(data.is_monotonic),
        }
    elif isinstance(data, Gauge):
        out["gauge"] = {"dataPoints": [_number_point(p) for p in data.data_points]}
    return out


def export_metrics_json(metrics_data: Any) -> dict[str, Any]:
    """MetricsData as an ExportMetricsServiceRequest."""
    return {
        "resourceMetrics": [
            {
                "resource": {"attributes": key_values(rm.resource.attributes)},
                "scopeMetrics": [
                    {
                        "scope": {"name": sm.scope.name, "version": sm.scope.version or ""},
                        "metrics": [metric_json(m) for m in sm.metrics],
                    }
                    for sm in rm.scope_metrics
                ],
            }
            for rm in metrics_data.resource_metrics
        ]
    }


class OtlpJsonFileMetricExporter(MetricExporter):
    """Appends each metric export as one JSON line (readers of spans skip these lines)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self._lines = _writer(path)

    def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        if not metrics_data.resource_metrics:
            return MetricExportResult.SUCCESS
        ok = self._lines.write(json.dumps(export_metrics_json(metrics_data), separators=(",", ":")))
        return MetricExportResult.SUCCESS if ok else MetricExportResult.FAILURE

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self._lines.close()
