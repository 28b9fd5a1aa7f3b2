"""Prometheus metrics of the server, for ``GET /metrics`` on the HTTP port.

Two sources, neither a hook in the engine's step: each finished request's ``RequestRecord`` (the
record the traces are made of, handed over on the recorder's background thread: histograms of time
to first token, inter-token gaps, end-to-end and queue time, tokens per request; counters of
requests, tokens, prefix-cache hits and preemptions), and the scheduler's counts read at scrape time
(requests running and waiting, KV blocks held, the pool's size), which the engine process sends
after every step anyway.

Names are ours (``switchyard_*``, Prometheus conventions: base units, ``_total`` counters), plus
the gauges the Gateway API Inference Extension's model-server protocol reads to route between pods
(queue length, requests running, KV-cache utilisation), under the names its endpoint picker scrapes
by default (vLLM's). Every series carries ``model_name``. One registry per server, so that several
servers in one process (tests) keep their own counts.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from switchyard.service.telemetry.tracing import DURATION_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS

CONTENT_TYPE = CONTENT_TYPE_LATEST
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
STEPS_REMEMBERED = 4096  # engine steps whose emit time is kept to measure the next step against

# The endpoint picker's defaults (the model-server protocol names vLLM's as its reference).
GIE_QUEUED = "vllm:num_requests_waiting"
GIE_RUNNING = "vllm:num_requests_running"
GIE_KV_USAGE = "vllm:kv_cache_usage_perc"  # a fraction in [0, 1], despite the name, as vLLM's
GIE_KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"  # the name older endpoint pickers read


# () -> (running, waiting, KV blocks held, KV blocks in the pool, block size), or None before the
# engine is up: what the gauges read at scrape time.
CountsSource = Callable[[], tuple[int, int, int, int, int] | None]


class _Gauges:
    """A custom collector: gauges computed at scrape time from the scheduler's counts."""

    def __init__(self, model: str, counts: Callable[[], CountsSource | None]) -> None:
        self._model = model
        self._counts = counts

    def collect(self) -> Iterable[Any]:
        source = self._counts()
        sample = source() if source is not None else None
        running, waiting, held, total, block = sample or (0, 0, 0, 0, 0)
        usage = held / total if total else 0.0

        def gauge(name: str, doc: str, value: float, **labels: str) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name", *labels])
            family.add_metric([self._model, *labels.values()], value)
            return family

        yield gauge("switchyard_num_requests_running", "Requests holding a decode slot.", running)
        yield gauge("switchyard_num_requests_waiting", "Requests waiting for a decode slot.", waiting)
        yield gauge("switchyard_kv_cache_blocks_held", "KV blocks the requests hold.", held)
        yield gauge("switchyard_kv_cache_blocks", "KV blocks in the pool.", total)
        yield gauge("switchyard_kv_cache_usage_ratio", "Share of the KV pool's blocks held, 0 to 1.", usage)
        yield gauge(GIE_QUEUED, "Requests waiting (the inference gateway's queue length).", waiting)
        yield gauge(GIE_RUNNING, "Requests running (the inference gateway's running requests).", running)
        yield gauge(GIE_KV_USAGE, "KV-cache utilisation, 0 to 1 (the inference gateway's).", usage)
        yield gauge(GIE_KV_USAGE_OLD, "KV-cache utilisation, 0 to 1 (older inference gateways' name).", usage)
        info = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration (the inference gateway's).",
                                 labels=["model_name", "block_size", "num_gpu_blocks"])
        info.add_metric([self._model, str(block), str(total)], 1.0)
        yield info


class Metrics:
    """The server's Prometheus registry (module docstring). :meth:`observe` takes finished requests'
    records (one thread: the recorder's); :meth:`http_request` counts HTTP answers (the event loop)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry(auto_describe=True)
        self.counts: CountsSource | None = None
        r, m = self.registry, ["model_name"]
        self.requests = Counter("switchyard_requests", "Finished requests, by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.prompt_tokens = Counter("switchyard_prompt_tokens", "Prompt tokens of finished requests.", m, registry=r)
        self.generation_tokens = Counter("switchyard_generation_tokens", "Tokens generated.", m, registry=r)
        self.prefix_queries = Counter("switchyard_prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.", m, registry=r)
        self.prefix_hits = Counter("switchyard_prefix_cache_hits",
                                   "Prompt tokens whose KV came from the prefix cache.", m, registry=r)
        self.preemptions = Counter("switchyard_preemptions", "Times a request lost its KV blocks and was recomputed.",
                                   m, registry=r)
        self.ttft = Histogram("switchyard_time_to_first_token_seconds", "Arrival to the first token.", m,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("switchyard_inter_token_latency_seconds", "Time between two tokens of a request.", m,
                             buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("switchyard_e2e_request_latency_seconds", "Arrival to the final event.", m,
                             buckets=DURATION_BUCKETS, registry=r)
        self.queue = Histogram("switchyard_request_queue_time_seconds", "Arrival to a decode slot.", m,
                               buckets=TTFT_BUCKETS, registry=r)
        self.prompt_sizes = Histogram("switchyard_request_prompt_tokens", "Prompt tokens per request.", m,
                                      buckets=TOKEN_BUCKETS, registry=r)
        self.output_sizes = Histogram("switchyard_request_generation_tokens", "Tokens generated per request.", m,
                                      buckets=TOKEN_BUCKETS, registry=r)
        self.steps = Histogram("switchyard_engine_step_seconds",
                               "Time from one engine step's tokens to the next step's.", m,
                               buckets=TPOT_BUCKETS, registry=r)
        self.http = Counter("switchyard_http_requests", "HTTP requests answered, by route and status.",
                            ["model_name", "route", "status"], registry=r)
        self.registry.register(_Gauges(model, lambda: self.counts))
        self._step_times: collections.OrderedDict[int, float] = collections.OrderedDict()
        # Totals for KServe's ModelStatistics, read from another thread.
        self._lock = threading.Lock()
        self.totals = {"success": 0, "success_ns": 0, "fail": 0, "fail_ns": 0, "queue_ns": 0, "compute_ns": 0,
                       "last_ms": 0}

    def observe(self, record: Any, wall_offset_ns: int = 0) -> None:
        """A finished request's record (the recorder's thread)."""
        model = (self.model,)
        reason = record.finish_reason
        n = int(record.output_tokens)
        self.requests.labels(self.model, reason).inc()
        self.prompt_tokens.labels(*model).inc(record.prompt_tokens)
        self.generation_tokens.labels(*model).inc(n)
        self.prefix_queries.labels(*model).inc(record.prompt_tokens)
        self.prefix_hits.labels(*model).inc(record.cached_tokens)
        if record.preemptions:
            self.preemptions.labels(*model).inc(record.preemptions)
        duration = max(0.0, record.t_end - record.t_submit)
        queued = max(0.0, (record.t_admit or record.t_end) - record.t_submit)
        self.e2e.labels(*model).observe(duration)
        self.queue.labels(*model).observe(queued)
        self.prompt_sizes.labels(*model).observe(record.prompt_tokens)
        self.output_sizes.labels(*model).observe(n)
        if n:
            self.ttft.labels(*model).observe(max(0.0, float(record.token_times[0]) - record.t_submit))
            itl = self.itl.labels(*model)
            times = record.token_times
            for k in range(1, n):
                itl.observe(float(times[k] - times[k - 1]))
            self._observe_steps(record.token_steps, times)
        ok = reason in ("stop", "length")
        with self._lock:
            t = self.totals
            key = "success" if ok else "fail"
            t[key] += 1
            t[key + "_ns"] += int(duration * 1e9)
            if ok:
                t["queue_ns"] += int(queued * 1e9)
                t["compute_ns"] += int((duration - queued) * 1e9)
            t["last_ms"] = max(t["last_ms"], (int(record.t_end * 1e9) + wall_offset_ns) // 1_000_000)

    def _observe_steps(self, steps: Any, times: Any) -> None:
        """Step durations from the records: every token of one engine step is emitted at one time, so
        the gap between the emit times of steps s-1 and s is step s's length as the server saw it. Each
        step is measured once, by the first record that holds it and its predecessor; a gap the records
        leave (no request in a step) measures nothing."""
        seen = self._step_times
        for step, at in zip(steps.tolist(), times.tolist(), strict=True):
            if step < 0 or step in seen:
                continue
            seen[step] = at
            before = seen.get(step - 1)
            if before is not None and at >= before:
                self.steps.labels(self.model).observe(at - before)
            while len(seen) > STEPS_REMEMBERED:
                seen.popitem(last=False)

    def statistics(self) -> dict[str, int]:
        with self._lock:
            return dict(self.totals)

    def http_request(self, route: str, status: int) -> None:
        self.http.labels(self.model, route, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
