"""The picture of a set of request traces: one row per request (arrival, queue, prefill, first token,
tokens) on a time axis that cuts long idle stretches, and below it every inter-token gap over time
with p50/p99 marked. Imports matplotlib when called; writes nothing but the file asked for.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from switchyard.service.telemetry.traces import RequestTrace, summarize

_QUEUE, _PREFILL, _DECODE, _TOKEN, _MARK = "#6e6e6e", "#e69f00", "#9ecae1", "#08306b", "#d62728"
_CHUNK = "#8c4b00"  # a prefill chunk's step, on the prefill bar
_MAX_CHUNK_LABELS = 12  # one request: each chunk's step number written up to this many chunks
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
    chunked = [(y, a, t) for y, (a, t) in enumerate(zip(arrive, rows, strict=True)) if t.prefill_chunks]
    if chunked and n <= _MAX_TOKEN_ROWS:
        # Which steps carried each prompt: a mark where each chunk's step was launched.
        ax_req.plot(
            np.concatenate([axis(a + t.chunk_s) for _, a, t in chunked]),
            np.concatenate([np.full(t.prefill_chunks, y) for y, _, t in chunked]),
            linestyle="none",
            marker="D",
            color=_CHUNK,
            markersize=max(1.5, marker_size * 0.6),
            zorder=5.5,
            gid="prefill-chunks",
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
        *(
            [Line2D([], [], linestyle="none", marker="D", markersize=4, color=_CHUNK, label="prefill chunk's step")]
            if chunked and n <= _MAX_TOKEN_ROWS
            else []
        ),
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
        phases.append(f"prefill {_fmt_duration(t.prefill_s)}{_prefill_words(t)}")
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
    if 0 < t.prefill_chunks <= _MAX_CHUNK_LABELS:
        for at, step in zip(t.chunk_s, t.chunk_steps, strict=True):
            ax.text(
                float(axis(arrive + at)),
                0.33,
                f"step {int(step)}",
                fontsize=7,
                color=_CHUNK,
                rotation=90,
                ha="center",
                va="top",
                gid="chunk-step",
                zorder=8,
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


def _prefill_words(t: RequestTrace) -> str:
    """' (3 chunks, 256 of 300 prompt tokens cached)', or what of it the trace records."""
    parts = []
    if t.prefill_chunks:
        parts.append(f"{t.prefill_chunks} chunk{'' if t.prefill_chunks == 1 else 's'}")
    if t.cached_tokens:
        parts.append(f"{t.cached_tokens} of {t.prompt_tokens} prompt tokens cached")
    if t.preemptions:
        parts.append(f"preempted {t.preemptions}x")
    return f" ({', '.join(parts)})" if parts else ""


def plot_timeline(traces: Sequence[RequestTrace], path: str | Path) -> Path:
    """Writes :func:`timeline_figure` as a PNG at ``path``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    path = Path(path)
    fig = timeline_figure(traces)
    FigureCanvasAgg(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
