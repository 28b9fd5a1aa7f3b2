"""Per-token traces of finished requests: one in-memory form, its readers and analysis.

A :class:`RequestTrace` comes from three places and means the same in each: a scheduler
``RequestRecord`` (in the server), an OTLP-JSON span (a trace file), or the ``GetTraces`` RPC.
Times are seconds since the request arrived, so traces from different machines compare directly.
Pure NumPy; the picture of a set of traces is :mod:`switchyard.service.telemetry.timeline`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

# Span attribute names. GenAI semantic-convention names where one exists; ours under "switchyard.".
OPERATION = "gen_ai.operation.name"
REQUEST_MODEL = "gen_ai.request.model"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_ID = "gen_ai.response.id"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
TOP_K = "gen_ai.request.top_k"
TOP_P = "gen_ai.request.top_p"
SEED = "gen_ai.request.seed"
REQUEST_ID = "switchyard.request.id"
QUEUE_MS = "switchyard.request.queue_ms"
PREFILL_MS = "switchyard.request.prefill_ms"
TTFT_MS = "switchyard.request.time_to_first_token_ms"
# Per-token record as three parallel arrays (one attribute each, not one span event per token: the
# SDK keeps 128 events per span by default, and an event per token costs an object per token).
TOKEN_GAP_MS = "switchyard.token.gap_ms"  # since the previous token; the first: since arrival
TOKEN_STEP = "switchyard.token.step"  # engine step that made the token, -1 = prefill
TOKEN_BATCH = "switchyard.token.batch_size"  # requests in that step
# The prompt's prefill, chunk by chunk, as parallel arrays for the same reason (a long prompt in small
# chunks would pass the event limit); the span also has one event per chunk, for trace viewers.
CHUNK_MS = "switchyard.prefill.chunk_ms"  # when the step carrying the chunk was launched, since arrival
CHUNK_STEP = "switchyard.prefill.chunk_step"  # engine step that carried the chunk
CHUNK_TOKENS = "switchyard.prefill.chunk_tokens"  # prompt tokens in the chunk
CHUNK_EVENT = "prefill_chunk"
CACHED_TOKENS = "gen_ai.usage.cache_read.input_tokens"  # prompt tokens whose KV came from the prefix cache
PREEMPTIONS = "switchyard.request.preemptions"  # times the request lost its KV blocks and was recomputed
OPERATION_NAME = "text_completion"


def _int64s(values: Any = ()) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _int32s(values: Any = ()) -> np.ndarray:
    return np.asarray(values, dtype=np.int32).reshape(-1)


def _float64s(values: Any = ()) -> np.ndarray:
    return np.asarray(values, dtype=np.float64).reshape(-1)


@dataclasses.dataclass
class RequestTrace:
    request_id: str
    model: str
    prompt_tokens: int
    finish_reason: str
    start_unix_nano: int
    queue_s: float  # arrival -> admitted into a slot (prefill starts)
    prefill_s: float  # admitted -> first token
    duration_s: float  # arrival -> final event
    token_s: np.ndarray  # float64 [n]: emit time of each token since arrival
    steps: np.ndarray  # int64 [n]
    batch_sizes: np.ndarray  # int32 [n]
    max_tokens: int = 0
    trace_id: str = ""
    # The prompt's prefill: one entry per engine step that carried a chunk of it (one for a
    # whole-prompt prefill; none in traces from before chunked prefill).
    chunk_s: np.ndarray = dataclasses.field(default_factory=_float64s)  # float64 [k]: step launch since arrival
    chunk_steps: np.ndarray = dataclasses.field(default_factory=_int64s)  # int64 [k]
    chunk_tokens: np.ndarray = dataclasses.field(default_factory=_int32s)  # int32 [k]
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    preemptions: int = 0

    def __post_init__(self) -> None:
        if not len(self.chunk_s) == len(self.chunk_steps) == len(self.chunk_tokens):
            raise ValueError(
                f"request {self.request_id!r}: prefill chunk arrays differ in length "
                f"({len(self.chunk_s)} times, {len(self.chunk_steps)} steps, {len(self.chunk_tokens)} token counts)"
            )

    @property
    def prefill_chunks(self) -> int:
        return len(self.chunk_steps)

    @property
    def output_tokens(self) -> int:
        return len(self.token_s)

    @property
    def ttft_s(self) -> float | None:
        return float(self.token_s[0]) if len(self.token_s) else None

    @property
    def gaps_s(self) -> np.ndarray:
        """Time since the previous token; the first token's is its time since arrival (TTFT)."""
        return np.diff(self.token_s, prepend=0.0)

    @property
    def inter_token_s(self) -> np.ndarray:
        return np.diff(self.token_s)

    @classmethod
    def from_record(cls, record: Any, wall_offset_ns: int) -> RequestTrace:
        """From the scheduler's ``RequestRecord`` (monotonic times); ``wall_offset_ns`` maps
        ``time.monotonic_ns()`` to ``time.time_ns()``."""
        t0 = float(record.t_submit)
        n = len(record.token_ids)
        end = float(record.t_end)
        # NaN marks what never happened (a request cancelled while queued was never admitted).
        first = float(record.t_first_token) if n and math.isfinite(record.t_first_token) else end
        admit = float(record.t_admit) if math.isfinite(record.t_admit) else first
        return cls(
            request_id=record.request_id,
            model=record.model,
            prompt_tokens=int(record.prompt_tokens),
            finish_reason=record.finish_reason,
            start_unix_nano=int(t0 * 1e9) + wall_offset_ns,
            queue_s=max(0.0, admit - t0),
            prefill_s=max(0.0, first - admit) if n else 0.0,
            duration_s=float(record.t_end) - t0,
            token_s=np.asarray(record.token_times[:n], dtype=np.float64) - t0,
            steps=np.asarray(record.token_steps[:n], dtype=np.int64),
            batch_sizes=np.asarray(record.token_batch_sizes[:n], dtype=np.int32),
            max_tokens=int(record.max_tokens),
            chunk_s=_float64s(record.chunk_times) - t0,
            chunk_steps=_int64s(record.chunk_steps),
            chunk_tokens=_int32s(record.chunk_tokens),
            cached_tokens=int(record.cached_tokens),
            preemptions=int(record.preemptions),
        )

    def span_attributes(self) -> dict[str, Any]:
        """The timing part of the request span's attributes (compact arrays, ms rounded to 0.1 µs; no
        chunk arrays when the record has no prefill chunks)."""
        return {
            REQUEST_ID: self.request_id,
            QUEUE_MS: round(self.queue_s * 1e3, 4),
            PREFILL_MS: round(self.prefill_s * 1e3, 4),
            **({TTFT_MS: round(self.ttft_s * 1e3, 4)} if self.ttft_s is not None else {}),
            TOKEN_GAP_MS: np.round(self.gaps_s * 1e3, 4).tolist(),
            TOKEN_STEP: self.steps.tolist(),
            TOKEN_BATCH: self.batch_sizes.tolist(),
            **(
                {
                    CHUNK_MS: np.round(self.chunk_s * 1e3, 4).tolist(),
                    CHUNK_STEP: self.chunk_steps.tolist(),
                    CHUNK_TOKENS: self.chunk_tokens.tolist(),
                }
                if self.prefill_chunks
                else {}
            ),
            CACHED_TOKENS: self.cached_tokens,
            PREEMPTIONS: self.preemptions,
        }

    @classmethod
    def from_span_attributes(
        cls, attrs: dict[str, Any], start_unix_nano: int, end_unix_nano: int, trace_id: str = ""
    ) -> RequestTrace:
        gaps_ms = np.asarray(attrs.get(TOKEN_GAP_MS, []), dtype=np.float64)
        reasons = attrs.get(FINISH_REASONS) or [""]
        return cls(
            request_id=str(attrs.get(REQUEST_ID) or attrs.get(RESPONSE_ID, "")),
            model=str(attrs.get(REQUEST_MODEL, "")),
            prompt_tokens=int(attrs.get(INPUT_TOKENS, 0)),
            finish_reason=str(reasons[0]),
            start_unix_nano=int(start_unix_nano),
            queue_s=float(attrs.get(QUEUE_MS, 0.0)) / 1e3,
            prefill_s=float(attrs.get(PREFILL_MS, 0.0)) / 1e3,
            duration_s=(int(end_unix_nano) - int(start_unix_nano)) / 1e9,
            token_s=np.cumsum(gaps_ms) / 1e3,
            steps=np.asarray(attrs.get(TOKEN_STEP, []), dtype=np.int64),
            batch_sizes=np.asarray(attrs.get(TOKEN_BATCH, []), dtype=np.int32),
            max_tokens=int(attrs.get(MAX_TOKENS, 0)),
            trace_id=trace_id,
            chunk_s=_float64s(attrs.get(CHUNK_MS, [])) / 1e3,
            chunk_steps=_int64s(attrs.get(CHUNK_STEP, [])),
            chunk_tokens=_int32s(attrs.get(CHUNK_TOKENS, [])),
            cached_tokens=int(attrs.get(CACHED_TOKENS, 0)),
            preemptions=int(attrs.get(PREEMPTIONS, 0)),
        )


# ---- OTLP-JSON reading ---------------------------------------------------------------------------


def _otlp_value(value: dict[str, Any]) -> Any:
    if "stringValue" in value:
        return value["stringValue"]
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "intValue" in value:
        return int(value["intValue"])  # a string in proto3 JSON, a number from some writers
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "arrayValue" in value:
        return [_otlp_value(v) for v in value["arrayValue"].get("values", [])]
    if "kvlistValue" in value:
        return {kv["key"]: _otlp_value(kv.get("value", {})) for kv in value["kvlistValue"].get("values", [])}
    return None


def _spans(document: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for resource_spans in document.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            yield from scope_spans.get("spans", [])


def traces_from_otlp_json(lines: Iterable[str]) -> list[RequestTrace]:
    """Request traces from OTLP-JSON lines (ours, or an OpenTelemetry Collector file exporter's):
    every span with a per-token record; other spans are skipped."""
    found = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            document = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"line {number} is not JSON: {err}") from err
        for span in _spans(document):
            attrs = {kv["key"]: _otlp_value(kv.get("value", {})) for kv in span.get("attributes", [])}
            if TOKEN_GAP_MS not in attrs:
                continue
            found.append(
                RequestTrace.from_span_attributes(
                    attrs,
                    int(span["startTimeUnixNano"]),
                    int(span["endTimeUnixNano"]),
                    span.get("traceId", ""),
                )
            )
    return found


def read_trace_file(path: str | Path) -> list[RequestTrace]:
    with open(path, encoding="utf-8") as f:
        return traces_from_otlp_json(f)


# ---- analysis ------------------------------------------------------------------------------------

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass(frozen=True)
class Summary:
    requests: int
    tokens: int
    ttft_ms: dict[int, float]  # percentile -> ms, over requests
    inter_token_ms: dict[int, float]  # percentile -> ms, over every gap after a first token
    queue_ms: dict[int, float]
    prefill_ms: dict[int, float]
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, from the prefix cache
    prefill_chunks: dict[int, float] = dataclasses.field(default_factory=dict)  # percentile -> chunks, over
    # the requests whose trace records its chunks
    preempted_requests: int = 0
    preemptions: int = 0


def _percentiles(values: np.ndarray) -> dict[int, float]:
    if len(values) == 0:
        return {}
    return {p: float(np.percentile(values, p)) for p in PERCENTILES}


def summarize(traces: Sequence[RequestTrace]) -> Summary:
    ttft = np.array([t.ttft_s for t in traces if t.ttft_s is not None]) * 1e3
    gaps = np.concatenate([t.inter_token_s for t in traces]) * 1e3 if traces else np.array([])
    return Summary(
        requests=len(traces),
        tokens=sum(t.output_tokens for t in traces),
        ttft_ms=_percentiles(ttft),
        inter_token_ms=_percentiles(gaps),
        queue_ms=_percentiles(np.array([t.queue_s for t in traces]) * 1e3),
        prefill_ms=_percentiles(np.array([t.prefill_s for t in traces]) * 1e3),
        prompt_tokens=sum(t.prompt_tokens for t in traces),
        cached_tokens=sum(t.cached_tokens for t in traces),
        prefill_chunks=_percentiles(np.array([t.prefill_chunks for t in traces if t.prefill_chunks], dtype=float)),
        preempted_requests=sum(1 for t in traces if t.preemptions),
        preemptions=sum(t.preemptions for t in traces),
    )


@dataclasses.dataclass(frozen=True)
class SlowToken:
    request_id: str
    index: int
    gap_ms: float
    step: int
    batch_size: int


def slowest_tokens(traces: Sequence[RequestTrace], n: int = 5) -> list[SlowToken]:
    """The ``n`` longest waits for a token after the first one, with the step that made them."""
    rows = [
        SlowToken(t.request_id, i, float(gap) * 1e3, int(t.steps[i]), int(t.batch_sizes[i]))
        for t in traces
        for i, gap in enumerate(t.gaps_s)
        if i > 0
    ]
    rows.sort(key=lambda r: r.gap_ms, reverse=True)
    return rows[:n]


def _fmt_pcts(values: dict[int, float]) -> str:
    if not values:
        return "-"
    return "  ".join(f"p{p} {values[p]:8.3f}" for p in PERCENTILES)


def token_table(trace: RequestTrace, max_rows: int = 0) -> str:
    lines = [f"{'token':>6} {'at ms':>10} {'gap ms':>9} {'step':>7} {'batch':>5}"]
    indices = range(trace.output_tokens)
    if max_rows and trace.output_tokens > max_rows:
        half = max_rows // 2
        indices = [*range(half), -1, *range(trace.output_tokens - half, trace.output_tokens)]
    gaps = trace.gaps_s
    for i in indices:
        if i < 0:
            lines.append(f"{'...':>6}")
            continue
        step = "prefill" if trace.steps[i] < 0 else str(int(trace.steps[i]))
        lines.append(
            f"{i:>6} {trace.token_s[i] * 1e3:>10.3f} {gaps[i] * 1e3:>9.3f} {step:>7} {int(trace.batch_sizes[i]):>5}"
        )
    return "\n".join(lines)


def chunk_table(trace: RequestTrace, max_rows: int = 0) -> str:
    """The prompt's prefill chunks: when each step carrying one was launched, the step, its tokens."""
    lines = [f"{'chunk':>6} {'at ms':>10} {'step':>7} {'tokens':>7}"]
    k = trace.prefill_chunks
    indices: Sequence[int] = range(k)
    if max_rows and k > max_rows:
        half = max_rows // 2
        indices = [*range(half), -1, *range(k - half, k)]
    for i in indices:
        if i < 0:
            lines.append(f"{'...':>6}")
            continue
        lines.append(
            f"{i:>6} {trace.chunk_s[i] * 1e3:>10.3f} {int(trace.chunk_steps[i]):>7} {int(trace.chunk_tokens[i]):>7}"
        )
    return "\n".join(lines)


def _prompt_words(t: RequestTrace) -> str:
    """'prompt 300 tokens (256 cached)'; the cached part only when there is one."""
    return f"prompt {t.prompt_tokens} tokens" + (f" ({t.cached_tokens} cached)" if t.cached_tokens else "")


def format_report(traces: Sequence[RequestTrace], *, table_rows: int = 40, top: int = 5) -> str:
    if not traces:
        return "no request traces found"
    out = []
    if len(traces) == 1:
        t = traces[0]
        out.append(
            f"request {t.request_id}  model {t.model}  {_prompt_words(t)}  "
            f"output {t.output_tokens} tokens  finish {t.finish_reason}"
        )
        chunks = f" in {t.prefill_chunks} chunk{'' if t.prefill_chunks == 1 else 's'}" if t.prefill_chunks else ""
        preempted = f"  preempted {t.preemptions} time{'' if t.preemptions == 1 else 's'}" if t.preemptions else ""
        out.append(
            f"queue {t.queue_s * 1e3:.3f} ms  prefill {t.prefill_s * 1e3:.3f} ms{chunks}  "
            f"duration {t.duration_s * 1e3:.3f} ms{preempted}"
        )
        if t.prefill_chunks:
            out.append(chunk_table(t, table_rows))
        out.append(token_table(t, table_rows))
    else:
        out.append(
            f"{'request':<34} {'in':>5} {'cached':>6} {'chunks':>6} {'out':>5} {'queue ms':>9} {'ttft ms':>9} "
            f"{'ms/tok':>8} finish"
        )
        for t in traces:
            ttft = f"{t.ttft_s * 1e3:9.3f}" if t.ttft_s is not None else f"{'-':>9}"
            tpot = f"{np.mean(t.inter_token_s) * 1e3:8.3f}" if t.output_tokens > 1 else f"{'-':>8}"
            chunks = str(t.prefill_chunks) if t.prefill_chunks else "-"  # '-': a trace without chunk records
            preempted = f" (preempted {t.preemptions}x)" if t.preemptions else ""
            out.append(
                f"{t.request_id[:34]:<34} {t.prompt_tokens:>5} {t.cached_tokens:>6} {chunks:>6} {t.output_tokens:>5} "
                f"{t.queue_s * 1e3:>9.3f} {ttft} {tpot} {t.finish_reason}{preempted}"
            )
    s = summarize(traces)
    out.append("")
    out.append(f"{s.requests} request(s), {s.tokens} tokens; times in the engine, from each request's arrival "
               f"in its queue (a client's TTFT adds tokenizing, gRPC and the network)")
    out.append(f"time to first token ms   {_fmt_pcts(s.ttft_ms)}")
    out.append(f"inter-token ms           {_fmt_pcts(s.inter_token_ms)}")
    out.append(f"queue ms                 {_fmt_pcts(s.queue_ms)}")
    if s.prefill_chunks:
        out.append(f"prefill chunks/request   {_fmt_pcts(s.prefill_chunks)}")
    if s.prompt_tokens and (s.cached_tokens or s.prefill_chunks):  # a trace from a server that records them
        share = 100.0 * s.cached_tokens / s.prompt_tokens
        out.append(f"prefix cache             {s.cached_tokens} of {s.prompt_tokens} prompt tokens ({share:.1f}%)")
    if s.preemptions:
        out.append(f"preempted                {s.preempted_requests} request(s), {s.preemptions} time(s)")
    slow = slowest_tokens(traces, top)
    if slow:
        out.append("slowest tokens (after the first):")
        for r in slow:
            out.append(
                f"  {r.request_id[:34]:<34} token {r.index:>5}  {r.gap_ms:9.3f} ms  "
                f"step {r.step}  batch {r.batch_size}"
            )
    return "\n".join(out)
