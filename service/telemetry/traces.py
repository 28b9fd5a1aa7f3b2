"""Per-token traces of finished requests: one in-memory form, its readers, analysis and plot.

A :class:`RequestTrace` comes from three places and means the same in each: a scheduler
``RequestRecord`` (in the server), an OTLP-JSON span (a trace file), or the ``GetTraces`` RPC.
Times are seconds since the request arrived, so traces from different machines compare directly.
Pure NumPy here, except the timeline plot (:func:`timeline_figure`, :func:`plot_timeline`), which imports
matplotlib when called.
"""

from __future__ import annotations

import dataclasses
import itertools
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
OPERATION_NAME = "text_completion"


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
        )

    def span_attributes(self) -> dict[str, Any]:
        """The timing part of the request span's attributes (compact arrays, ms rounded to 0.1 µs)."""
        return {
            REQUEST_ID: self.request_id,
            QUEUE_MS: round(self.queue_s * 1e3, 4),
            PREFILL_MS: round(self.prefill_s * 1e3, 4),
            **({TTFT_MS: round(self.ttft_s * 1e3, 4)} if self.ttft_s is not None else {}),
            TOKEN_GAP_MS: np.round(self.gaps_s * 1e3, 4).tolist(),
            TOKEN_STEP: self.steps.tolist(),
            TOKEN_BATCH: self.batch_sizes.tolist(),
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


def format_report(traces: Sequence[RequestTrace], *, table_rows: int = 40, top: int = 5) -> str:
    if not traces:
        return "no request traces found"
    out = []
    if len(traces) == 1:
        t = traces[0]
        out.append(
            f"request {t.request_id}  model {t.model}  prompt {t.prompt_tokens} tokens  "
            f"output {t.output_tokens} tokens  finish {t.finish_reason}"
        )
        out.append(
            f"queue {t.queue_s * 1e3:.3f} ms  prefill {t.prefill_s * 1e3:.3f} ms  "
            f"duration {t.duration_s * 1e3:.3f} ms"
        )
        out.append(token_table(t, table_rows))
    else:
        out.append(
            f"{'request':<34} {'in':>5} {'out':>5} {'queue ms':>9} {'ttft ms':>9} {'ms/tok':>8} finish"
        )
        for t in traces:
            ttft = f"{t.ttft_s * 1e3:9.3f}" if t.ttft_s is not None else f"{'-':>9}"
            tpot = f"{np.mean(t.inter_token_s) * 1e3:8.3f}" if t.output_tokens > 1 else f"{'-':>8}"
            out.append(
                f"{t.request_id[:34]:<34} {t.prompt_tokens:>5} {t.output_tokens:>5} "
                f"{t.queue_s * 1e3:>9.3f} {ttft} {tpot} {t.finish_reason}"
            )
    s = summarize(traces)
    out.append("")
    out.append(f"{s.requests} request(s), {s.tokens} tokens")
    out.append(f"time to first token ms   {_fmt_pcts(s.ttft_ms)}")
    out.append(f"inter-token ms           {_fmt_pcts(s.inter_token_ms)}")
    out.append(f"queue ms                 {_fmt_pcts(s.queue_ms)}")
    slow = slowest_tokens(traces, top)
    if slow:
        out.append("slowest tokens (after the first):")
        for r in slow:
            out.append(
                f"  {r.request_id[:34]:<34} token {r.index:>5}  {r.gap_ms:9.3f} ms  "
                f"step {r.step}  batch {r.batch_size}"
            )
    return "\n".join(out)


# ---- timeline plot -------------------------------------------------------------------------------

_QUEUE, _PREFILL, _DECODE, _TOKEN, _MARK = "#6e6e6e", "#e69f00", "#9ecae1", "#08306b", "#d62728"
_MIN_BAR = 0.005  # axis fraction: the narrowest bar drawn, so a sub-millisecond queue still shows
_BREAK_WIDTH = 0.04  # axis fraction given to each cut in the time axis
_MAX_BREAKS = 8
_LABEL_WIDTH = 24  # characters of a request id on the y axis
_MAX_TOKEN_ROWS = 60  # above this many requests a tick per token is noise: the gap panel shows tokens
_MAX_ID_LABELS = 40


def _fmt_duration(seconds: float) -> str:
    """A duration in the unit that fits it: '0.12 ms', '15.3 ms', '1.25 s', '4.9 min'."""
    s = abs(seconds)
    if s >= 120:
        return f"{seconds / 60:.3g} min"
    if s >= 1:
        return f"{seconds:.3g} s"
    ms = seconds * 1e3
    return f"{ms:.3g} ms" if abs(ms) >= 0.01 or ms == 0 else f"{ms * 1e3:.3g} µs"


def _short_labels(ids: Sequence[str], width: int = _LABEL_WIDTH) -> list[str]:
    """Request ids cut to about ``width`` characters, keeping the start and the end around an ellipsis
    (ids often share a prefix and differ at the end); ids whose cut forms collide keep more characters
    until every distinct id has a distinct label. A repeated id gets a ' #2', ' #3' suffix."""

    def cut(text: str, keep: int) -> str:
        if len(text) <= keep:
            return text
        tail = (keep - 1) // 2
        return text[: keep - 1 - tail] + "…" + text[len(text) - tail :]

    keep = dict.fromkeys(ids, width)
    while True:
        labels = {i: cut(i, keep[i]) for i in keep}
        by_label: dict[str, list[str]] = {}
        for i, label in labels.items():
            by_label.setdefault(label, []).append(i)
        clashes = [group for group in by_label.values() if len(group) > 1]
        if not clashes:
            break
        for group in clashes:
            for i in group:
                keep[i] = min(keep[i] + 4, len(i) + 1)
    seen: dict[str, int] = {}
    out = []
    for i in ids:
        seen[i] = seen.get(i, 0) + 1
        out.append(labels[i] if seen[i] == 1 else f"{labels[i]} #{seen[i]}")
    return out


@dataclasses.dataclass(frozen=True)
class _TimeAxis:
    """Seconds since the first arrival -> axis fraction, linear within each segment of activity; an idle
    stretch longer than all the activity together is cut to a fixed width, so requests minutes apart each
    keep a readable width (each segment gets a minimum share) instead of becoming slivers."""

    real: np.ndarray  # knots, seconds, increasing
    shown: np.ndarray  # knots, axis fraction
    segments: tuple[tuple[float, float, float, float], ...]  # (lo s, hi s, x0, x1) per segment
    instants: tuple[bool, ...]  # per segment: a single instant (an arrival alone), one tick is enough
    cuts: tuple[tuple[float, float, float, float], ...]  # (from s, to s, x0, x1) per cut: the time left out
    unit: float  # seconds per tick unit (1e-3 for ms, 1 for s)

    def __call__(self, seconds: np.ndarray | float) -> np.ndarray:
        return np.interp(seconds, self.real, self.shown)

    @property
    def unit_name(self) -> str:
        return "ms" if self.unit < 1 else "s"

    def ticks(self) -> tuple[list[float], list[str]]:
        from matplotlib.ticker import MaxNLocator

        where, labels = [], []
        for (lo, hi, x0, x1), instant in zip(self.segments, self.instants, strict=True):
            bins = max(1, round((x1 - x0) * 9))
            values = MaxNLocator(nbins=bins, steps=[1, 2, 5, 10]).tick_values(lo / self.unit, hi / self.unit)
            values = [v for v in values if lo / self.unit - 1e-9 <= v <= hi / self.unit + 1e-9]
            if instant or not values:
                values = [lo / self.unit]
            step = values[1] - values[0] if len(values) > 1 else max(abs(values[0]) if values else 1.0, 1e-12)
            decimals = max(0, -math.floor(math.log10(step) + 1e-9))
            for v in values:
                where.append(float(self(v * self.unit)))
                labels.append(f"{v:.{decimals}f}" if len(values) > 1 else f"{v:.6g}")
        return where, labels


def _time_axis(intervals: np.ndarray) -> _TimeAxis:
    """The axis for activity ``intervals`` ([k, 2] seconds: arrivals as points, admit -> end spans)."""
    order = np.argsort(intervals[:, 0], kind="stable")
    clusters: list[list[float]] = []
    for lo, hi in intervals[order]:
        if clusters and lo <= clusters[-1][1]:
            clusters[-1][1] = max(clusters[-1][1], hi)
        else:
            clusters.append([float(lo), float(hi)])
    busy = sum(hi - lo for lo, hi in clusters)
    span = clusters[-1][1] - clusters[0][0]
    tiny = max(span * 1e-6, 1e-9)
    idle = [(clusters[k + 1][0] - clusters[k][1], k) for k in range(len(clusters) - 1)]
    cut_after = sorted(k for gap, k in sorted(idle, reverse=True)[:_MAX_BREAKS] if gap > max(busy, 100 * tiny))
    bounds = [0, *(k + 1 for k in cut_after), len(clusters)]
    real = [(clusters[a][0], clusters[b - 1][1]) for a, b in itertools.pairwise(bounds)]
    longest = max(hi - lo for lo, hi in real)
    floor_len = longest * 1e-3 if longest > 0 else 1e-3  # a segment of one instant still gets a width
    instants = tuple(hi - lo < floor_len for lo, hi in real)
    real = [(lo, max(hi, lo + floor_len)) for lo, hi in real]
    lengths = np.array([hi - lo for lo, hi in real])
    # A floor per segment: an arrival alone needs room for its mark, activity room to be read.
    share = np.maximum(lengths / lengths.sum(), np.where(instants, 0.05, min(0.5 / len(real), 0.15)))
    widths = share / share.sum() * (1.0 - _BREAK_WIDTH * (len(real) - 1))
    knots_real, knots_shown, segments = [], [], []
    x = 0.0
    for (lo, hi), w in zip(real, widths, strict=True):
        pad = max(0.03 * w, 0.01)  # keeps marks (an arrival's triangle) off the axis edge and off a cut
        per = (hi - lo) / (w - 2 * pad)
        knots_real += [lo - pad * per, hi + pad * per]
        knots_shown += [x, x + w]
        segments.append((lo, hi, x, x + w))
        x += w + _BREAK_WIDTH
    cuts = tuple((real[k][1], real[k + 1][0], segments[k][3], segments[k + 1][2]) for k in range(len(real) - 1))
    # Drop knots that a padded neighbour overran (a cut is always wider than the padding, but be safe).
    keep_real, keep_shown = [knots_real[0]], [knots_shown[0]]
    for r, s in zip(knots_real[1:], knots_shown[1:], strict=True):
        if r > keep_real[-1]:
            keep_real.append(r)
            keep_shown.append(s)
    widest = max(hi - lo for lo, hi in real)
    unit = 1e-3 if max(widest, real[-1][1]) < 2.0 else 1.0
    return _TimeAxis(np.array(keep_real), np.array(keep_shown), tuple(segments), instants, cuts, unit)


def _gap_ticks(lo: float, hi: float) -> list[float]:
    """1-2-5 ticks (ms) covering [lo, hi] on a log axis, at most about eight of them."""
    values = [
        m * 10.0**e for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 2) for m in (1, 2, 5)
    ]
    inside = [v for v in values if lo <= v <= hi]
    if len(inside) < 3:  # less than a decade: finer steps
        values = [
            m * 10.0**e
            for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 2)
            for m in (1, 1.5, 2, 3, 4, 5, 6, 7, 8)
        ]
        inside = [v for v in values if lo <= v <= hi]
        inside = inside[:: max(1, math.ceil(len(inside) / 6))]
    if len(inside) > 8:
        inside = [v for v in inside if round(v / 10.0 ** math.floor(math.log10(v) + 1e-9)) == 1] or inside
    return inside


def _fmt_ms(ms: float) -> str:
    return _fmt_duration(ms / 1e3)


def timeline_figure(traces: Sequence[RequestTrace]) -> Any:
    """The timeline as a matplotlib ``Figure`` (no pyplot, no I/O): above, one row per request (arrival,
    queue, prefill, decode, a tick per token, TTFT; for one request the slowest gaps too); below, every
    inter-token gap against time with its p50 and p99, coloured by the step's batch size where that
    varies. Both share a time axis in ms or s that cuts long idle stretches (see :class:`_TimeAxis`)."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import FixedLocator, MaxNLocator, NullFormatter, NullLocator

    rows = sorted(traces, key=lambda t: t.start_unix_nano)
    n = len(rows)
    fig = Figure(figsize=(12, min(2.2 + 0.22 * max(n, 1), 9.0) + 3.4), layout="constrained")
    ax_req, ax_gap = fig.subplots(2, 1, height_ratios=[min(1.2 + 0.22 * max(n, 1), 7.0), 2.6])
    ax_req.set_label("requests")
    ax_gap.set_label("gaps")
    if not rows:
        ax_req.text(0.5, 0.5, "no request traces", ha="center", va="center", transform=ax_req.transAxes)
        ax_gap.set_axis_off()
        return fig

    t0 = min(t.start_unix_nano for t in rows)
    arrive = np.array([(t.start_unix_nano - t0) / 1e9 for t in rows])
    admit = arrive + np.array([t.queue_s for t in rows])
    first = np.array(
        [a + (t.token_s[0] if t.output_tokens else t.queue_s + t.prefill_s) for a, t in zip(arrive, rows, strict=True)]
    )
    last = np.array([a + (t.token_s[-1] if t.output_tokens else 0.0) for a, t in zip(arrive, rows, strict=True)])
    end = np.maximum.reduce([arrive + np.array([t.duration_s for t in rows]), first, last, admit])
    axis = _time_axis(np.concatenate([np.stack([arrive, arrive], 1), np.stack([admit, end], 1)]))
    xa, xq, xf, xe = axis(arrive), axis(admit), axis(first), axis(end)
    ys = np.arange(n)
    has_tokens = np.array([t.output_tokens > 0 for t in rows])
    summary = summarize(rows)

    # Requests: decode under prefill under queue, so the narrow ones stay on top and visible.
    ax_req.barh(
        ys[has_tokens], (xe - xf)[has_tokens], left=xf[has_tokens], color=_DECODE, height=0.6, zorder=2, gid="decode"
    )
    had_prefill = has_tokens | np.array([t.prefill_s > 0 for t in rows])
    ax_req.barh(
        ys[had_prefill],
        np.maximum(xf - xq, _MIN_BAR)[had_prefill],
        left=xq[had_prefill],
        color=_PREFILL,
        height=0.6,
        zorder=3,
        gid="prefill",
    )
    ax_req.barh(ys, np.maximum(xq - xa, _MIN_BAR), left=xa, color=_QUEUE, height=0.6, zorder=4, gid="queue")
    marker_size = max(1.5, min(8.0, 160.0 / n))
    ax_req.plot(xa, ys, linestyle="none", marker=5, color="black", markersize=marker_size, zorder=6, gid="arrival")
    if n <= _MAX_TOKEN_ROWS:
        tx = np.concatenate([axis(a + t.token_s) for a, t in zip(arrive, rows, strict=True)])
        ty = np.concatenate([np.full(t.output_tokens, y) for y, t in enumerate(rows)])
        ax_req.plot(
            tx, ty, linestyle="none", marker="|", color=_TOKEN, markersize=marker_size * 1.2, zorder=5, gid="tokens"
        )
    ax_req.plot(
        xf[has_tokens],
        ys[has_tokens],
        linestyle="none",
        marker="|",
        color=_MARK,
        markersize=marker_size * 1.8,
        markeredgewidth=2 if n <= _MAX_TOKEN_ROWS else 1,
        zorder=7,
        gid="ttft",
        label="TTFT",
    )
    labels = _short_labels([t.request_id for t in rows])
    step = math.ceil(n / _MAX_ID_LABELS)
    ax_req.set_yticks(ys[::step], labels[::step], fontsize=7 if n > 12 else 8)
    ax_req.set_ylim(n - 0.5, -0.5) if n > 1 else ax_req.set_ylim(0.8, -0.8)  # one row: room for its labels
    legend = [
        Line2D([], [], linestyle="none", marker=5, color="black", label="arrival"),
        Patch(color=_QUEUE, label="queue"),
        Patch(color=_PREFILL, label="prefill"),
        Patch(color=_DECODE, label="decode"),
        *([Line2D([], [], linestyle="none", marker="|", color=_TOKEN, label="token")] if n <= _MAX_TOKEN_ROWS else []),
        Line2D([], [], linestyle="none", marker="|", markeredgewidth=2, color=_MARK, label="first token (TTFT)"),
    ]
    if n == 1:
        _mark_one_request(ax_req, axis, rows[0], arrive[0], legend)
    ax_req.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)

    # Inter-token gaps against time.
    xs = [axis(a + t.token_s[1:]) for a, t in zip(arrive, rows, strict=True) if t.output_tokens > 1]
    if xs:
        gx = np.concatenate(xs)
        gy = np.concatenate([t.inter_token_s * 1e3 for t in rows if t.output_tokens > 1])
        batch = np.concatenate([t.batch_sizes[1:] for t in rows if t.output_tokens > 1])
        positive = gy[gy > 0]
        # Identical timestamps give zero gaps: they sit on the floor of the log axis (or, all zero, on a line).
        floor = float(positive.min()) / 2 if positive.size else 0.0
        gy_shown = np.maximum(gy, floor)
        dot = 14 if len(gy) < 200 else 5 if len(gy) < 5000 else 2
        if batch.min() != batch.max():
            sc = ax_gap.scatter(gx, gy_shown, c=batch, s=dot, cmap="viridis", zorder=3, rasterized=True, linewidths=0)
            bar = fig.colorbar(sc, ax=ax_gap, label="batch size", pad=0.01)
            bar.ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            batch_note = f"batch size {int(batch.min())}-{int(batch.max())}"
        else:
            ax_gap.scatter(gx, gy_shown, color=_TOKEN, s=dot, zorder=3, rasterized=True, linewidths=0)
            batch_note = f"batch size {int(batch[0])} in every step"
        p50, p99 = summary.inter_token_ms[50], summary.inter_token_ms[99]
        for p, value, style in ((50, p50, "-"), (99, p99, "--")):
            ax_gap.axhline(
                max(value, floor),
                color=_MARK,
                linestyle=style,
                linewidth=1,
                zorder=4,
                gid=f"p{p}",
                label=f"p{p} {_fmt_ms(value)}",
            )
        if positive.size:
            ax_gap.set_yscale("log")  # one slow step (a compile, a long prefill) must not flatten the rest
            lo, hi = float(gy_shown.min()) / 1.3, float(gy_shown.max()) * 1.3
            ax_gap.set_ylim(lo, hi)
            ticks = _gap_ticks(lo, hi)
        else:
            ax_gap.set_ylim(-1.0, 1.0)
            ticks = [0.0]
        ax_gap.yaxis.set_major_locator(FixedLocator(ticks))
        ax_gap.set_yticks(ticks, [_fmt_ms(v) for v in ticks])
        ax_gap.yaxis.set_minor_locator(NullLocator())
        ax_gap.yaxis.set_minor_formatter(NullFormatter())
        worst = int(np.argmax(gy))
        ax_gap.annotate(
            f"slowest {_fmt_ms(gy[worst])}",
            (gx[worst], gy_shown[worst]),
            xytext=(6, -2),
            textcoords="offset points",
            fontsize=8,
            color=_MARK,
            va="top",
        )
        ax_gap.legend(
            loc="upper left",
            bbox_to_anchor=(1.005, 1.0) if batch.min() == batch.max() else (0.0, 1.0),
            fontsize=8,
            frameon=False,
        )
        scale = " (log scale)" if positive.size else ""
        ax_gap.set_title(f"inter-token gaps{scale}, {batch_note}", fontsize=9, loc="left")
    else:
        tokens = sum(t.output_tokens for t in rows)
        ax_gap.text(
            0.5,
            0.5,
            f"no inter-token gaps: {tokens} output token{'s' if tokens != 1 else ''}",
            ha="center",
            va="center",
            transform=ax_gap.transAxes,
            fontsize=10,
            color="#444444",
        )
        ax_gap.set_yticks([])
        ax_gap.set_title("inter-token gaps", fontsize=9, loc="left")
    ax_gap.set_ylabel("gap")

    # The shared time axis: ticks per segment, a hatched band with the skipped time at each cut.
    where, tick_labels = axis.ticks()
    for ax in (ax_req, ax_gap):
        ax.set_xlim(0.0, 1.0)
        ax.set_xticks(where, tick_labels if ax is ax_gap else [""] * len(where), fontsize=8)
        ax.grid(axis="x", color="#e6e6e6", zorder=0)
        for lo, hi, x0, x1 in axis.cuts:
            # Over the bars above (a queue that spans the cut shows it), under the dots below.
            over = ax is ax_req
            ax.axvspan(
                x0,
                x1,
                facecolor=(1, 1, 1, 0.6) if over else "#f4f4f4",
                edgecolor="#999999",
                hatch="//",
                linewidth=0,
                zorder=5.5 if over else 1,
                gid="cut",
            )
            if ax is ax_gap:
                ax.text(
                    (x0 + x1) / 2,
                    0.5,
                    f"{_fmt_duration(hi - lo)} skipped",
                    transform=ax.get_xaxis_transform(),
                    rotation=90,
                    ha="center",
                    va="center",
                    fontsize=8,
                    color="#333333",
                    bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0},
                    zorder=8,
                    gid="cut-label",
                )
    what = "since the first arrival" if n > 1 else "since arrival"
    cut_note = ", hatched: idle time cut out" if axis.cuts else ""
    ax_gap.set_xlabel(f"{axis.unit_name} {what}{cut_note}")

    ttft, gaps = summary.ttft_ms, summary.inter_token_ms
    stats = []
    if ttft:
        stats.append(f"TTFT p50 {_fmt_ms(ttft[50])}  p99 {_fmt_ms(ttft[99])}" if n > 1 else f"TTFT {_fmt_ms(ttft[50])}")
    if gaps:
        stats.append(f"inter-token p50 {_fmt_ms(gaps[50])}  p99 {_fmt_ms(gaps[99])}")
    if n == 1:
        t = rows[0]
        head = (
            f"request {t.request_id}: {t.output_tokens} output token{'' if t.output_tokens == 1 else 's'}, "
            f"prompt {t.prompt_tokens}, "
            f"finish {t.finish_reason or '-'}, {_fmt_duration(t.duration_s)}"
        )
        stats.insert(0, f"queue {_fmt_duration(t.queue_s)}  prefill {_fmt_duration(t.prefill_s)}")
    else:
        span = _fmt_duration(float(end.max()))
        head = f"{n} requests, {summary.tokens} output tokens, {span} from the first arrival to the last token"
    ax_req.set_title(head + "\n" + "   |   ".join(stats), fontsize=9, loc="left")
    return fig


def _mark_one_request(ax: Any, axis: _TimeAxis, t: RequestTrace, arrive: float, legend: list) -> None:
    """For a single request: the TTFT line, each phase's length in words, and the slowest gaps in red."""
    from matplotlib.lines import Line2D

    phases = [f"queue {_fmt_duration(t.queue_s)}"]
    if t.output_tokens or t.prefill_s > 0:
        phases.append(f"prefill {_fmt_duration(t.prefill_s)}")
    if t.output_tokens:
        ttft = f"TTFT {_fmt_duration(t.token_s[0])}"
        phases.append(f"first token: {ttft}")
        x = float(axis(arrive + t.token_s[0]))
        ttft_line = ax.axvline(x, color=_MARK, linewidth=1, linestyle=":", zorder=6, gid="ttft-line", label=ttft)
        legend.append(ttft_line)
    ax.text(
        float(axis(arrive)),
        -0.36,
        " → ".join(phases),
        fontsize=8,
        va="bottom",
        ha="left",
        gid="phases",
        zorder=8,  # over a cut's hatching
        bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.0},
    )
    if t.output_tokens > 1:
        gaps = t.inter_token_s
        slow = np.argsort(gaps, kind="stable")[::-1][: min(3, len(gaps))]
        for rank, i in enumerate(slow):
            x0, x1 = float(axis(arrive + t.token_s[i])), float(axis(arrive + t.token_s[i + 1]))
            ax.barh(0, max(x1 - x0, _MIN_BAR / 2), left=x0, height=0.3, color=_MARK, zorder=4.5, gid="slow-gap")
            if rank == 0:
                middle = (x0 + x1) / 2
                ax.text(
                    middle,
                    0.36,
                    f"slowest gap {_fmt_duration(gaps[i])} (before token {i + 1})",
                    fontsize=8,
                    color=_MARK,
                    ha="left" if middle < 0.25 else "right" if middle > 0.75 else "center",
                    va="top",
                    gid="slowest-gap",
                )
        legend.append(Line2D([], [], color=_MARK, linewidth=4, label=f"{len(slow)} slowest gaps"))


def plot_timeline(traces: Sequence[RequestTrace], path: str | Path) -> Path:
    """Writes :func:`timeline_figure` as a PNG at ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    path = Path(path)
    fig = timeline_figure(traces)
    FigureCanvasAgg(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
