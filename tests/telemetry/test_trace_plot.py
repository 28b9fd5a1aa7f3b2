"""The ``switchyard trace`` timeline: written for every shape of input, and its content checked on the
matplotlib artists of :func:`timeline_figure` (bar widths and spans in axis fraction, marks, labels)."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from switchyard.service.telemetry import timeline
from switchyard.service.telemetry import traces as T
from switchyard.service.telemetry.traces import RequestTrace

T0_NS = 1_700_000_000 * 10**9


def trace(
    request_id: str = "r-1",
    *,
    start_s: float = 0.0,
    queue_s: float = 0.0001,
    prefill_s: float = 0.015,
    tokens: int = 40,
    gap_s: float = 0.005,
    batch: int | np.ndarray = 4,
    seed: int = 0,
) -> RequestTrace:
    """A finished request: ``tokens`` tokens, the first at queue + prefill, then ``gap_s`` apart with jitter."""
    rng = np.random.default_rng(seed)
    gaps = gap_s + rng.exponential(gap_s * 0.1, max(tokens - 1, 0)) if gap_s > 0 else np.zeros(max(tokens - 1, 0))
    token_s = queue_s + prefill_s + np.concatenate([[0.0], np.cumsum(gaps)])[:tokens]
    batch_sizes = (
        np.broadcast_to(np.asarray(batch, dtype=np.int32), (tokens,)).copy() if tokens else np.zeros(0, np.int32)
    )
    return RequestTrace(
        request_id=request_id,
        model="tiny",
        prompt_tokens=11,
        finish_reason="length",
        start_unix_nano=T0_NS + round(start_s * 1e9),
        queue_s=queue_s,
        prefill_s=prefill_s if tokens else 0.0,
        duration_s=(float(token_s[-1]) if tokens else queue_s) + 0.0002,
        token_s=token_s,
        steps=np.arange(tokens, dtype=np.int64) - 1,
        batch_sizes=batch_sizes,
    )


def many(n: int = 300, tokens: int = 300) -> list[RequestTrace]:
    return [
        trace(
            f"chatcmpl-load-test-{i:06d}",
            start_s=0.05 * i,
            queue_s=0.0003 + 0.002 * (i % 9),
            tokens=tokens,
            gap_s=0.006,
            batch=1 + (np.arange(tokens) // 20 + i // 10) % 32,
            seed=i,
        )
        for i in range(n)
    ]


CASES = {
    "one request": lambda: [trace()],
    "a few close together": lambda: [trace(f"r-{i}", start_s=0.03 * i, seed=i) for i in range(4)],
    "minutes apart": lambda: [trace("early"), trace("late", start_s=300.0, seed=1)],
    "300 requests, varying batch": many,
    "0 output tokens": lambda: [trace(tokens=0)],
    "1 output token": lambda: [trace(tokens=1)],
    "a huge queue time": lambda: [trace(queue_s=60.0)],
    "identical timestamps": lambda: [trace("x", queue_s=0, prefill_s=0, gap_s=0, tokens=3), trace("y", tokens=0)],
    "no traces": lambda: [],
}


def axes(fig) -> dict:
    return {ax.get_label(): ax for ax in fig.axes}


def patches(ax, gid: str) -> list:
    return [p for p in ax.patches if p.get_gid() == gid]


def line(ax, gid: str):
    (found,) = [ln for ln in ax.lines if ln.get_gid() == gid]
    return found


def axis_fraction(ax, x0: float, x1: float) -> float:
    """Width of the data interval [x0, x1] as a fraction of the axes' width."""
    to_axes = ax.transData + ax.transAxes.inverted()
    (a, _), (b, _) = to_axes.transform([(x0, 0.0), (x1, 0.0)])
    return abs(b - a)


def row_extents(ax) -> dict[float, tuple[float, float]]:
    """Each request row's left and right end (data x), from its queue, prefill and decode bars."""
    rows: dict[float, tuple[float, float]] = {}
    for gid in ("queue", "prefill", "decode"):
        for p in patches(ax, gid):
            y = round(p.get_y() + p.get_height() / 2, 3)
            lo, hi = rows.get(y, (np.inf, -np.inf))
            rows[y] = (min(lo, p.get_x()), max(hi, p.get_x() + p.get_width()))
    return rows


@pytest.mark.parametrize("case", CASES)
def test_the_png_is_written_for_every_case(case: str, tmp_path) -> None:
    path = timeline.plot_timeline(CASES[case](), tmp_path / "out" / "timeline.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_timeline_leaves_no_pyplot_figure_open(tmp_path) -> None:
    import matplotlib.pyplot as plt

    before = plt.get_fignums()
    timeline.plot_timeline([trace()], tmp_path / "t.png")
    assert plt.get_fignums() == before


def test_a_sub_millisecond_queue_is_still_visible() -> None:
    fig = timeline.timeline_figure([trace(queue_s=0.0001, tokens=60)])  # 0.1 ms of ~310 ms: 0.03 % of the axis
    ax = axes(fig)["requests"]
    (queue,) = patches(ax, "queue")
    assert axis_fraction(ax, queue.get_x(), queue.get_x() + queue.get_width()) >= 0.004
    (prefill,) = patches(ax, "prefill")
    assert queue.get_zorder() > prefill.get_zorder()  # drawn over the prefill it overlaps


def test_one_request_marks_its_ttft_phases_and_slowest_gaps() -> None:
    t = trace(queue_s=0.002, prefill_s=0.020)
    t.token_s[10:] += 0.030  # one stall of 30 ms before token 10
    ax = axes(timeline.timeline_figure([t]))["requests"]
    ttft = line(ax, "ttft-line")
    assert ttft.get_label() == "TTFT 22 ms"
    assert ttft.get_xdata()[0] == pytest.approx(line(ax, "tokens").get_xdata()[0])  # on the first token
    texts = {x.get_gid(): x.get_text() for x in ax.texts}
    assert texts["phases"] == "queue 2 ms → prefill 20 ms → first token: TTFT 22 ms"
    assert t.inter_token_s.max() > 0.030
    assert texts["slowest-gap"] == f"slowest gap {timeline._fmt_duration(t.inter_token_s.max())} (before token 10)"
    assert len(patches(ax, "slow-gap")) == 3
    legend = [x.get_text() for x in ax.get_legend().get_texts()]
    assert "TTFT 22 ms" in legend and "3 slowest gaps" in legend


def test_every_request_gets_a_ttft_mark_and_an_arrival() -> None:
    traces = [trace(f"r-{i}", start_s=0.02 * i, seed=i) for i in range(5)] + [trace("none", tokens=0)]
    ax = axes(timeline.timeline_figure(traces))["requests"]
    assert len(line(ax, "ttft").get_xdata()) == 5
    assert len(line(ax, "arrival").get_xdata()) == 6


@pytest.mark.parametrize("traces", [[trace(tokens=200)], many(40, 50)], ids=["one", "forty"])
def test_p50_and_p99_are_marked_with_their_values(traces) -> None:
    fig = timeline.timeline_figure(traces)
    ax = axes(fig)["gaps"]
    summary = T.summarize(traces)
    for p in (50, 99):
        mark = line(ax, f"p{p}")
        assert mark.get_ydata()[0] == pytest.approx(summary.inter_token_ms[p])
        assert mark.get_label() == f"p{p} {timeline._fmt_ms(summary.inter_token_ms[p])}"
        assert mark.get_label() in [x.get_text() for x in ax.get_legend().get_texts()]


def test_a_constant_batch_size_is_said_in_words_not_as_a_colour_bar() -> None:
    fig = timeline.timeline_figure([trace(f"r-{i}", start_s=0.01 * i, batch=8) for i in range(3)])
    assert set(axes(fig)) == {"requests", "gaps"}  # no colour bar axes
    assert "batch size 8 in every step" in axes(fig)["gaps"].get_title(loc="left")


def test_a_varying_batch_size_gets_a_colour_bar() -> None:
    fig = timeline.timeline_figure(many(20, 60))
    assert len(fig.axes) == 3
    (bar,) = [ax for ax in fig.axes if ax.get_label() not in ("requests", "gaps")]
    assert bar.get_ylabel() == "batch size"


def test_tick_labels_are_plain_numbers_with_units() -> None:
    slow = trace("slow", tokens=50, gap_s=0.00002)
    slow.token_s[25:] += 4.0  # gaps from ~20 µs to 4 s: five decades on the log axis
    for traces in ([trace()], [slow], many(30, 40)):
        fig = timeline.timeline_figure(traces)
        FigureCanvasAgg(fig).draw()
        gaps = axes(fig)["gaps"]
        labels = [x.get_text() for x in gaps.get_yticklabels() + gaps.get_xticklabels()]
        assert labels and all(label for label in labels)
        assert not any("×" in label or "$" in label or "10^" in label for label in labels), labels
        assert all(x.get_text().endswith(("ms", " s", "µs")) for x in gaps.get_yticklabels())


def test_long_ids_with_a_shared_start_or_end_get_distinct_readable_labels() -> None:
    shared = "chatcmpl-2026-11-23-load-generator-batch-"
    ids = [
        shared + "000017",
        shared + "000018",
        "a" * 20 + "-left-" + "z" * 20,  # these two differ only in the middle
        "a" * 20 + "-right" + "z" * 20,
        "short",
        "short",  # the same id twice: two rows, still two labels
    ]
    traces = [trace(r, start_s=0.01 * i) for i, r in enumerate(ids)]
    ax = axes(timeline.timeline_figure(traces))["requests"]
    labels = [x.get_text() for x in ax.get_yticklabels()]
    assert len(set(labels)) == len(ids)
    assert labels[:2] == ["chatcmpl-202…atch-000017", "chatcmpl-202…atch-000018"]  # start and end kept
    assert sum(label.startswith("short") for label in labels) == 2


def test_requests_minutes_apart_each_keep_a_readable_span() -> None:
    traces = [
        trace("early-short", tokens=3),  # ~25 ms
        trace("late-long", start_s=300.0, tokens=1000),  # ~5 s, five minutes later
        trace("later", start_s=900.0, tokens=40),
    ]
    fig = timeline.timeline_figure(traces)
    ax = axes(fig)["requests"]
    spans = [axis_fraction(ax, lo, hi) for lo, hi in row_extents(ax).values()]
    assert len(spans) == 3 and min(spans) >= 0.05, spans
    cuts = [x.get_text() for x in axes(fig)["gaps"].texts if x.get_gid() == "cut-label"]
    assert len(cuts) == 2 and all(c.endswith("min skipped") for c in cuts), cuts


def test_a_huge_queue_leaves_room_for_the_tokens() -> None:
    ax = axes(timeline.timeline_figure([trace(queue_s=60.0)]))["requests"]
    tokens = line(ax, "tokens").get_xdata()
    assert axis_fraction(ax, tokens.min(), tokens.max()) >= 0.5


def test_the_timeline_without_tokens_or_gaps_says_so() -> None:
    for traces, words in (([trace(tokens=0)], "0 output tokens"), ([trace(tokens=1)], "1 output token")):
        gap_texts = [x.get_text() for x in axes(timeline.timeline_figure(traces))["gaps"].texts]
        assert any(words in text for text in gap_texts), gap_texts
