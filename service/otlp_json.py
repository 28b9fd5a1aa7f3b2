"""OTLP-JSON lines file exporter for spans: one ``ExportTraceServiceRequest`` (JSON) per line.

The format is the OTLP/JSON encoding (hex trace and span ids, 64-bit integers and nanosecond times
as strings), the same the OpenTelemetry Collector's file exporter writes, so a collector's file and
ours are read by the same code (:func:`switchyard.service.traces.read_trace_file`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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


class OtlpJsonFileSpanExporter(SpanExporter):
    """Appends each exported batch as one JSON line; safe to share between processors."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in shutdown()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if not spans:
            return SpanExportResult.SUCCESS
        line = json.dumps(export_request_json(spans), separators=(",", ":"))
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            self._file.write(line + "\n")
            self._file.flush()  # a reader (switchyard trace) may tail the file while we serve
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        with self._lock:
            if not self._file.closed:
                self._file.flush()
        return True

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()
