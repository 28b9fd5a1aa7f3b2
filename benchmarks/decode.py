"""Decode step time against the HBM roofline, for a Llama shape with random weights on the GPU.

In one run: measures the device's copy bandwidth (a large device-to-device copy, bytes read + written),
then for each (tp, batch, context, strategy) builds the engine with every slot occupied at that context,
times the serving loop (launch step n+1, then bring step n's tokens to the host, as the scheduler does) and reports
ms/token against the roofline (weight + KV bytes per GPU per step over the measured bandwidth).
``roofline_ms`` counts the bytes a step must read (``ModelSpec.decode_bytes_per_step``: the embedding
table only as the rows it gathers); ``roofline_all_weights_ms`` counts every parameter byte plus the
KV, the accounting behind the target "85% of roofline = 4.4 ms/token" for Llama-3-8B on H200.
Every engine is built through ``benchmarks/variants.py`` (a random KV cache; ``--attention``,
``--k-splits``, ``--min-batch-bucket`` and the ``none`` strategy, a step without communication, are
variants of the product). ``--peer torch-compile`` also times ``benchmarks/torch_peer.py`` (a
gpt-fast-style PyTorch decoder under ``torch.compile``) at the same batches and contexts in the same
run, in a subprocess that ends before JAX takes the GPU, and writes its rows beside ours.

    python benchmarks/decode.py --model llama3-8b --tp 1 --batch 1 8 32 --context 1024 \
        --peer torch-compile --out benchmarks/results/current/decode-tp1-h200.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import itertools
import json
import os
import platform
import runpy
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import jax
import jax.numpy as jnp
from switchyard.kernels import K_SPLITS
from switchyard.service.engine.tensor_parallel import Engine
from switchyard.service.engine.xla_runtime import apply_process_defaults, xla_allocator
from switchyard.service.modelspec import KV_BLOCK_TOKENS, ModelSpec, ServingLayout, preset

# benchmarks/variants.py (engines that are not the product), loaded on first use.
variants = functools.cache(lambda: SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("variants.py")))))


def copy_bandwidth(gib: float = 4.0, repeats: int = 20) -> dict[str, float]:
    """Bytes per second of large device-to-device copies (bytes read + written), by several probes.

    The roofline uses the fastest probe, so fractions are never flattered by a slow copy kernel.
    """
    n = int(gib * (1 << 30)) // 4
    probes: dict[str, float] = {}
    # PyTorch first: a JAX client that preallocates its share of the GPU may leave too little after it.
    try:
        import torch

        if torch.cuda.is_available():
            src = torch.randint(0, 2**31 - 1, (n,), dtype=torch.int32, device="cuda")
            dst = torch.empty_like(src)
            dst.copy_(src)
            times = []
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1000)
            probes["torch_copy"] = 2 * n * 4 / statistics.median(times)
            del src, dst
            torch.cuda.empty_cache()
    except ImportError:
        pass
    x = jax.jit(lambda k: jax.random.bits(k, (n,), jnp.uint32))(jax.random.PRNGKey(0))
    for name, fn in (("jax_u32_xor", lambda a: a ^ jnp.uint32(1)),
                     ("jax_bf16_add", lambda a: (jax.lax.bitcast_convert_type(a, jnp.bfloat16) + 1))):
        f = jax.jit(fn)
        f(x).block_until_ready()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            f(x).block_until_ready()
            times.append(time.perf_counter() - t0)
        probes[name] = 2 * n * 4 / statistics.median(times)
    del x
    return probes


def hlo_summary(engine: Engine, batch: int) -> dict:
    """Counts in the optimised step HLO that reveal bytes read twice (copies, dynamic slices)."""
    text = engine._step_fn(batch, True, False).lower(engine.params, engine._state).compile().as_text()
    lines = text.splitlines()
    return {
        "copies": sum(" copy(" in ln or "copy-start" in ln for ln in lines),
        "dynamic_slices": sum("dynamic-slice(" in ln for ln in lines),
        "all_reduces": sum("all-reduce(" in ln or "all-reduce-start(" in ln for ln in lines),
        "custom_calls": sum("custom-call(" in ln for ln in lines),
        "fusions": sum(ln.lstrip().startswith("%fusion") or " fusion(" in ln for ln in lines),
        "hlo_text": text,
    }


def trace_gpu(run, out_dir: str) -> tuple[list[dict], list[dict]]:
    """Call ``run()`` under the JAX profiler; the GPU's kernel events and the host's events from
    the Perfetto trace (``dur`` in µs)."""
    import glob
    import gzip

    jax.profiler.start_trace(out_dir, create_perfetto_trace=True)
    run()
    jax.profiler.stop_trace()
    path = sorted(glob.glob(f"{out_dir}/**/*perfetto_trace.json.gz", recursive=True))[-1]
    with gzip.open(path) as f:
        events = json.loads(f.read())["traceEvents"]
    pnames = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu_pids = {pid for pid, name in pnames.items() if "GPU" in name or "gpu" in name}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu_pids]
    if not kernels:
        print("  profile: no GPU events; processes:", sorted(set(pnames.values()))[:10], flush=True)
    return kernels, [e for e in events if e.get("ph") == "X" and e.get("pid") not in gpu_pids]


def kernel_totals(kernels: list[dict], name_chars: int, top: int) -> tuple[float, float, list[tuple[str, list]]]:
    """GPU events' busy time and span (µs), and the ``top`` kernel names (cut to ``name_chars``) by
    total time, each with its events' durations."""
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e["name"][:name_chars], []).append(e.get("dur", 0))
    busy = sum(e.get("dur", 0) for e in kernels)
    span = (max(e["ts"] + e.get("dur", 0) for e in kernels) - min(e["ts"] for e in kernels)) if kernels else 0
    return busy, span, sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]


def step_profile(kernels: list[dict], steps: int, name_chars: int = 90, top: int = 25) -> dict:
    """Per-step GPU busy time and span (µs) of ``steps`` steps' kernel events, and the top kernels with
    their counts and time per step."""
    busy, span, ranked = kernel_totals(kernels, name_chars=name_chars, top=top)
    return {"steps": steps, "gpu_busy_us_per_step": round(busy / steps, 1),
            "gpu_span_us_per_step": round(span / steps, 1),
            "top_kernels": [{"name": n, "count": len(d), "total_us_per_step": round(sum(d) / steps, 1)}
                            for n, d in ranked]}


def profile_steps(engine: Engine, steps: int, out_dir: str) -> dict:
    """Trace ``steps`` engine steps with the JAX profiler and summarise GPU kernel time from the
    Perfetto trace: how much of each step the GPU is busy, and with what."""
    for _ in range(3):
        engine.generate()

    def run() -> None:
        for _ in range(steps):
            engine.generate()

    kernels, host = trace_gpu(run, out_dir)
    busy, span, top = kernel_totals(kernels, name_chars=80, top=20)
    api = {}
    for e in host:
        n = e["name"]
        if any(k in n for k in ("Launch", "launch", "Graph", "graph", "Memcpy", "Synchronize")):
            api[n] = api.get(n, 0) + 1
    return {
        "steps": steps, "gpu_events": len(kernels), "gpu_events_per_step": len(kernels) / steps,
        "gpu_busy_us_per_step": busy / steps, "gpu_span_us_per_step": span / steps,
        "host_api_calls": dict(sorted(api.items(), key=lambda kv: -kv[1])[:12]),
        "top_kernels": [{"name": n, "count": len(d), "total_us": round(sum(d), 1)} for n, d in top],
    }


def time_serving_loop(engine: Engine, steps: int, warmup: int) -> list[float]:
    """Per-token times of the serving loop: launch step n+1, then bring step n's tokens to the host
    (what the scheduler does), so host work overlaps the device's."""
    pending = engine.dispatch()
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        nxt = engine.dispatch()
        engine.collect(pending)
        pending = nxt
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    engine.collect(pending)
    return times


def time_synchronous(engine: Engine, steps: int, warmup: int) -> list[float]:
    """Per-token times when each step is waited for before the next is launched."""
    for _ in range(warmup):
        engine.generate()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.generate()
        times.append(time.perf_counter() - t0)
    return times


def source_commit() -> str:
    """The commit of the code measured: $SWITCHYARD_COMMIT where it is set (a copy of a working tree on
    a benchmark machine, whose .git may be another commit's), else git's."""
    import subprocess

    if os.environ.get("SWITCHYARD_COMMIT"):
        return os.environ["SWITCHYARD_COMMIT"]
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True,
                          check=False)
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def run_peer(args: argparse.Namespace) -> dict:
    """benchmarks/torch_peer.py at this run's model, batches and contexts, as its own process (its
    CUDA context and memory are gone when it returns); its result file's content."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="switchyard-peer-") as scratch:
        out = Path(scratch, "peer.json")
        cmd = [sys.executable, str(Path(__file__).with_name("torch_peer.py")), "--model", args.model,
               "--batch", *map(str, args.batch), "--context", *map(str, args.context), "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--sdpa", *args.peer_sdpa, "--device", args.peer_device,
               "--out", str(out)]
        if args.peer_device == "cpu":
            cmd.append("--no-compile")
        done = subprocess.run(cmd, text=True, capture_output=True, check=False)
        print(done.stdout, end="", flush=True)
        if done.returncode != 0:
            raise SystemExit(f"the peer failed ({done.returncode}):\n{done.stderr[-4000:]}")
        return json.loads(out.read_text())


def comparison(rows: list[dict], peer_rows: list[dict]) -> str:
    """Our ms/token beside the peer's fastest attention backend, per batch and context (TP=1 rows)."""
    lines = [f"{'batch':>5} {'context':>7} {'switchyard ms':>13} {'peer ms':>8} {'peer sdpa':>9} {'ours / peer':>11}"]
    for row in rows:
        if row["tp"] != 1:
            continue
        matching = [p for p in peer_rows if p["batch"] == row["batch"] and p["context"] == row["context"]]
        if not matching:
            continue
        best = min(matching, key=lambda p: p["ms_per_token"])
        ratio = row["ms_per_token"] / best["ms_per_token"]
        lines.append(f"{row['batch']:>5} {row['context']:>7} {row['ms_per_token']:>13.3f} "
                     f"{best['ms_per_token']:>8.3f} {best['sdpa']:>9} {ratio:>11.3f}")
    return "\n".join(lines)


def paged_rows(args: argparse.Namespace, spec: ModelSpec, tp: int, bandwidth: float) -> list[dict]:
    """The token-budget engine's decode step (paged KV pool, block tables), timed as the slot engine's."""
    from switchyard.service.engine.paged import PagedEngine

    rows, params = [], None
    for context in args.context:
        for batch in args.batch:
            max_seq = context + args.steps + args.warmup + 4
            blocks = -(-max_seq // KV_BLOCK_TOKENS)
            layout = ServingLayout(tp=tp, strategy="auto" if tp > 1 else "xla", batch_slots=batch,
                                   max_seq_len=max_seq, kv_tokens=batch * blocks * KV_BLOCK_TOKENS)
            if params is None:
                engine = PagedEngine.from_random(spec, layout, devices=jax.devices()[:tp])
                params = engine.params, engine.mesh
            else:
                engine = PagedEngine(spec, *params, dtype="bfloat16", **PagedEngine.layout_arguments(layout))
            # No engine.warmup(): the untimed steps compile the one decode program timed here.
            variants().occupy_paged(engine, context, batch)
            times = time_serving_loop(engine, args.steps, args.warmup)
            ms = 1000 * statistics.median(times)
            roofline_ms = 1000 * spec.decode_bytes_per_step(batch, context) / tp / bandwidth
            rows.append({"model": args.model, "tp": tp, "batch": batch, "context": context, "engine": "paged",
                         "strategy": layout.strategy, "attention": "kernel", "ms_per_token": round(ms, 4),
                         "tokens_per_s": round(batch * 1000 / ms, 1), "roofline_ms": round(roofline_ms, 4),
                         "fraction_of_roofline": round(roofline_ms / ms, 4),
                         "p90_ms": round(1000 * sorted(times)[int(0.9 * len(times))], 4)})
            print(f"tp={tp} batch={batch:3d} ctx={context:5d} paged {ms:8.3f} ms/token "
                  f"roofline {roofline_ms:7.3f} ms ({100 * roofline_ms / ms:5.1f}%)", flush=True)
            del engine
            gc.collect()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--tp", type=int, nargs="+", default=[1])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--strategy", nargs="+", default=["xla"],
                        help="all-reduce strategies to compare; 'none' times the step without communication "
                             "(a variant whose outputs are meaningless, for the all-reduces' share of a step)")
    parser.add_argument("--attention", nargs="+", default=["kernel"], choices=["kernel", "xla"],
                        help="decode attention: the CUDA kernel where it runs, or XLA's ops (compare both)")
    parser.add_argument("--k-splits", type=int, nargs="+", default=[K_SPLITS],
                        help="row-parallel products as this many partial products for the fused kernel (1: plain dot)")
    parser.add_argument("--engine", nargs="+", default=["slots"], choices=["slots", "paged"],
                        help="the slot engine (its variants), or the token-budget engine with its paged KV pool")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--out", help="result JSON path")
    parser.add_argument("--hlo-dir", help="write the optimised step HLO of each tp at batch 1 here")
    parser.add_argument("--min-batch-bucket", type=int, nargs="+", default=[1],
                        help="smallest step batch the engine compiles (compare 1 and 2)")
    parser.add_argument("--profile-dir", help="trace a few steps of the first config of each tp here")
    parser.add_argument("--copy-gib", type=float, default=4.0, help="size of the bandwidth-probe copy")
    parser.add_argument("--peer", choices=["torch-compile"],
                        help="also time the PyTorch peer (benchmarks/torch_peer.py) at the same batches and contexts")
    parser.add_argument("--peer-sdpa", nargs="+", default=["math", "efficient"],
                        help="the peer's attention backends (gpt-fast uses math; the best one is compared)")
    parser.add_argument("--peer-device", default="cuda", help="the peer's torch device (cpu: eager, for tests)")
    args = parser.parse_args(argv)
    apply_process_defaults(max(args.tp))  # as serve's engine process (one allocator for every run here)

    spec = preset(args.model)
    peer = run_peer(args) if args.peer else None  # before JAX initialises the GPU and takes its memory
    device = jax.devices()[0]
    probes = copy_bandwidth(args.copy_gib)
    bandwidth = max(probes.values())
    print(f"{device.device_kind}: copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write; probes "
          + ", ".join(f"{k} {v / 1e12:.2f}" for k, v in probes.items()) + ")", flush=True)
    rows = []
    for tp in args.tp:
        mesh_devices = jax.devices()[:tp]
        base = None
        slot_configs = itertools.product(args.strategy, args.min_batch_bucket, args.attention, args.k_splits)
        for strategy, min_bucket, attn, k_splits in (slot_configs if "slots" in args.engine else ()):
            # "none": the row-parallel products are not summed (the engine's strategy is then moot)
            engine_strategy = "xla" if strategy == "none" else strategy
            variant = variants().Variant(attention=attn, k_splits=k_splits, communication=strategy != "none",
                                         min_batch_bucket=min_bucket)
            for context in args.context:
                for batch in args.batch:
                    slots = max(batch, min_bucket)
                    layout = ServingLayout(tp=tp, strategy=engine_strategy, batch_slots=slots,
                                           max_seq_len=context + args.steps + args.warmup + 1)
                    t0 = time.perf_counter()
                    if base is None:
                        engine = variants().VariantEngine.from_random(spec, layout, devices=mesh_devices,
                                                                      variant=variant)
                        base = engine.params, engine.mesh
                    else:
                        engine = variants().VariantEngine(spec, *base, batch_slots=slots,
                                                          max_seq_len=layout.max_seq_len, strategy=engine_strategy,
                                                          dtype="bfloat16", variant=variant)
                    engine.occupy_slots(context, count=batch)
                    name = f"tp{tp}-b{batch}-{strategy}-{attn}" + ("" if k_splits == K_SPLITS else f"-k{k_splits}")
                    if args.hlo_dir and batch == args.batch[0] and context == args.context[0]:
                        summary = hlo_summary(engine, batch)
                        Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
                        hlo_file = Path(args.hlo_dir, f"step-{name}.hlo.txt")
                        hlo_file.write_text(summary.pop("hlo_text"))
                        print("  hlo:", summary, flush=True)
                    times = time_serving_loop(engine, args.steps, args.warmup)
                    sync_ms = 1000 * statistics.median(time_synchronous(engine, args.steps // 2, 2))
                    # The profile comes after the timing, so that the tracer cannot touch the timed steps.
                    prof = None
                    if args.profile_dir and batch == args.batch[0] and context == args.context[0]:
                        prof = profile_steps(engine, 8, f"{args.profile_dir}/{name}")
                        print("  profile:", json.dumps(prof, indent=1), flush=True)
                    setup = time.perf_counter() - t0
                    ms = 1000 * statistics.median(times)
                    per_gpu = spec.decode_bytes_per_step(batch, context) / tp
                    roofline_ms = 1000 * per_gpu / bandwidth
                    all_weights = spec.param_bytes + batch * context * spec.kv_bytes_per_token
                    all_weights_ms = 1000 * all_weights / tp / bandwidth
                    row = {"model": args.model, "tp": tp, "batch": batch, "context": context, "strategy": strategy,
                           "attention": attn, "k_splits": k_splits, "min_batch_bucket": min_bucket,
                           "ms_per_token": round(ms, 4),
                           "tokens_per_s": round(batch * 1000 / ms, 1),
                           "roofline_ms": round(roofline_ms, 4), "fraction_of_roofline": round(roofline_ms / ms, 4),
                           "roofline_all_weights_ms": round(all_weights_ms, 4),
                           "fraction_of_roofline_all_weights": round(all_weights_ms / ms, 4),
                           "p90_ms": round(1000 * sorted(times)[int(0.9 * len(times))], 4),
                           "synchronous_ms_per_token": round(sync_ms, 4)}
                    if prof is not None:
                        row["profile"] = prof
                    rows.append(row)
                    print(f"tp={tp} batch={batch:3d} ctx={context:5d} {strategy:8s} attention {attn:6s} "
                          f"k-splits {k_splits} min-bucket {min_bucket} "
                          f"{ms:8.3f} ms/token "
                          f"roofline {roofline_ms:7.3f} ms ({100 * roofline_ms / ms:5.1f}%) "
                          f"sync {sync_ms:7.3f} ms  [{setup:.0f}s]", flush=True)
                    del engine
                    gc.collect()
        if "paged" in args.engine:
            rows += paged_rows(args, spec, tp, bandwidth)
        del base
        gc.collect()

    result = {
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "device": f"{jax.device_count()}x {device.device_kind}",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": source_commit(),
        "jax": jax.__version__,
        "host": platform.node(),
        "copy_bandwidth_bytes_per_s": round(bandwidth),
        "copy_bandwidth_probes": {k: round(v) for k, v in probes.items()},
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "xla_allocator": xla_allocator(),
        "rows": rows,
    }
    if peer is not None:
        result["peer"] = peer
        print(comparison(rows, peer["rows"]), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
