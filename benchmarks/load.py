#!/usr/bin/env python3
"""Open-loop load: Poisson arrivals of requests with mixed prompt and output lengths, in-process and through gRPC.

For each rate (``--rates``, requests/s) and each path (``--path``), requests arrive for ``--duration``
seconds with exponential inter-arrival times (seeded; the same schedule and requests on every path of one
rate), whatever the engine's state: arrivals never wait for earlier requests. After the last arrival the
run waits at most ``--timeout`` seconds for the requests in flight; those still running then are cancelled
and counted as ``unfinished``, requests refused or ended by an error as ``failed``.

- ``in-process``: ``GenerationRequest``s submitted straight to the scheduler with ``ignore_eos``, so every
  request generates exactly its output length; arrival = submit time, token times = the scheduler's emit
  times (``TokenEvent.time``).
- ``grpc``: as ``switchyard serve`` runs them, the server in this process and the engine with its
  scheduler in a process of its own (``service/api/engine_process.py``); the client (grpc.aio, one stream
  per request, prompts as token ids, ``ignore_eos`` and ``max_tokens`` = the output length, so every
  request generates exactly its output length here too) in a third process that sends each request at
  its arrival time; arrival and token times are the client's. Its rates run before the in-process ones,
  since its engine must have the devices to itself until it ends.

Prompts are random token ids (never BOS or EOS) of the drawn length; with ``--shared-prefix N`` every
prompt's first N tokens are the same. Length mixes: a list of lengths drawn from uniformly, ``uniform:LO:HI``
(both included) or ``file:PATH`` (one length per line, or a JSON list, drawn from uniformly).

Per (path, rate):

- ``ttft_ms_p50/p99``: time to first token, arrival to first token, over requests with a token;
- ``itl_ms_p50/p99/max``: inter-token gaps, between consecutive tokens of one request, pooled over all
  requests;
- ``output_tokens_per_s``: every output token over the span from the first arrival to the last token;
- ``goodput_rps``: requests that meet the SLO over that same span. A request meets the SLO when it
  finished, its TTFT <= ``--slo-ttft-ms`` and the p99 of its own inter-token gaps <= ``--slo-itl-ms``
  (a request with one token has no gap and meets the inter-token bound);
- ``slo_p99s_hold``: every request sent finished, the TTFT p99 over all requests <= ``--slo-ttft-ms`` and the
  pooled inter-token p99 <= ``--slo-itl-ms``. ``highest_rate_slo_p99s_hold`` is, per path, the highest rate
  measured where they hold (null: none);
- ``by_prompt_length``: per prompt length (each one drawn; with more than 12 lengths, doubling buckets)
  the requests and their TTFT p50/p99; in process also ``queued_ms_p50/p99``, arrival to the launch of
  the step with the prompt's first chunk, so that a TTFT splits into waiting and computing;
- through gRPC, ``server_itl_ms_p99/max``: the inter-token gaps as the server's scheduler emitted the
  tokens, so that a gap the client saw splits into the engine's and the path's;
- with ``--stall-report MS``, ``stalls``: for the longest gaps over MS between a request's tokens (one per
  stretch of time; in process as the scheduler emitted them, through gRPC as the client received them),
  the stacks each thread of this process was seen in most often during the gap (sampled every
  millisecond), to tell a slow step from a thread held back;
- in process, ``engine_steps_per_s``: engine steps over the span, and ``host``: the host's time to launch
  a step, with and without a prompt chunk, the time ``collect`` waits for a step's tokens, and the
  fraction of steps already done when it asked (then the host, not the device, set the pace); per kind
  of step, how many ran at each width (decode rows) and their time on the device, p50 and p99.

Percentiles interpolate linearly between the two nearest ranks (numpy's default): p of n sorted values is
at position p/100 * (n - 1).

    python benchmarks/load.py --preset llama3-8b --batch-slots 64 --max-seq-len 4096 --rates 4 8 12
    python benchmarks/load.py --cpu --preset tiny --rates 20 --duration 1 --prompt-lengths 8 16 \\
        --output-lengths 4 8 --path in-process grpc --max-seq-len 64 --batch-slots 4 --out /tmp/load.json

Writes benchmarks/results/current/load-<device>.json ``{"command","device","date","commit","rows"}`` (a ``--cpu``
run writes only to ``--out``, or prints only).
"""

# No ``from __future__ import annotations``: tests load this file with importlib without registering it in
# sys.modules, where dataclasses cannot resolve string annotations.
import argparse
import bisect
import collections
import concurrent.futures
import dataclasses
import functools
import gc
import itertools
import json
import math
import multiprocessing
import os
import re
import runpy
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from sys import _current_frames as current_frames  # CPython's view of every thread's innermost frame
from types import SimpleNamespace
from typing import Any

from switchyard.service.engine.xla_runtime import apply_process_defaults, xla_allocator

# benchmarks/drive.py (the serving engine built from the benchmark's flags), loaded on first use.
drive = functools.cache(lambda: SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("drive.py")))))
# benchmarks/serve.py (the serving engine's flags; it imports nothing heavy at load), loaded on first use.
serve_bench = functools.cache(lambda: SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("serve.py")))))
# benchmarks/result_file.py (provenance and writing), by its path: PYTHONSAFEPATH=1 keeps benchmarks/ off sys.path.
result_file = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("result_file.py"))))

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("in-process", "grpc")
FINISHED, FAILED, UNFINISHED = "finished", "failed", "unfinished"

# ---- length mixes --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LengthMix:
    """Lengths drawn uniformly from ``choices``, or uniformly from [low, high] when ``choices`` is empty."""

    choices: tuple[int, ...] = ()
    low: int = 0
    high: int = 0

    @property
    def longest(self) -> int:
        return max(self.choices) if self.choices else self.high

    @property
    def shortest(self) -> int:
        return min(self.choices) if self.choices else self.low

    def draw(self, rng: Any, n: int) -> list[int]:
        if self.choices:
            return [self.choices[i] for i in rng.integers(0, len(self.choices), n)]
        return [int(x) for x in rng.integers(self.low, self.high + 1, n)]


def _length(word: str, what: str) -> int:
    try:
        value = int(word)
    except ValueError:
        raise ValueError(f"{what}: {word!r} is not an integer length") from None
    if value < 1:
        raise ValueError(f"{what}: lengths must be at least 1, got {value}")
    return value


def lengths_from_text(text: str, what: str = "lengths") -> tuple[int, ...]:
    """A length file's contents: a JSON list of integers, or one integer per line (blank lines skipped)."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            items = json.loads(stripped)
        except json.JSONDecodeError as err:
            raise ValueError(f"{what}: not a JSON list: {err}") from None
        if not isinstance(items, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in items):
            raise ValueError(f"{what}: the JSON list must hold integers only")
        words = [str(x) for x in items]
    else:
        words = [line.strip() for line in stripped.splitlines() if line.strip()]
    if not words:
        raise ValueError(f"{what}: no lengths")
    return tuple(_length(w, what) for w in words)


def parse_length_mix(spec: Sequence[str], read_text: Any = None) -> LengthMix:
    """``["128", "256"]``, ``["uniform:LO:HI"]`` or ``["file:PATH"]``; ValueError says what is wrong.

    ``read_text(path) -> str`` reads a length file (default: the file system)."""
    words = list(spec)
    if not words:
        raise ValueError("no lengths given")
    head = words[0]
    if head.startswith(("uniform:", "file:")):
        if len(words) > 1:
            raise ValueError(f"{head.split(':')[0]}: takes no other values, got {words[1:]}")
        if head.startswith("uniform:"):
            parts = head.split(":")
            if len(parts) != 3:
                raise ValueError(f"{head!r}: expected uniform:LO:HI")
            low, high = _length(parts[1], head), _length(parts[2], head)
            if low > high:
                raise ValueError(f"{head!r}: LO {low} is above HI {high}")
            return LengthMix(low=low, high=high)
        path = head[len("file:"):]
        if not path:
            raise ValueError("file: expected file:PATH")
        try:
            text = (read_text or (lambda p: Path(p).read_text()))(path)
        except OSError as err:
            raise ValueError(f"{head!r}: cannot read: {err.strerror or err}") from None
        return LengthMix(choices=lengths_from_text(text, head))
    return LengthMix(choices=tuple(_length(w, "lengths") for w in words))


# ---- arrivals and requests -----------------------------------------------------------------------


def poisson_arrivals(rate: float, duration: float, rng: Any) -> list[float]:
    """Arrival offsets (seconds from the start) in [0, duration): exponential gaps of mean 1/rate."""
    if rate <= 0 or duration <= 0:
        raise ValueError(f"rate and duration must be positive, got {rate} and {duration}")
    out: list[float] = []
    t = 0.0
    while True:
        t += float(rng.exponential(1.0 / rate))
        if t >= duration:
            return out
        out.append(t)


@dataclasses.dataclass(frozen=True)
class PlannedRequest:
    offset: float  # seconds after the run's start
    prompt_ids: list[int]
    output_tokens: int


def plan_requests(rate: float, duration: float, prompts: LengthMix, outputs: LengthMix, *, vocab_size: int,
                  avoid: set[int], shared_prefix: int, seed: int) -> list[PlannedRequest]:
    """The requests of one rate: Poisson offsets, drawn lengths, random prompt ids (none in ``avoid``)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    offsets = poisson_arrivals(rate, duration, rng)
    n = len(offsets)
    prompt_lengths, output_lengths = prompts.draw(rng, n), outputs.draw(rng, n)

    def ids(length: int) -> list[int]:
        return [t if t not in avoid else 3 for t in rng.integers(3, vocab_size, length).tolist()]

    prefix = ids(shared_prefix)
    return [PlannedRequest(offset, prefix + ids(p - shared_prefix), o)
            for offset, p, o in zip(offsets, prompt_lengths, output_lengths, strict=True)]


# ---- statistics ----------------------------------------------------------------------------------


@dataclasses.dataclass
class RequestTimes:
    """One request as measured: its arrival and token times (seconds, one clock), how it ended."""

    arrival: float
    token_times: list[float]
    status: str = FINISHED  # FINISHED, FAILED or UNFINISHED
    finish_reason: str = ""  # "length", "stop", ... when finished; the error when failed
    prompt_tokens: int = 0
    first_chunk: float | None = None  # in process: the launch of the step with the prompt's first chunk


def percentile(values: Sequence[float], p: float) -> float | None:
    """Linear interpolation between the nearest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = p / 100 * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def gaps(times: Sequence[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def meets_slo(request: RequestTimes, ttft_s: float, itl_s: float) -> bool:
    """Finished, TTFT <= ttft_s and the p99 of its own inter-token gaps <= itl_s (no gaps: met)."""
    if request.status != FINISHED or not request.token_times:
        return False
    if request.token_times[0] - request.arrival > ttft_s:
        return False
    own = percentile(gaps(request.token_times), 99)
    return own is None or own <= itl_s


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1e3 * seconds, 3)


def summarize(requests: Sequence[RequestTimes], ttft_s: float, itl_s: float) -> dict[str, Any]:
    """The row of one (path, rate): counts, TTFT and inter-token percentiles (ms), tokens/s, goodput."""
    ttfts = [r.token_times[0] - r.arrival for r in requests if r.token_times]
    pooled = [g for r in requests for g in gaps(r.token_times)]
    tokens = sum(len(r.token_times) for r in requests)
    last = max((r.token_times[-1] for r in requests if r.token_times), default=None)
    span = None if last is None else last - min(r.arrival for r in requests)
    good = sum(meets_slo(r, ttft_s, itl_s) for r in requests)
    finished = sum(r.status == FINISHED for r in requests)
    ttft_p99, itl_p99 = percentile(ttfts, 99), percentile(pooled, 99)
    return {
        "sent": len(requests),
        "finished": finished,
        "failed": sum(r.status == FAILED for r in requests),
        "unfinished": sum(r.status == UNFINISHED for r in requests),
        "stopped_early": sum(r.status == FINISHED and r.finish_reason == "stop" for r in requests),
        "ttft_ms_p50": _ms(percentile(ttfts, 50)),
        "ttft_ms_p99": _ms(ttft_p99),
        "itl_ms_p50": _ms(percentile(pooled, 50)),
        "itl_ms_p99": _ms(itl_p99),
        "itl_ms_max": _ms(max(pooled, default=None)),
        "output_tokens": tokens,
        "span_s": None if span is None else round(span, 4),
        "output_tokens_per_s": round(tokens / span, 3) if span else None,
        "slo_met_requests": good,
        "goodput_rps": round(good / span, 4) if span else None,
        "slo_p99s_hold": bool(requests) and finished == len(requests) and ttft_p99 is not None
        and ttft_p99 <= ttft_s and (itl_p99 is None or itl_p99 <= itl_s),
    }


# More distinct prompt lengths than this are grouped into doubling buckets.
MAX_LENGTH_GROUPS = 12


def by_prompt_length(requests: Sequence[RequestTimes]) -> list[dict[str, Any]]:
    """TTFT (and, where known, the wait before the first chunk) per prompt length, in ms: each length
    apart when there are at most MAX_LENGTH_GROUPS of them, else doubling buckets named by their upper
    bound. Requests without a token are left out."""
    started = [r for r in requests if r.token_times]
    lengths = sorted({r.prompt_tokens for r in started})
    if len(lengths) > MAX_LENGTH_GROUPS:
        def group(n: int) -> int:
            return 1 << max(0, n - 1).bit_length()
    else:
        def group(n: int) -> int:
            return n
    groups: dict[int, list[RequestTimes]] = {}
    for r in started:
        groups.setdefault(group(r.prompt_tokens), []).append(r)
    out = []
    for length, members in sorted(groups.items()):
        ttfts = [r.token_times[0] - r.arrival for r in members]
        queued = [r.first_chunk - r.arrival for r in members if r.first_chunk is not None]
        row = {"prompt_tokens": length, "requests": len(members), "ttft_ms_p50": _ms(percentile(ttfts, 50)),
               "ttft_ms_p99": _ms(percentile(ttfts, 99))}
        if queued:
            row |= {"queued_ms_p50": _ms(percentile(queued, 50)), "queued_ms_p99": _ms(percentile(queued, 99))}
        out.append(row)
    return out


def highest_rate_holding(rows: Sequence[dict[str, Any]], path: str) -> float | None:
    """The highest rate of ``path`` whose row has ``slo_p99s_hold``; None when none has."""
    return max((r["rate_rps"] for r in rows if r["path"] == path and r["slo_p99s_hold"]), default=None)


# ---- the client process (imports only gRPC and the generated code) ------------------------------


def grpc_load(target: str, plan: list[tuple[float, list[int] | str, int]], timeout: float) -> list[dict[str, Any]]:
    """Send each ``(offset, prompt ids or text, max_tokens)`` at its offset, one stream each, ignoring
    end-of-sequence tokens (every request generates exactly ``max_tokens``); per request its arrival and
    token times (``time.monotonic``: the machine's clock, the server's too; a time per message, which may
    carry several tokens), its token count, status and finish reason.
    Streams still open ``timeout`` seconds after the last arrival are cancelled and reported unfinished."""
    import asyncio

    import grpc
    from switchyard.service.proto import decode_pb2, decode_pb2_grpc

    reasons = {decode_pb2.FINISH_REASON_STOP: "stop", decode_pb2.FINISH_REASON_LENGTH: "length"}

    async def one(stub: Any, start: float, offset: float, prompt: list[int] | str, max_tokens: int,
                  out: dict) -> None:
        await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
        request = decode_pb2.GenerateRequest(max_tokens=max_tokens, ignore_eos=True)
        if isinstance(prompt, str):
            request.text = prompt
        else:
            request.token_ids.ids.extend(prompt)
        out["arrival"] = time.monotonic()
        try:
            async for message in stub.Generate(request):
                if message.token_ids:
                    out["token_times"].append(time.monotonic())
                    out["tokens"] += len(message.token_ids)
                if message.finish_reason:
                    out["status"], out["finish_reason"] = FINISHED, reasons.get(message.finish_reason, "other")
            if out["status"] != FINISHED:
                out["status"], out["finish_reason"] = FAILED, "stream ended without a finish reason"
        except grpc.aio.AioRpcError as err:
            out["status"], out["finish_reason"] = FAILED, f"{err.code().name}: {err.details()}"

    async def main() -> list[dict[str, Any]]:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = decode_pb2_grpc.DecodeStub(channel)
            await channel.channel_ready()
            # The client's own full collections would read as gaps between tokens.
            gc.collect()
            gc.freeze()
            results = [{"arrival": None, "token_times": [], "tokens": 0, "status": UNFINISHED, "finish_reason": ""}
                       for _ in plan]
            start = time.monotonic()
            tasks = [asyncio.create_task(one(stub, start, offset, ids, n, out))
                     for (offset, ids, n), out in zip(plan, results, strict=True)]
            last = max((offset for offset, _, _ in plan), default=0.0)
            _, pending = await asyncio.wait(tasks, timeout=last + timeout)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for out, (offset, _, _) in zip(results, plan, strict=True):
                if out["arrival"] is None:  # never sent: count it at its planned time
                    out["arrival"] = start + offset
        return results

    return asyncio.run(main())


# ---- the two paths -------------------------------------------------------------------------------


class StepClock:
    """The engine as the scheduler in this process sees it, with its host calls timed: how long each
    step's launch takes on the host, per kind of step, and how long ``collect`` then waits for the
    step's tokens. A wait near zero means the device had finished before the host asked: the host,
    not the device, set that step's pace. Everything else is the engine's own.

    Where two consecutive collects both waited and the second step was launched before the first
    returned, the device went from the first step's end straight to the second: the time between
    their returns is the second step's time on the device. Those times, and the decode rows each step
    ran (its width), are reported per kind of step, with the longest launches (what each step carried)."""

    IDLE_WAIT_S = 1e-4
    LONGEST = 5

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.launch_s: dict[str, list[float]] = {"decode": [], "chunk": []}
        self.wait: list[float] = []
        self.widths: dict[str, list[int]] = {"decode": [], "chunk": []}
        self.device: dict[str, list[float]] = {"decode": [], "chunk": []}
        self.launched: dict[int, tuple[str, float]] = {}  # step: (kind, when its launch returned)
        self.longest: list[tuple[float, str, int, int]] = []  # (seconds, kind, width, end of its chunk or 0)
        self.last_return: float | None = None  # when the previous collect returned, if it waited

    def __getattr__(self, name: str) -> Any:  # the engine's sizes, policy and counters
        return getattr(self.engine, name)

    def launch(self, plan: Any) -> Any:
        t0 = time.perf_counter()
        pending = self.engine.launch(plan)
        t1 = time.perf_counter()
        kind = "chunk" if plan.chunks else "decode"
        self.launch_s[kind].append(t1 - t0)
        width = plan.shape.width
        self.widths[kind].append(width)
        end = max((c.end for c in plan.chunks), default=0)
        self.longest = sorted([*self.longest, (t1 - t0, kind, width, end)], reverse=True)[: self.LONGEST]
        self.launched[pending.step] = (kind, t1)
        return pending

    def collect(self, pending: Any) -> Any:
        t0 = time.perf_counter()
        result = self.engine.collect(pending)
        t1 = time.perf_counter()
        self.wait.append(t1 - t0)
        kind, launched = self.launched.pop(pending.step, ("decode", t0))
        waited = t1 - t0 >= self.IDLE_WAIT_S
        if waited and self.last_return is not None and launched <= self.last_return:
            self.device[kind].append(t1 - self.last_return)
        self.last_return = t1 if waited else None
        return result

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for kind, times in self.launch_s.items():
            out[f"{kind}_steps"] = len(times)
            out[f"{kind}_launch_ms_mean"] = _ms(sum(times) / len(times)) if times else None
            out[f"{kind}_launch_ms_p99"] = _ms(percentile(times, 99))
            out[f"{kind}_launch_ms_max"] = _ms(max(times, default=None))
            out[f"{kind}_step_widths"] = {str(w): n for w, n in sorted(collections.Counter(self.widths[kind]).items())}
            device = self.device[kind]
            out[f"{kind}_device_ms_p50"] = _ms(percentile(device, 50))
            out[f"{kind}_device_ms_p99"] = _ms(percentile(device, 99))
        out["longest_launches"] = [{"ms": _ms(t), "kind": kind, "width": width, "chunk_end": end}
                                   for t, kind, width, end in self.longest]
        out["collect_wait_ms_mean"] = _ms(sum(self.wait) / len(self.wait)) if self.wait else None
        out["collect_found_done_fraction"] = (round(sum(w < self.IDLE_WAIT_S for w in self.wait) / len(self.wait), 4)
                                              if self.wait else None)
        return out


def _frame(code: Any, line: int) -> str:
    return f"{Path(code.co_filename).name}:{line} {code.co_name}"


class StallSampler:
    """Where this process's threads were during the longest gaps between a request's tokens
    (``--stall-report``). A thread samples every other thread's innermost frames each ``interval``
    seconds; it takes the GIL to do so, so the run it watches is a little slower. :meth:`report` takes
    the gaps longer than a threshold, the longest first (one per stretch of time: many requests see the
    same stall), and lists the stacks each thread was seen in most often during each, the longest
    stretch without a sample (the GIL held elsewhere, or the process off the CPU) and the garbage
    collections that overlapped it."""

    def __init__(self, interval: float = 1e-3, depth: int = 8) -> None:
        self.samples: list[tuple[float, dict[str, tuple[tuple[Any, int], ...]]]] = []
        # The garbage collector's collections: start, end, generation, the thread that ran it.
        self.collections: list[tuple[float, float, int, str]] = []
        self.gc_start = 0.0
        self.interval, self.depth = interval, depth
        self.stopping = threading.Event()
        gc.callbacks.append(self.on_gc)
        self.thread = threading.Thread(target=self.sample_threads, name="load-stall-sampler", daemon=True)
        self.thread.start()

    def on_gc(self, phase: str, info: dict[str, int]) -> None:  # the collecting thread, holding the GIL
        if phase == "start":
            self.gc_start = time.monotonic()
        else:
            self.collections.append((self.gc_start, time.monotonic(), info["generation"],
                                     threading.current_thread().name))

    def sample_threads(self) -> None:
        me = threading.get_ident()
        while not self.stopping.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            sample = {}
            for ident, frame in current_frames().items():
                if ident == me:
                    continue
                stack = []
                while frame is not None and len(stack) < self.depth:
                    stack.append((frame.f_code, frame.f_lineno))
                    frame = frame.f_back
                sample[names.get(ident, str(ident))] = tuple(stack)
            self.samples.append((time.monotonic(), sample))

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()
        gc.callbacks.remove(self.on_gc)

    def report(self, token_times: Sequence[Sequence[float]], threshold_s: float, most: int = 5) -> list[dict[str, Any]]:
        """``token_times``: each request's token times on ``time.monotonic``'s clock."""
        gaps = sorted(((b - a, a, b) for times in token_times for a, b in itertools.pairwise(times)
                       if b - a > threshold_s), reverse=True)
        chosen: list[tuple[float, float, float]] = []
        for gap in gaps:
            if len(chosen) == most:
                break
            if all(gap[2] <= a or gap[1] >= b for _, a, b in chosen):
                chosen.append(gap)
        times = [t for t, _ in self.samples]
        out = []
        for gap, a, b in chosen:
            seen: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
            inside = self.samples[bisect.bisect_right(times, a): bisect.bisect_left(times, b)]
            for _, sample in inside:
                for name, stack in sample.items():
                    seen[name][stack] += 1
            stamps = [a] + [t for t, _ in inside] + [b]
            held = [{"generation": g, "ms": _ms(end - start), "thread": name}
                    for start, end, g, name in self.collections if start < b and end > a]
            out.append({"gap_ms": _ms(gap), "samples": len(inside),
                        "longest_without_sample_ms": _ms(max(y - x for x, y in itertools.pairwise(stamps))),
                        "collections": held,
                        "threads": {name: [{"samples": n, "stack": [_frame(code, line) for code, line in stack]}
                                           for stack, n in counter.most_common(3)]
                                    for name, counter in sorted(seen.items())}})
        return out


def run_in_process(engine: Any, plan: list[PlannedRequest], timeout: float,
                   peak: dict[str, int] | None = None) -> list[RequestTimes]:
    """Run ``plan`` through the scheduler in this process; ``peak["generating"]`` gets the most
    requests that held a slot at once."""
    from switchyard.service.engine.request import GenerationRequest, RequestRecord
    from switchyard.service.engine.sampling import SamplingParams
    from switchyard.service.engine.scheduler import Scheduler

    stamp = time.monotonic_ns()
    results = [RequestTimes(math.nan, [], UNFINISHED, prompt_tokens=len(p.prompt_ids)) for p in plan]

    def on_finish(record: RequestRecord) -> None:  # scheduler thread, before the request's final event
        if record.chunk_times.size:
            results[int(record.request_id.rsplit("-", 1)[1])].first_chunk = float(record.chunk_times[0])

    scheduler = Scheduler(engine, max_queue=len(plan) + 8, on_finish=on_finish)
    stop = threading.Event()
    thread = threading.Thread(target=scheduler.run, args=(stop,), name="load-scheduler", daemon=True)
    thread.start()
    ended = threading.Condition()
    open_requests = len(plan)

    def on_event(i: int):
        def record(event: Any) -> None:  # scheduler thread
            nonlocal open_requests
            if peak is not None:
                peak["generating"] = max(peak.get("generating", 0), scheduler.active_slots)
            if event.token_id is not None:
                results[i].token_times.append(event.time)
            if event.finish_reason is not None:
                failed = event.finish_reason not in ("length", "stop")
                with ended:  # the submitting thread reads statuses under this lock
                    results[i].status = FAILED if failed else FINISHED
                    results[i].finish_reason = event.finish_reason
                    open_requests -= 1
                    ended.notify()

        return record

    start = time.monotonic()
    for i, planned in enumerate(plan):
        time.sleep(max(0.0, start + planned.offset - time.monotonic()))
        results[i].arrival = time.monotonic()
        try:
            scheduler.submit(GenerationRequest(f"load-{stamp}-{i}", planned.prompt_ids, planned.output_tokens,
                                               SamplingParams(), on_event=on_event(i), ignore_eos=True))
        except Exception as err:  # refused (queue full, too long): counted, never dropped
            with ended:
                results[i].status, results[i].finish_reason = FAILED, f"{type(err).__name__}: {err}"
                open_requests -= 1
    with ended:
        ended.wait_for(lambda: open_requests == 0, timeout=timeout)
        unfinished = [i for i, r in enumerate(results) if r.status == UNFINISHED]
    for i in unfinished:
        scheduler.cancel(f"load-{stamp}-{i}")
    with ended:
        ended.wait_for(lambda: open_requests == 0, timeout=60)
    stop.set()
    thread.join()
    for i in unfinished:  # ran out of time: not failures, though their final event says "cancelled"
        if results[i].finish_reason in ("", "cancelled"):
            results[i].status, results[i].finish_reason = UNFINISHED, "timeout"
    return results


def run_grpc(engine_process: Any, tokenizer: Any, plan: list[PlannedRequest], timeout: float,
             clients: concurrent.futures.Executor, emitted: list[list[float]] | None = None) -> list[RequestTimes]:
    """Run ``plan`` through a gRPC server in this process over the engine in its own process, as
    ``switchyard serve`` runs them, and the client process; ``emitted`` gets each request's token
    times as the engine's scheduler emitted them (the machine's monotonic clock)."""
    from switchyard.service.api.server import DecodeApp, ServerThread
    from switchyard.service.api.wire import Limits
    from switchyard.service.engine.request import RequestRecord
    from switchyard.service.telemetry.tracing import RequestRecorder

    class EmitTimes(RequestRecorder):
        """The server's recorder (the bridge hands it every finished request's record), keeping each
        request's emit times too."""

        def on_finish(self, record: RequestRecord) -> None:
            if emitted is not None:
                emitted.append(record.token_times.tolist())
            super().on_finish(record)

    recorder = EmitTimes(None)
    app = DecodeApp(model_name="load", limits=Limits(default_max_tokens=max((p.output_tokens for p in plan),
                                                                             default=1)), recorder=recorder)
    server = ServerThread(app, engine_process, tokenizer)
    wire = [(p.offset, p.prompt_ids, p.output_tokens) for p in plan]
    last = max((p.offset for p in plan), default=0.0)
    try:
        measured = clients.submit(grpc_load, server.target, wire, timeout).result(timeout=last + timeout + 120)
    finally:
        server.stop(grace=10)  # also closes the recorder; the engine process goes on
    return [RequestTimes(m["arrival"], m["token_times"], m["status"], m["finish_reason"]) for m in measured]


def build_engine(args: argparse.Namespace) -> tuple[Any, Any]:
    """The engine process's builder for the gRPC path (runs there): the benchmark's engine and its
    warm-up."""
    return drive().serving_engine(args)


def grpc_rows(args: argparse.Namespace, plans: list[list[PlannedRequest]], tokenizer: Any) -> dict[str, Any]:
    """Every rate through gRPC, the engine in a process of its own (started here, ended before this
    returns, so the devices are free again): {"rows", "warmup_s", "device", "facts"}."""
    from switchyard.service.api.engine_process import EngineProcess
    from switchyard.service.engine.heap import freeze_warm_heap

    # The model's end-of-sequence ids, as serve gives them (the benchmark's requests ignore them).
    process = EngineProcess(build_engine, args, scheduler_options={
        "max_queue": max(len(plan) for plan in plans) + 8, "model_name": "load",
        "eos_token_ids": tuple(tokenizer.eos_token_ids)})
    clients = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        devices = process.wait_devices()
        facts = process.wait_ready()
        frozen, collect_ms = freeze_warm_heap()  # as switchyard serve does in the server's process
        print(f"server heap: {frozen} objects frozen (a full collection took {collect_ms:.0f} ms)", flush=True)
        # Unmeasured: starts the client process and its imports, and the server's first call.
        warm = PlannedRequest(0.0, [3] * args.prompt_mix.shortest, args.output_mix.shortest)
        run_grpc(process, tokenizer, [warm], args.timeout, clients)
        rows = []
        for rate, plan in zip(args.rates, plans, strict=True):
            sampler = StallSampler() if args.stall_report is not None else None
            emitted: list[list[float]] = []
            measured = run_grpc(process, tokenizer, plan, args.timeout, clients, emitted)
            for planned, request in zip(plan, measured, strict=True):
                request.prompt_tokens = len(planned.prompt_ids)
            server_gaps = [g for times in emitted for g in gaps(times)]
            extra: dict[str, Any] = {"server_itl_ms_p99": _ms(percentile(server_gaps, 99)),
                                     "server_itl_ms_max": _ms(max(server_gaps, default=None))}
            rows.append(finish_row("grpc", rate, measured, args, extra, sampler))
        return {"rows": rows, "warmup_s": facts.warmup_s, "device": devices.label, "facts": facts}
    finally:
        clients.shutdown()
        process.close()


def in_process_rows(args: argparse.Namespace, plans: list[list[PlannedRequest]]) -> dict[str, Any]:
    """Every rate with the scheduler in this process: {"rows", "warmup_s", "device", "facts"}."""
    engine, warmup = drive().serving_engine(args)
    rows = []
    for rate, plan in zip(args.rates, plans, strict=True):
        sampler = StallSampler() if args.stall_report is not None else None
        extra: dict[str, Any] = {}
        steps, clock = engine.step_count, StepClock(engine)
        measured = run_in_process(clock, plan, args.timeout, extra)
        extra["engine_steps"] = engine.step_count - steps
        extra["host"] = clock.summary()
        row = finish_row("in-process", rate, measured, args, extra, sampler)
        row["engine_steps_per_s"] = round(row["engine_steps"] / row["span_s"], 1) if row["span_s"] else None
        rows.append(row)
    return {"rows": rows, "warmup_s": warmup.seconds, "device": device_name(), "facts": engine}


def finish_row(path: str, rate: float, measured: list[RequestTimes], args: argparse.Namespace,
               extra: dict[str, Any], sampler: StallSampler | None = None) -> dict[str, Any]:
    """A rate's row; with ``sampler`` (stopped here) its stalls, the longest gaps between the tokens
    as measured (in process the scheduler's emit times, through gRPC the client's: one clock)."""
    if sampler is not None:
        sampler.stop()
        extra["stalls"] = sampler.report([r.token_times for r in measured], args.stall_report / 1e3)
    row = {"path": path, "rate_rps": rate, **summarize(measured, args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3),
           "by_prompt_length": by_prompt_length(measured), **extra}
    print(f"{path} {rate:g}/s: sent {row['sent']} finished {row['finished']} failed {row['failed']} "
          f"unfinished {row['unfinished']}", flush=True)
    return row


# ---- main ----------------------------------------------------------------------------------------


def device_name() -> str:
    import jax

    return f"{jax.device_count()}x {jax.devices()[0].device_kind}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    serve_bench().add_engine_arguments(parser, max_seq_len=4096)
    parser.add_argument("--cpu", action="store_true", help="host devices (JAX_PLATFORMS=cpu): a smoke test of tiny")
    parser.add_argument("--rates", type=float, nargs="+", default=[4.0, 8.0, 12.0], help="requests/s")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds to wait after the last arrival for the requests in flight")
    parser.add_argument("--prompt-lengths", nargs="+", default=["128", "256", "512", "1024", "2048", "3072"],
                        help="lengths drawn uniformly, uniform:LO:HI, or file:PATH")
    parser.add_argument("--output-lengths", nargs="+", default=["128", "256", "512"],
                        help="lengths drawn uniformly, uniform:LO:HI, or file:PATH")
    parser.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt starts with")
    parser.add_argument("--path", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--slo-ttft-ms", type=float, default=500.0)
    parser.add_argument("--slo-itl-ms", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval, as switchyard serve --switch-interval (default: CPython's)")
    parser.add_argument("--stall-report", type=float, default=None, metavar="MS",
                        help="sample this process's threads every millisecond and report, for the longest gaps "
                             "over MS between a request's tokens (as emitted here), where each thread was "
                             "(the rows' stalls; sampling slows the run a little)")
    parser.add_argument("--out", default=None,
                        help="default: benchmarks/results/current/load-<device>.json; a --cpu run writes only here")
    args = parser.parse_args(argv)
    try:
        args.prompt_mix = parse_length_mix(args.prompt_lengths)
        args.output_mix = parse_length_mix(args.output_lengths)
    except ValueError as err:
        parser.error(str(err))
    if any(r <= 0 for r in args.rates) or args.duration <= 0 or args.timeout <= 0:
        parser.error("--rates, --duration and --timeout must be positive")
    if not 0 <= args.shared_prefix <= args.prompt_mix.shortest:
        parser.error(f"--shared-prefix {args.shared_prefix} must be within [0, the shortest prompt length "
                     f"{args.prompt_mix.shortest}]")
    if args.prompt_mix.longest + args.output_mix.longest > args.max_seq_len:
        parser.error(f"the longest prompt ({args.prompt_mix.longest}) and output ({args.output_mix.longest}) do not "
                     f"fit --max-seq-len {args.max_seq_len}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
    apply_process_defaults()  # as serve's engine process (the gRPC path's child inherits it)
    if args.switch_interval is not None:  # as `switchyard serve --switch-interval` does, without importing gRPC
        sys.setswitchinterval(args.switch_interval)
    spec, tokenizer = drive().serving_tokenizer(args)
    avoid = set(tokenizer.eos_token_ids) | {spec.bos_token_id}
    plans = [plan_requests(rate, args.duration, args.prompt_mix, args.output_mix, vocab_size=spec.vocab_size,
                           avoid=avoid, shared_prefix=args.shared_prefix, seed=args.seed * 1000 + i)
             for i, rate in enumerate(args.rates)]
    # Through gRPC first: its engine runs in a process of its own, as serve runs it, and must have the
    # devices to itself until it ends; only then does this process take them.
    runs = {}
    if "grpc" in args.path:
        runs["grpc"] = grpc_rows(args, plans, tokenizer)
    if "in-process" in args.path:
        runs["in-process"] = in_process_rows(args, plans)
    by_path = {path: runs[path]["rows"] for path in args.path}
    rows = [by_path[path][i] for i in range(len(args.rates)) for path in args.path]
    first = runs[args.path[0]]
    label, facts = first["device"], first["facts"]
    slug = re.sub(r"[^a-z0-9]+", "-", label.split("x ", 1)[-1].lower()).strip("-")
    result = {
        **result_file.provenance(label, argv, script=__file__),
        "xla_allocator": xla_allocator(),
        "config": {
            "model": args.model_path or args.preset, "tp": args.tp, "strategy": args.strategy,
            "step_tokens": facts.step_tokens, "kv_tokens": facts.kv_tokens,
            "kv_block_size": facts.kv_block_size,
            # What the engine served (an engine process's facts, or the engine in this process).
            "weights": getattr(facts, "weights", None) or facts.weights_label,
            "kv_cache": getattr(facts, "kv_cache", None) or facts.kv_cache_label,
            "batch_slots": args.batch_slots, "max_seq_len": args.max_seq_len, "rates_rps": args.rates,
            "duration_s": args.duration, "timeout_s": args.timeout, "prompt_lengths": args.prompt_lengths,
            "output_lengths": args.output_lengths, "shared_prefix": args.shared_prefix, "seed": args.seed,
            "paths": args.path, "switch_interval_s": sys.getswitchinterval(),
        },
        # Per path, its engine's compiling and running every step program once, before any request.
        "warmup_s": {path: round(run["warmup_s"], 1) for path, run in runs.items()},
        "slo": {
            "ttft_ms": args.slo_ttft_ms, "itl_ms": args.slo_itl_ms,
            "request_meets": "finished, TTFT (arrival to first token) <= ttft_ms and the p99 of its own inter-token "
                             "gaps <= itl_ms (no gap: met); goodput_rps = such requests / (last token - first "
                             "arrival)",
            "p99s_hold": "every request sent finished, TTFT p99 over all requests <= ttft_ms and the pooled "
                         "inter-token p99 <= itl_ms",
            "percentiles": "linear interpolation between the nearest ranks (numpy's default)",
        },
        "highest_rate_slo_p99s_hold": {path: highest_rate_holding(rows, path) for path in args.path},
        "rows": rows,
    }
    out = Path(args.out) if args.out else None
    if out is None and not args.cpu:
        out = ROOT / "benchmarks" / "results" / "current" / f"load-{slug}.json"
    if out is not None:
        result_file.write_result(out, result)
        print(f"wrote {out}")
    else:
        print("a --cpu run without --out: no file written")
    print(f"{'path':10} {'rate/s':>6} {'sent':>5} {'done':>5} {'fail':>4} {'unfin':>5} {'ttft p50':>9} {'ttft p99':>9} "
          f"{'itl p50':>8} {'itl p99':>8} {'itl max':>8} {'tok/s':>9} {'good/s':>7} {'p99s':>4}")

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    for row in rows:
        holds = "yes" if row["slo_p99s_hold"] else "no"
        print(f"{row['path']:10} {row['rate_rps']:>6g} {row['sent']:>5} {row['finished']:>5} {row['failed']:>4} "
              f"{row['unfinished']:>5} {ms(row['ttft_ms_p50']):>9} {ms(row['ttft_ms_p99']):>9} "
              f"{ms(row['itl_ms_p50']):>8} {ms(row['itl_ms_p99']):>8} {ms(row['itl_ms_max']):>8} "
              f"{ms(row['output_tokens_per_s']):>9} {ms(row['goodput_rps']):>7} {holds:>4}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
