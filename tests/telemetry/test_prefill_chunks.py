"""A request's prefill chunks, cached prompt tokens and preemptions: from the scheduler's record through
the span, the OTLP-JSON file, the GetTraces message, the ``switchyard trace`` report and the timeline."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from switchyard.service.api.server import trace_from_proto, trace_to_proto
from switchyard.service.engine.sampling import SamplingParams
from switchyard.service.engine.scheduler import RequestRecord
from switchyard.service.telemetry import timeline, tracing
from switchyard.service.telemetry import traces as T
from switchyard.service.telemetry.otlp_json import OtlpJsonFileSpanExporter

T0 = 1000.0


def chunked(
    request_id: str = "c-1", *, chunks: int = 3, chunk: int = 64, cached: int = 32, preemptions: int = 0, n: int = 20
) -> RequestRecord:
    """A request admitted at +2 ms whose prompt went in ``chunks`` steps 4 ms apart (steps 7, 9, 11, ...:
    another request's decode step between each), then ``n`` tokens 5 ms apart."""
    launches = T0 + 0.002 + 0.004 * np.arange(chunks) + 0.00001 * np.arange(chunks) ** 2
    first = launches[-1] + 0.004
    times = first + 0.005 * np.arange(n)
    return RequestRecord(
        request_id=request_id, prompt_tokens=chunks * chunk + cached, token_ids=np.arange(n, dtype=np.int32),
        token_times=times, token_steps=np.arange(n, dtype=np.int64) + 7 + 2 * chunks,
        token_batch_sizes=np.full(n, 2, np.int32), t_submit=T0, t_admit=T0 + 0.002, t_first_token=first,
        t_end=times[-1] + 0.0002, finish_reason="length", model="tiny", sampling=SamplingParams(), max_tokens=n,
        chunk_steps=7 + 2 * np.arange(chunks, dtype=np.int64), chunk_times=launches,
        chunk_tokens=np.full(chunks, chunk, np.int32), cached_tokens=cached, preemptions=preemptions,
    )


def whole(request_id: str = "w-1") -> RequestRecord:
    """A record of today's whole-prompt prefill: no chunk entries."""
    r = chunked(request_id, chunks=1, cached=0)
    r.chunk_steps, r.chunk_times, r.chunk_tokens = np.zeros(0, np.int64), np.zeros(0), np.zeros(0, np.int32)
    return r


def assert_same_chunks(got: T.RequestTrace, want: T.RequestTrace, atol: float = 1e-9) -> None:
    np.testing.assert_array_equal(got.chunk_steps, want.chunk_steps)
    np.testing.assert_array_equal(got.chunk_tokens, want.chunk_tokens)
    np.testing.assert_allclose(got.chunk_s, want.chunk_s, atol=atol)
    assert (got.cached_tokens, got.preemptions) == (want.cached_tokens, want.preemptions)
    assert got.chunk_steps.dtype == np.int64 and got.chunk_tokens.dtype == np.int32


def test_from_record_keeps_the_chunks_in_seconds_since_arrival() -> None:
    r = chunked(chunks=4, cached=16, preemptions=2)
    t = T.RequestTrace.from_record(r, 0)
    assert t.prefill_chunks == 4
    np.testing.assert_allclose(t.chunk_s, r.chunk_times - T0)
    np.testing.assert_array_equal(t.chunk_steps, [7, 9, 11, 13])
    np.testing.assert_array_equal(t.chunk_tokens, [64] * 4)
    assert (t.cached_tokens, t.preemptions) == (16, 2)
    assert T.RequestTrace.from_record(whole(), 0).prefill_chunks == 0


def test_chunk_arrays_of_different_lengths_are_refused() -> None:
    attrs = {T.TOKEN_GAP_MS: [1.0], T.CHUNK_MS: [0.1, 0.2], T.CHUNK_STEP: [3], T.CHUNK_TOKENS: [8, 8]}
    with pytest.raises(ValueError, match="2 times, 1 steps, 2 token counts"):
        T.RequestTrace.from_span_attributes(attrs, 0, 10)


def test_the_span_has_the_chunk_arrays_an_event_per_chunk_and_the_counts() -> None:
    spans = InMemorySpanExporter()
    tel = tracing.Telemetry(span_exporters=[spans], span_processor=SimpleSpanProcessor)
    recorder = tracing.RequestRecorder(tel)
    r = chunked(chunks=3, cached=32, preemptions=1)
    recorder.on_finish(r)
    recorder.on_finish(whole())
    recorder.close()
    by_id = {s.attributes[T.REQUEST_ID]: s for s in spans.get_finished_spans()}
    span = by_id["c-1"]
    a = span.attributes
    assert list(a[T.CHUNK_STEP]) == [7, 9, 11] and list(a[T.CHUNK_TOKENS]) == [64, 64, 64]
    np.testing.assert_allclose(a[T.CHUNK_MS], (r.chunk_times - T0) * 1e3, atol=1e-4)
    assert a["gen_ai.usage.cache_read.input_tokens"] == 32 and a["switchyard.request.preemptions"] == 1
    assert a["gen_ai.usage.input_tokens"] == 3 * 64 + 32, "cached tokens are part of the input tokens"
    events = [e for e in span.events if e.name == "prefill_chunk"]
    assert [e.name for e in span.events] == ["admitted", *["prefill_chunk"] * 3, "first_token"]
    assert [e.attributes[T.CHUNK_STEP] for e in events] == [7, 9, 11]
    assert [e.attributes[T.CHUNK_TOKENS] for e in events] == [64, 64, 64]
    offsets = [(e.timestamp - span.start_time) / 1e9 for e in events]
    np.testing.assert_allclose(offsets, r.chunk_times - T0, atol=2e-9)
    # A whole-prompt prefill writes no empty arrays and no chunk events, only the counts.
    plain = by_id["w-1"]
    assert T.CHUNK_STEP not in plain.attributes and plain.attributes[T.CACHED_TOKENS] == 0
    assert [e.name for e in plain.events] == ["admitted", "first_token"]


def test_chunks_survive_the_trace_file(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    recorder = tracing.RequestRecorder(tracing.Telemetry(span_exporters=[OtlpJsonFileSpanExporter(path)]))
    originals = [chunked("a", chunks=1, cached=0), chunked("b", chunks=5, cached=100, preemptions=3), whole("c")]
    for r in originals:
        recorder.on_finish(r)
    recorder.close()
    back = {t.request_id: t for t in T.read_trace_file(path)}
    for r in originals:
        want = T.RequestTrace.from_record(r, recorder.wall_offset_ns)
        assert_same_chunks(back[r.request_id], want, atol=1e-7)
    assert back["b"].prefill_chunks == 5 and back["c"].prefill_chunks == 0


def test_a_trace_file_without_chunk_fields_still_reads() -> None:
    """A line as a server that knew nothing of chunks wrote it: token arrays only."""
    span = {
        "traceId": "0" * 31 + "1", "spanId": "0" * 15 + "2", "name": "text_completion tiny", "kind": 2,
        "startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": "1700000000030000000",
        "attributes": [
            {"key": T.REQUEST_ID, "value": {"stringValue": "old"}},
            {"key": T.INPUT_TOKENS, "value": {"intValue": "11"}},
            {"key": T.TOKEN_GAP_MS, "value": {"arrayValue": {"values": [{"doubleValue": 20.0}, {"doubleValue": 5.0}]}}},
            {"key": T.TOKEN_STEP, "value": {"arrayValue": {"values": [{"intValue": "-1"}, {"intValue": "0"}]}}},
            {"key": T.TOKEN_BATCH, "value": {"arrayValue": {"values": [{"intValue": "1"}, {"intValue": "1"}]}}},
        ],
    }
    line = json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]})
    (t,) = T.traces_from_otlp_json([line])
    assert t.request_id == "old" and t.output_tokens == 2
    assert t.prefill_chunks == 0 and t.chunk_s.dtype == np.float64 and t.chunk_steps.dtype == np.int64
    assert (t.cached_tokens, t.preemptions) == (0, 0)
    report = T.format_report([t, t])
    assert "prefix cache" not in report and "prefill chunks" not in report


def test_get_traces_message_round_trip() -> None:
    for r in (chunked(chunks=4, cached=8, preemptions=2), whole()):
        want = T.RequestTrace.from_record(r, 123)
        got = trace_from_proto(type(trace_to_proto(want)).FromString(trace_to_proto(want).SerializeToString()))
        assert_same_chunks(got, want)
        np.testing.assert_array_equal(got.steps, want.steps)


def test_report_shows_chunks_and_cached_tokens() -> None:
    traces = [T.RequestTrace.from_record(r, 0) for r in
              (chunked("a", chunks=2, cached=10), chunked("b", chunks=6, cached=0, preemptions=1), whole("c"))]
    out = T.format_report(traces)
    header, *rows = out.splitlines()[:4]
    assert header.split()[:5] == ["request", "in", "cached", "chunks", "out"]
    assert [row.split()[:4] for row in rows] == [
        ["a", "138", "10", "2"], ["b", "384", "0", "6"], ["c", "64", "0", "-"]]
    assert "(preempted 1x)" in rows[1]
    prompt = 138 + 384 + 64
    assert f"prefix cache             10 of {prompt} prompt tokens ({100 * 10 / prompt:.1f}%)" in out
    assert "prefill chunks/request   p50    4.000" in out  # over the two traces that record chunks
    assert "preempted                1 request(s), 1 time(s)" in out

    one = T.format_report([traces[1]])
    assert "prompt 384 tokens" in one and "prefill" in one and "in 6 chunks" in one and "preempted 1 time" in one
    table = T.chunk_table(traces[1]).splitlines()
    assert table[0].split() == ["chunk", "at", "ms", "step", "tokens"]
    assert [line.split()[2:] for line in table[1:]] == [[str(7 + 2 * i), "64"] for i in range(6)]
    assert float(table[1].split()[1]) == pytest.approx(2.0)
    assert len(T.chunk_table(traces[1], max_rows=2).splitlines()) == 4, "cut: a row each end and '...'"


def _chunk_marks(fig) -> np.ndarray:
    (ax,) = [a for a in fig.axes if a.get_label() == "requests"]
    (marks,) = [ln for ln in ax.lines if ln.get_gid() == "prefill-chunks"]
    return np.column_stack([marks.get_xdata(), marks.get_ydata()])


def test_the_timeline_marks_each_chunk_between_admission_and_first_token() -> None:
    traces = [T.RequestTrace.from_record(chunked(f"r{i}", chunks=1 + i), 0) for i in range(3)]
    traces.append(T.RequestTrace.from_record(whole("w"), 0))
    fig = timeline.timeline_figure(traces)
    marks = _chunk_marks(fig)
    assert sorted(np.unique(marks[:, 1]).tolist()) == [0, 1, 2], "one row per chunked request, none for 'w'"
    assert [int((marks[:, 1] == y).sum()) for y in range(3)] == [1, 2, 3]
    (ax,) = [a for a in fig.axes if a.get_label() == "requests"]
    prefill = {round(p.get_y() + p.get_height() / 2): p for p in ax.patches if p.get_gid() == "prefill"}
    for x, y in marks:
        bar = prefill[round(y)]
        assert bar.get_x() - 1e-9 <= x <= bar.get_x() + bar.get_width(), "a chunk's mark lies on its prefill bar"
    assert any(text.get_text() == "prefill chunk's step" for text in ax.get_legend().get_texts())


def test_one_request_names_the_steps_that_carried_its_prompt() -> None:
    t = T.RequestTrace.from_record(chunked(chunks=3, cached=32), 0)
    fig = timeline.timeline_figure([t])
    (ax,) = [a for a in fig.axes if a.get_label() == "requests"]
    assert [x.get_text() for x in ax.texts if x.get_gid() == "chunk-step"] == ["step 7", "step 9", "step 11"]
    (phases,) = [x.get_text() for x in ax.texts if x.get_gid() == "phases"]
    assert "(3 chunks, 32 of 224 prompt tokens cached)" in phases
    assert len(_chunk_marks(fig)) == 3


def test_the_timeline_png_is_written_with_chunks(tmp_path: Path) -> None:
    traces = [T.RequestTrace.from_record(chunked(f"r{i}", chunks=1 + i % 4), 0) for i in range(5)]
    path = timeline.plot_timeline(traces, tmp_path / "chunks.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
