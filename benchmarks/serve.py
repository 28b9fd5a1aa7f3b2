#!/usr/bin/env python3
"""Serving overhead: tokens through gRPC against the in-process engine loop, tracing off and on.

In one run, on one engine: for each concurrency (default 1, 8, 32, 64) and tracing off/on, N streams
of greedy decoding are run twice, interleaved over ``--repeats`` rounds:

- ``in-process``: requests submitted straight to the scheduler; times are the scheduler's emit times;
- ``grpc``: the same requests through ``switchyard.v1.Decode/Generate`` on a localhost port, the server
  and the scheduler in this process (``switchyard serve`` gives the engine and its scheduler a process
  of their own, which ``load.py --path grpc`` measures), the clients (grpc.aio, one stream per
  request) in a separate process so that they do not share the server's interpreter; times are
  client arrival times.

The engine is ``benchmarks/drive.py``'s serving engine: a checkpoint as ``switchyard serve`` loads
it, or random weights of a preset, configured from the layout flags as serve configures it, every
step program compiled first.

Per row: ``ms_per_token`` is the mean wait between two tokens of one stream (after its first token),
``tokens_per_s`` is every output token over the wall time from the first request sent to the last
token received, ``grpc_overhead`` is the fraction the gRPC path adds over the in-process path of the
same round (ms/token at concurrency 1, tokens/s otherwise), ``tracing_overhead`` the fraction
tracing-on costs over tracing-off on the same path. Tracing on = per-request spans to an OTLP-JSON
file through the SDK's batch processor, plus the GenAI histograms. Medians over the rounds.
Targets: gRPC adds <= 3 %; tracing costs <= 2 % of tokens/s at 32 and of ms/token at 1.

    python benchmarks/serve.py --preset llama3-8b --tp 1 --batch-slots 64 --max-seq-len 1024
    python benchmarks/serve.py --model-path /models/llama-3-8b --tp 8 --strategy auto

Writes benchmarks/results/current/serve-<device>.json ``{"command","device","date","commit","rows"}``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import itertools
import multiprocessing
import os
import re
import runpy
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from switchyard.service.engine.xla_runtime import apply_process_defaults, xla_allocator

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

ROOT = Path(__file__).resolve().parents[1]


# ---- the client process (imports only gRPC and the generated code) ------------------------------


def grpc_clients(target: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Run one stream per prompt at once; per stream the arrival time of each token (perf_counter)."""
    import asyncio

    import grpc
    from switchyard.service.proto import decode_pb2, decode_pb2_grpc

    async def one(stub: Any, ids: list[int]) -> list[float]:
        request = decode_pb2.GenerateRequest(max_tokens=max_tokens)
        request.token_ids.ids.extend(ids)
        arrivals = []
        async for message in stub.Generate(request, timeout=600):
            if message.token_ids:
                arrivals.append(time.perf_counter())
        return arrivals

    async def main() -> dict[str, Any]:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = decode_pb2_grpc.DecodeStub(channel)
            await channel.channel_ready()
            start = time.perf_counter()
            streams = await asyncio.gather(*(one(stub, ids) for ids in prompts))
        return {"start": start, "streams": streams}

    return asyncio.run(main())


# ---- measurement ---------------------------------------------------------------------------------


def summarize(start: float, streams: list[list[float]]) -> dict[str, float]:
    gaps = [b - a for s in streams for a, b in itertools.pairwise(s)]
    tokens = sum(len(s) for s in streams)
    end = max(s[-1] for s in streams if s)
    return {
        "ms_per_token": 1e3 * statistics.fmean(gaps) if gaps else float("nan"),
        "tokens_per_s": tokens / (end - start),
        "tokens": tokens,
    }


def make_recorder(tracing_on: bool, folder: Path) -> Any:
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from switchyard.service.telemetry.otlp_json import OtlpJsonFileSpanExporter
    from switchyard.service.telemetry.tracing import RequestRecorder, Telemetry

    if not tracing_on:
        return RequestRecorder(None)
    spans = OtlpJsonFileSpanExporter(folder / f"spans-{time.monotonic_ns()}.jsonl")
    return RequestRecorder(Telemetry(span_exporters=[spans], metric_readers=[InMemoryMetricReader()]))


def scheduler_for(engine: Any, tokenizer: Any, requests: int, recorder: Any) -> Any:
    """A scheduler over ``engine`` for ``requests`` requests at once; the model's end-of-sequence ids
    stop a request."""
    from switchyard.service.engine.scheduler import Scheduler

    return Scheduler(engine, eos_token_ids=tokenizer.eos_token_ids, max_queue=requests + 8,
                     on_finish=recorder.on_finish)


def run_in_process(engine: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int, recorder: Any) -> dict:
    from switchyard.service.engine.request import GenerationRequest
    from switchyard.service.engine.sampling import SamplingParams

    scheduler = scheduler_for(engine, tokenizer, len(prompts), recorder)
    stop = threading.Event()
    thread = threading.Thread(target=scheduler.run, args=(stop,), daemon=True)
    thread.start()
    streams: list[list[float]] = [[] for _ in prompts]
    done = threading.Semaphore(0)

    def on_event(i: int):
        def record(event: Any) -> None:  # scheduler thread
            if event.token_id is not None:
                streams[i].append(event.time)
            if event.finish_reason is not None:
                done.release()

        return record

    start = time.monotonic()
    for i, ids in enumerate(prompts):
        scheduler.submit(GenerationRequest(f"inproc-{i}-{start}", ids, max_tokens, SamplingParams(),
                                           on_event=on_event(i)))
    for _ in prompts:
        assert done.acquire(timeout=600), "in-process run did not finish"
    stop.set()
    thread.join()
    recorder.close()
    return summarize(start, streams)


def run_grpc(engine: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int, recorder: Any,
             clients: concurrent.futures.Executor) -> dict:
    from switchyard.service.api.server import DecodeApp, ServerThread
    from switchyard.service.api.wire import Limits

    scheduler = scheduler_for(engine, tokenizer, len(prompts), recorder)
    app = DecodeApp(model_name="bench", limits=Limits(default_max_tokens=max_tokens), recorder=recorder)
    server = ServerThread(app, scheduler, tokenizer)
    try:
        result = clients.submit(grpc_clients, server.target, prompts, max_tokens).result(timeout=1200)
    finally:
        server.stop(grace=10)  # also closes the recorder
    return summarize(result["start"], result["streams"])


# ---- main ----------------------------------------------------------------------------------------


# benchmarks/drive.py (the serving engine built from the benchmark's flags), loaded on first use.
drive = functools.cache(lambda: SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("drive.py")))))
# benchmarks/result_file.py (provenance and writing), by its path: PYTHONSAFEPATH=1 keeps benchmarks/ off sys.path.
result_file = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("result_file.py"))))


def prompts_for(n: int, length: int, vocab: int, avoid: set[int], seed: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(3, vocab, length).tolist()
        out.append([t if t not in avoid else 3 for t in ids])
    return out


def device_name() -> tuple[str, str]:
    import jax

    kind = jax.devices()[0].device_kind
    label = f"{jax.device_count()}x {kind}"
    slug = re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-")
    return label, slug


def overhead(value: float, base: float, *, higher_is_better: bool) -> float:
    return (base / value - 1.0) if higher_is_better else (value / base - 1.0)


def add_engine_arguments(parser: argparse.ArgumentParser, max_seq_len: int) -> None:
    """The flags of the engine a serving benchmark runs (``drive.serving_engine`` reads them)."""
    from switchyard.service.model.quantization import CHOICES as QUANTIZATION_CHOICES
    from switchyard.service.modelspec import DEFAULT_KV_MEMORY_FRACTION, DEFAULT_STEP_TOKENS

    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model-path", help="a Hugging Face checkpoint folder")
    source.add_argument("--preset", default="llama3-8b", help="random weights of a preset shape (default)")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batch-slots", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=max_seq_len)
    parser.add_argument("--step-tokens", type=int, default=DEFAULT_STEP_TOKENS,
                        help="prompt tokens a step carries beside the decoding sequences")
    parser.add_argument("--kv-tokens", type=int, default=0,
                        help="KV pool size in tokens (0: from the memory left after the weights)")
    parser.add_argument("--kv-memory-fraction", type=float, default=DEFAULT_KV_MEMORY_FRACTION)
    parser.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default="auto",
                        help="the layer matrices' format, as serve --quantization (fp8: quantized at load)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="the KV cache's format, as serve --kv-cache-dtype")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_arguments(parser, max_seq_len=1024)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="sys.setswitchinterval, as switchyard serve --switch-interval (default: CPython's)")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/current/serve-<device>.json")
    args = parser.parse_args(argv)
    apply_process_defaults()  # as serve's engine process
    from switchyard.service.api.server import tune_interpreter

    tune_interpreter(args.switch_interval)
    levels = [int(c) for c in args.concurrency.split(",")]
    if max(levels) > args.batch_slots:
        parser.error(f"--batch-slots {args.batch_slots} is below the largest concurrency {max(levels)}")

    _, tokenizer = drive().serving_tokenizer(args)
    engine, _ = drive().serving_engine(args)
    label, slug = device_name()
    avoid = set(tokenizer.eos_token_ids) | {engine.spec.bos_token_id}
    samples: dict[tuple[int, str, bool], list[dict]] = {}
    clients = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        # First round unmeasured: compiles every bucket these runs touch, starts the client process.
        for r in range(args.repeats + 1):
            for n in levels:
                prompts = prompts_for(n, args.prompt_tokens, engine.spec.vocab_size, avoid, seed=r * 1000 + n)
                for tracing_on in (False, True):
                    for path in ("in-process", "grpc"):
                        recorder = make_recorder(tracing_on, folder)
                        if path == "grpc":
                            result = run_grpc(engine, tokenizer, prompts, args.max_tokens, recorder, clients)
                        else:
                            result = run_in_process(engine, tokenizer, prompts, args.max_tokens, recorder)
                        if r > 0:
                            samples.setdefault((n, path, tracing_on), []).append(result)
                            print(f"round {r} n={n:3d} {path:10s} tracing={'on ' if tracing_on else 'off'} "
                                  f"{result['ms_per_token']:8.3f} ms/token {result['tokens_per_s']:9.1f} tok/s",
                                  flush=True)
    clients.shutdown()

    def median(n: int, path: str, tracing_on: bool, key: str) -> float:
        return statistics.median(s[key] for s in samples[(n, path, tracing_on)])

    rows = []
    for n in levels:
        key, higher = ("ms_per_token", False) if n == 1 else ("tokens_per_s", True)
        for tracing_on in (False, True):
            for path in ("in-process", "grpc"):
                value = median(n, path, tracing_on, key)
                rows.append({
                    "concurrency": n,
                    "path": path,
                    "tracing": tracing_on,
                    "ms_per_token": round(median(n, path, tracing_on, "ms_per_token"), 4),
                    "tokens_per_s": round(median(n, path, tracing_on, "tokens_per_s"), 2),
                    "grpc_overhead": None if path == "in-process" else round(
                        overhead(value, median(n, "in-process", tracing_on, key), higher_is_better=higher), 4),
                    "tracing_overhead": None if not tracing_on else round(
                        overhead(value, median(n, path, False, key), higher_is_better=higher), 4),
                    "overhead_metric": key,
                    "tokens": int(median(n, path, tracing_on, "tokens")),
                })
    result = {
        **result_file.provenance(label, argv, script=__file__),
        "xla_allocator": xla_allocator(),
        "config": {
            "model": args.model_path or args.preset, "tp": args.tp, "strategy": args.strategy,
            "batch_slots": args.batch_slots, "max_seq_len": args.max_seq_len,
            "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens, "repeats": args.repeats,
            "switch_interval_s": sys.getswitchinterval(),
        },
        "rows": rows,
    }
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / "current" / f"serve-{slug}.json"
    result_file.write_result(out, result)
    print(f"{'n':>3} {'path':10} {'tracing':7} {'ms/token':>9} {'tokens/s':>10} {'grpc +':>7} {'trace +':>7}")
    for row in rows:
        g = "" if row["grpc_overhead"] is None else f"{100 * row['grpc_overhead']:6.2f}%"
        t = "" if row["tracing_overhead"] is None else f"{100 * row['tracing_overhead']:6.2f}%"
        print(f"{row['concurrency']:>3} {row['path']:10} {row['tracing']!s:7} {row['ms_per_token']:>9.3f} "
              f"{row['tokens_per_s']:>10.1f} {g:>7} {t:>7}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
