"""Per-request spans (GenAI semantic conventions + per-token arrays), metrics, the OTLP-JSON file,
and the trace file's round trip through ``switchyard trace``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from switchyard.cli import trace as trace_cli
from switchyard.service.engine.sampling import SamplingParams
from switchyard.service.engine.scheduler import RequestRecord
from switchyard.service.telemetry import traces as T
from switchyard.service.telemetry import tracing
from switchyard.service.telemetry.otlp_json import OtlpJsonFileSpanExporter


def record(n: int = 1000, *, finish: str = "length", request_id: str = "r-1", admitted: bool = True) -> RequestRecord:
    t0 = 1000.0
    times = t0 + 0.020 + 0.005 * np.arange(n) + 0.0001 * (np.arange(n) % 7)  # first token at +20 ms
    return RequestRecord(
        request_id=request_id, prompt_tokens=11, token_ids=np.arange(n, dtype=np.int32),
        token_times=times, token_steps=np.arange(n, dtype=np.int64) - 1,
        token_batch_sizes=(1 + np.arange(n) % 5).astype(np.int32), t_submit=t0,
        t_admit=t0 + 0.004 if admitted else float("nan"), t_first_token=times[0] if n else float("nan"),
        t_end=(times[-1] if n else t0 + 0.01) + 0.0002, finish_reason=finish, model="tiny",
        sampling=SamplingParams(temperature=0.5, top_k=10, top_p=0.9, seed=3), max_tokens=n or 4,
    )


@pytest.fixture
def telemetry():
    spans, metrics = InMemorySpanExporter(), InMemoryMetricReader()
    tel = tracing.Telemetry(span_exporters=[spans], metric_readers=[metrics], span_processor=SimpleSpanProcessor)
    yield tel, spans, metrics
    tel.shutdown()


def _metric_points(reader: InMemoryMetricReader) -> dict[str, list]:
    out: dict[str, list] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                out.setdefault(metric.name, []).extend(metric.data.data_points)
    return out


def test_request_span_follows_genai_conventions_and_carries_every_token(telemetry) -> None:
    tel, spans, metrics = telemetry
    recorder = tracing.RequestRecorder(tel)
    recorder.on_finish(record(1000))
    assert recorder.flush()
    (span,) = spans.get_finished_spans()
    assert span.name == "text_completion tiny" and span.kind is SpanKind.SERVER
    a = span.attributes
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.model"] == "tiny"
    assert a["gen_ai.usage.input_tokens"] == 11 and a["gen_ai.usage.output_tokens"] == 1000
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.request.top_k"] == 10
    # The per-token record: arrays, not 1000 events (the SDK keeps only 128 events per span).
    assert len(a[T.TOKEN_GAP_MS]) == len(a[T.TOKEN_STEP]) == len(a[T.TOKEN_BATCH]) == 1000
    assert [e.name for e in span.events] == ["admitted", "first_token"] and span.dropped_events == 0
    assert a[T.TOKEN_GAP_MS][0] == pytest.approx(20.0) and a[T.TOKEN_GAP_MS][1] == pytest.approx(5.1)
    assert a[T.QUEUE_MS] == pytest.approx(4.0) and a[T.PREFILL_MS] == pytest.approx(16.0)
    assert (span.end_time - span.start_time) / 1e9 == pytest.approx(record(1000).t_end - 1000.0, abs=1e-6)

    points = _metric_points(metrics)
    (ttft,) = points[tracing.TIME_TO_FIRST_TOKEN]
    assert ttft.count == 1 and ttft.sum == pytest.approx(0.020)
    (tpot,) = points[tracing.TIME_PER_OUTPUT_TOKEN]
    r = record(1000)
    assert tpot.sum == pytest.approx((r.token_times[-1] - r.token_times[0]) / 999)
    assert points[tracing.REQUEST_DURATION][0].sum == pytest.approx(r.t_end - r.t_submit)
    assert points[tracing.QUEUE_DURATION][0].sum == pytest.approx(0.004)
    tokens = {p.attributes["gen_ai.token.type"]: p.value for p in points[tracing.TOKENS]}
    assert tokens == {"input": 11, "output": 1000}
    assert ttft.attributes == {"gen_ai.operation.name": "text_completion", "gen_ai.request.model": "tiny"}
    recorder.close()


def test_every_span_says_which_formats_the_engine_served(telemetry) -> None:
    tel, spans, _ = telemetry
    recorder = tracing.RequestRecorder(tel)
    recorder.served = {T.WEIGHTS: "fp8 e4m3 (fbgemm_fp8, per-channel weight scales)", T.KV_CACHE: "bfloat16"}
    recorder.on_finish(record(3))
    assert recorder.flush()
    (span,) = spans.get_finished_spans()
    assert span.attributes[T.WEIGHTS].startswith("fp8 e4m3 (fbgemm_fp8") and span.attributes[T.KV_CACHE] == "bfloat16"
    recorder.close()


def test_failed_and_never_admitted_requests(telemetry) -> None:
    tel, spans, metrics = telemetry
    recorder = tracing.RequestRecorder(tel)
    recorder.on_finish(record(3, finish="error", request_id="bad"))
    recorder.on_finish(record(0, finish="cancelled", request_id="gone", admitted=False))
    assert recorder.flush()
    by_id = {s.attributes[T.REQUEST_ID]: s for s in spans.get_finished_spans()}
    assert by_id["bad"].status.status_code is StatusCode.ERROR
    assert by_id["bad"].attributes["error.type"] == "engine_error"
    gone = T.RequestTrace.from_record(record(0, finish="cancelled", admitted=False), 0)
    assert gone.output_tokens == 0 and gone.ttft_s is None and np.isfinite(gone.queue_s)
    assert [e.name for e in by_id["gone"].events] == ["admitted"]
    # Time to first token and per-token time are for successful responses only.
    assert tracing.TIME_TO_FIRST_TOKEN not in _metric_points(metrics)
    recorder.close()


def test_trace_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    tel = tracing.Telemetry(span_exporters=[OtlpJsonFileSpanExporter(path)])
    recorder = tracing.RequestRecorder(tel)
    originals = [record(n, request_id=f"req-{n}") for n in (1, 7, 300)]
    for r in originals:
        recorder.on_finish(r)
    recorder.close()
    lines = path.read_text().splitlines()
    document = json.loads(lines[0])
    span = document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert len(span["traceId"]) == 32 and len(span["spanId"]) == 16 and span["kind"] == 2
    assert isinstance(span["startTimeUnixNano"], str)
    back = {t.request_id: t for t in T.read_trace_file(path)}
    for r in originals:
        want = T.RequestTrace.from_record(r, recorder.wall_offset_ns)
        got = back[r.request_id]
        assert got.output_tokens == want.output_tokens
        np.testing.assert_allclose(got.token_s, want.token_s, atol=1e-6 * (1 + want.output_tokens))
        np.testing.assert_array_equal(got.steps, want.steps)
        np.testing.assert_array_equal(got.batch_sizes, want.batch_sizes)
        assert (got.prompt_tokens, got.finish_reason, got.model) == (11, "length", "tiny")
        assert got.queue_s == pytest.approx(want.queue_s, abs=1e-7)
        assert got.duration_s == pytest.approx(want.duration_s, abs=2e-9)


def test_summary_and_slowest_tokens() -> None:
    t = T.RequestTrace.from_record(record(100), 0)
    s = T.summarize([t])
    assert s.ttft_ms[50] == pytest.approx(20.0)
    gaps = np.diff(record(100).token_times) * 1e3
    assert s.inter_token_ms[90] == pytest.approx(np.percentile(gaps, 90))
    slow = T.slowest_tokens([t], 3)
    assert [r.gap_ms for r in slow] == sorted((r.gap_ms for r in slow), reverse=True)
    assert slow[0].gap_ms == pytest.approx(gaps.max())
    assert slow[0].step == int(t.steps[slow[0].index])


def test_exporters_from_standard_env(monkeypatch, tmp_path: Path) -> None:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    assert tracing.Telemetry.from_env() is None, "nothing configured: no SDK at all"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://localhost:4317")
    (exporter,) = tracing.span_exporters_from_env()
    assert type(exporter).__module__.startswith("opentelemetry.exporter.otlp.proto.grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    (exporter,) = tracing.span_exporters_from_env()
    assert type(exporter).__module__.startswith("opentelemetry.exporter.otlp.proto.http")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert tracing.span_exporters_from_env() == []
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ValueError, match="zipkin"):
        tracing.span_exporters_from_env()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.Telemetry.from_env(str(tmp_path / "x.jsonl")) is None


def _trace_args(**kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    trace_cli.add_arguments(parser)
    args = parser.parse_args([])
    vars(args).update(kw)
    return args


def test_served_requests_reach_the_file_and_switchyard_trace(tmp_path: Path, capsys) -> None:
    """Real server, real engine: spans in the OTLP-JSON file match the GetTraces records, the
    caller's traceparent is honoured, and ``switchyard trace FILE`` prints and plots them."""
    from helpers.serving_harness import serving
    from switchyard.service.api.client import DecodeClient, make_request

    path = tmp_path / "spans.jsonl"
    metrics = InMemoryMetricReader()
    tel = tracing.Telemetry(span_exporters=[OtlpJsonFileSpanExporter(path)], metric_readers=[metrics])
    parent_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    with serving(telemetry=tel) as s, DecodeClient(s.target) as c:
        ids = []
        for i in range(3):
            meta = [("traceparent", f"00-{parent_trace}-00f067aa0ba902b7-01")] if i == 0 else None
            ids.append(c.generate(make_request(f"trace me {i}", max_tokens=9), timeout=60, metadata=meta).request_id)
        s.wait_idle()
        s.wait_recorded(ids)
        served = {t.request_id: t for t in c.traces()}
        gauges = _metric_points(metrics)
        assert tracing.ACTIVE_SLOTS in gauges and tracing.QUEUE_DEPTH in gauges
        s.recorder.flush()
        from_file = {t.request_id: t for t in T.read_trace_file(path)}
    assert set(ids) <= set(from_file) and set(ids) <= set(served)
    for rid in ids:
        np.testing.assert_array_equal(from_file[rid].steps, served[rid].steps)
        np.testing.assert_allclose(from_file[rid].token_s, served[rid].token_s, atol=1e-5)
    assert from_file[ids[0]].trace_id == parent_trace
    assert from_file[ids[1]].trace_id != parent_trace

    png = tmp_path / "timeline.png"
    assert trace_cli.run(_trace_args(file=str(path), png=str(png))) == 0
    out = capsys.readouterr().out
    assert "3 request(s)" in out and "time to first token ms" in out and "p99" in out
    assert "slowest tokens" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert trace_cli.run(_trace_args(file=str(path), request=ids[2], png="")) == 0
    out = capsys.readouterr().out
    assert f"request {ids[2]}" in out and "prefill" in out
    assert trace_cli.run(_trace_args(file=str(path), request="missing", png="")) == 1


def test_trace_file_from_env_holds_spans_and_metric_points(monkeypatch, tmp_path: Path) -> None:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_METRICS_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                 "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "switchyard-test")
    path = tmp_path / "telemetry.jsonl"
    tel = tracing.Telemetry.from_env(str(path))
    assert tel is not None
    recorder = tracing.RequestRecorder(tel)
    recorder.on_finish(record(50))
    recorder.close()  # flushes, then the last metric export at shutdown
    documents = [json.loads(line) for line in path.read_text().splitlines()]
    spans = [d for d in documents if "resourceSpans" in d]
    metric_docs = [d for d in documents if "resourceMetrics" in d]
    assert spans and metric_docs
    resource = {kv["key"]: kv["value"] for kv in spans[0]["resourceSpans"][0]["resource"]["attributes"]}
    assert resource["service.name"] == {"stringValue": "switchyard-test"}
    metrics = {m["name"]: m for d in metric_docs for rm in d["resourceMetrics"] for sm in rm["scopeMetrics"]
               for m in sm["metrics"]}
    ttft = metrics[tracing.TIME_TO_FIRST_TOKEN]["histogram"]["dataPoints"][0]
    assert ttft["count"] == "1" and ttft["sum"] == pytest.approx(0.020)
    assert ttft["explicitBounds"] == list(tracing.TTFT_BUCKETS)
    assert len(ttft["bucketCounts"]) == len(tracing.TTFT_BUCKETS) + 1
    tokens = metrics[tracing.TOKENS]["sum"]
    assert tokens["isMonotonic"] and {p["asInt"] for p in tokens["dataPoints"]} == {"11", "50"}
    assert [t.output_tokens for t in T.read_trace_file(path)] == [50]


def test_otlp_export_batches_stay_under_a_collectors_default_message_limit(monkeypatch) -> None:
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    monkeypatch.delenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", raising=False)
    spans = InMemorySpanExporter()
    tel = tracing.Telemetry(span_exporters=[spans], span_processor=SimpleSpanProcessor)
    recorder = tracing.RequestRecorder(tel)
    recorder.on_finish(record(8192))
    recorder.close()
    (span,) = spans.get_finished_spans()
    batch_bytes = tracing.DEFAULT_EXPORT_BATCH * encode_spans([span]).ByteSize()
    assert batch_bytes < 4 << 20

    class Batches(InMemorySpanExporter):
        def __init__(self) -> None:
            super().__init__()
            self.sizes: list[int] = []

        def export(self, batch):
            self.sizes.append(len(batch))
            return super().export(batch)

    exporter = Batches()
    tel = tracing.Telemetry(span_exporters=[exporter])  # the default processor
    recorder = tracing.RequestRecorder(tel)
    for i in range(40):
        recorder.on_finish(record(4, request_id=f"b{i}"))
    recorder.close()
    assert sum(exporter.sizes) == 40 and max(exporter.sizes) <= tracing.DEFAULT_EXPORT_BATCH


def test_otlp_grpc_export_configured_by_standard_env(monkeypatch) -> None:
    """A real OTLP/gRPC receiver on a localhost port gets the request span, configured only through
    OTEL_* variables, as a pod would be."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received: list = []

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            received.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_SDK_DISABLED"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
        monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
        monkeypatch.setenv("OTEL_SERVICE_NAME", "switchyard-otlp-test")
        tel = tracing.Telemetry.from_env()
        assert tel is not None
        recorder = tracing.RequestRecorder(tel)
        recorder.on_finish(record(300))
        recorder.close()
    finally:
        server.stop(0)
    spans = [s for r in received for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]
    (span,) = spans
    assert span.name == "text_completion tiny"
    attrs = {kv.key: kv.value for kv in span.attributes}
    assert attrs["gen_ai.operation.name"].string_value == "text_completion"
    assert attrs["gen_ai.usage.output_tokens"].int_value == 300
    assert len(attrs[T.TOKEN_GAP_MS].array_value.values) == 300
    resource = {kv.key: kv.value.string_value for kv in received[0].resource_spans[0].resource.attributes}
    assert resource["service.name"] == "switchyard-otlp-test"
