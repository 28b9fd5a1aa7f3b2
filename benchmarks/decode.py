"""Decode step time against the HBM roofline, for a Llama shape with random weights on the GPU.

In one run: measures the device's copy bandwidth (a large device-to-device copy, bytes read + written),
then for each (tp, batch, context, strategy, attention, k-splits, narrowest width) builds the engine,
seats ``batch`` sequences at that context (their random prompts computed in real chunk steps), times
the serving loop (each step's blocks, plan and launch, then step n-1's tokens brought to the host, as
the scheduler does) and reports ms/token against the roofline (weight + KV bytes per GPU per step over
the measured bandwidth). ``roofline_ms`` counts the bytes a step must read
(``ModelSpec.decode_bytes_per_step``: the embedding table only as the rows it gathers);
``roofline_all_weights_ms`` counts every parameter byte plus the KV, the accounting behind the target
"85% of roofline = 4.4 ms/token" for Llama-3-8B on H200.
Every engine is the product's, built and driven by ``benchmarks/drive.py``; each option is a field
of ``EngineConfig``: ``--attention kernel|xla`` its ``decode_attention`` (``auto``, our kernel where it
runs, or XLA's ops), ``--k-splits`` its ``row_parallel_splits``, ``--min-batch-bucket`` its
``min_batch_width``, ``--strategy`` its all-reduce strategy, ``--weights`` its ``quantization`` and
``w8a8_min_rows`` (bf16, or FP8 quantized at load: the roofline counts the FP8 bytes), ``--kv-cache``
its ``kv_cache_dtype``. ``--hlo-dir`` writes the optimised HLO
of each configuration's decode step (at the first batch and context) as XLA dumps it.
``--peer torch-compile`` also times ``benchmarks/torch_peer.py`` (a gpt-fast-style PyTorch decoder
under ``torch.compile``) at the same batches and contexts in the same run, in a subprocess that ends
before JAX takes the GPU, and writes its rows beside ours. Several ``--tp`` sizes run one after the
other, each in a process of its own (the kernels serve one device list per process), into one result.

    python benchmarks/decode.py --model llama3-8b --tp 1 --batch 1 8 32 --context 1024 \
        --peer torch-compile --out benchmarks/results/current/decode-tp1-h200.json
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import os
import platform
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import jax
import jax.numpy as jnp
from switchyard.kernels import K_SPLITS
from switchyard.kernels.selection import STRATEGIES
from switchyard.service.engine.engine import Engine
from switchyard.service.engine.step_policy import MIN_BATCH_WIDTH
from switchyard.service.engine.xla_runtime import apply_process_defaults, xla_allocator
from switchyard.service.modelspec import preset

# benchmarks/drive.py (engines built through EngineConfig, driven through the step contract), loaded on first use.
drive = functools.cache(lambda: SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("drive.py")))))
# benchmarks/result_file.py (provenance and writing), by its path: PYTHONSAFEPATH=1 keeps benchmarks/ off sys.path.
result_file = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("result_file.py"))))
# --attention: EngineConfig.decode_attention
ATTENTIONS = {"kernel": "auto", "xla": "xla"}
# --weights: EngineConfig.quantization and w8a8_min_rows (the layer matrices in bf16, or quantized to
# FP8 at load with the product's policy: the engine's default, weight-only in every product, or FP8 x
# FP8 in every product).
WEIGHTS = {"bf16": {"quantization": "auto"}, "fp8": {"quantization": "fp8"},
           "fp8-w8a16": {"quantization": "fp8", "w8a8_min_rows": 0},
           "fp8-w8a8": {"quantization": "fp8", "w8a8_min_rows": 1}}


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


# Decode steps each row runs after seating, besides the timed loop: the synchronous steps (and their
# warm-up) and the profile's (warm-up and traced). Every step moves each sequence one position on.
SYNC_WARMUP = 2
PROFILE_WARMUP, PROFILE_STEPS = 3, 8


STEP_MODULE = "jit_step"  # the name XLA gives the engine's step programs (``jax.jit`` of its ``step``)


def hlo_summary(text: str) -> dict:
    """Counts in an optimised step HLO that reveal bytes read twice (copies, dynamic slices)."""
    lines = text.splitlines()
    return {
        "copies": sum(" copy(" in ln or "copy-start" in ln for ln in lines),
        "dynamic_slices": sum("dynamic-slice(" in ln for ln in lines),
        "all_reduces": sum("all-reduce(" in ln or "all-reduce-start(" in ln for ln in lines),
        "custom_calls": sum("custom-call(" in ln for ln in lines),
        "fusions": sum(ln.lstrip().startswith("%fusion") or " fusion(" in ln for ln in lines),
    }


def dump_step_programs(folder: Path) -> None:
    """Have XLA write the optimised HLO of every step program this process compiles into ``folder``
    (XLA's own dump flags, read when JAX starts its backend: call before any device is used)."""
    flags = f"--xla_dump_to={folder} --xla_dump_hlo_as_text --xla_dump_hlo_module_re={STEP_MODULE}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()


def dumped_step_programs(folder: Path | None) -> set[Path]:
    """The optimised step programs XLA has written into ``folder`` so far (none without a folder)."""
    return set() if folder is None else set(folder.glob(f"module_*.{STEP_MODULE}.*after_optimizations.txt"))


def new_step_program(folder: Path, before: set[Path]) -> str:
    """The HLO of the step program compiled since ``before`` was listed: the last one, when several."""
    new = sorted(dumped_step_programs(folder) - before)
    if not new:
        raise RuntimeError(f"XLA wrote no step program into {folder}")
    return new[-1].read_text()


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


def profile_steps(engine: Engine, kv: Any, steps: int, out_dir: str) -> dict:
    """Trace ``steps`` decode steps (each collected before the next) with the JAX profiler and
    summarise GPU kernel time from the Perfetto trace: how much of each step the GPU is busy, and
    with what."""
    drive().time_synchronous(engine, kv, steps=0, warmup=PROFILE_WARMUP)

    def run() -> None:
        drive().time_synchronous(engine, kv, steps=steps, warmup=0)

    kernels, host = trace_gpu(run, out_dir)
    busy, span, top = kernel_totals(kernels, name_chars=80, top=20)
    api = {}
    host_time: dict[str, list[float]] = {}
    for e in host:
        n = e["name"]
        if any(k in n for k in ("Launch", "launch", "Graph", "graph", "Memcpy", "Synchronize")):
            api[n] = api.get(n, 0) + 1
        host_time.setdefault(n[:80], []).append(e.get("dur", 0))
    # Host time by event name: a step whose command buffers are updated or re-recorded shows it here.
    top_host = sorted(host_time.items(), key=lambda kv: -sum(kv[1]))[:25]
    return {
        "steps": steps, "gpu_events": len(kernels), "gpu_events_per_step": len(kernels) / steps,
        "gpu_busy_us_per_step": busy / steps, "gpu_span_us_per_step": span / steps,
        "host_api_calls": dict(sorted(api.items(), key=lambda kv: -kv[1])[:12]),
        "top_kernels": [{"name": n, "count": len(d), "total_us": round(sum(d), 1)} for n, d in top],
        "top_host_events": [{"name": n, "count": len(d), "total_us": round(sum(d), 1)} for n, d in top_host],
    }


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


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--tp", type=int, nargs="+", default=[1])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--strategy", nargs="+", default=["xla"], choices=STRATEGIES,
                        help="all-reduce strategies to compare")
    parser.add_argument("--attention", nargs="+", default=["kernel"], choices=sorted(ATTENTIONS),
                        help="decode attention: the CUDA kernel where it runs, or XLA's ops (compare both)")
    parser.add_argument("--k-splits", type=int, nargs="+", default=[K_SPLITS],
                        help="row-parallel products as this many partial products for the fused kernel (1: plain dot)")
    parser.add_argument("--weights", nargs="+", default=["bf16"], choices=sorted(WEIGHTS),
                        help="layer matrices: bf16, or FP8 quantized at load (fp8: the engine's product policy; "
                        "fp8-w8a16: weight-only products; fp8-w8a8: FP8 x FP8 products)")
    parser.add_argument("--kv-cache", nargs="+", default=["auto"], choices=["auto", "fp8"],
                        help="KV cache: the model's dtype, or FP8 with a scale per position and head")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--out", help="result JSON path")
    parser.add_argument("--hlo-dir", help="write the optimised decode-step HLO of each configuration here (at the "
                                          "first batch and context)")
    parser.add_argument("--min-batch-bucket", type=int, nargs="+", default=[MIN_BATCH_WIDTH],
                        help="narrowest decode width the engine compiles (default: the engine's; 1 runs one "
                             "sequence as one row, which the engine never does)")
    parser.add_argument("--profile-dir", help="trace a few steps of the first config of each tp here")
    parser.add_argument("--copy-gib", type=float, default=4.0, help="size of the bandwidth-probe copy")
    parser.add_argument("--peer", choices=["torch-compile"],
                        help="also time the PyTorch peer (benchmarks/torch_peer.py) at the same batches and contexts")
    parser.add_argument("--peer-sdpa", nargs="+", default=["math", "efficient"],
                        help="the peer's attention backends (gpt-fast uses math; the best one is compared)")
    parser.add_argument("--peer-device", default="cuda", help="the peer's torch device (cpu: eager, for tests)")
    return parser.parse_args(argv)


def decode_room(args: argparse.Namespace) -> int:
    """Positions each seated sequence moves on in a row: the timed loop (with the step launched
    ahead), the synchronous steps and the profile's."""
    return 1 + args.warmup + args.steps + args.steps // 2 + SYNC_WARMUP + PROFILE_WARMUP + PROFILE_STEPS


def measure(engine: Engine, args: argparse.Namespace, batch: int, context: int, name: str, first: bool,
            dump: Path | None) -> dict:
    """Seat ``batch`` sequences at ``context`` on ``engine`` and time its decode steps: the timed
    loop's per-step seconds, the synchronous step's median ms, and (for the first configuration) the
    step's HLO and profile."""
    kv = drive().books(engine)
    drive().seat(engine, kv, batch, context)
    before = dumped_step_programs(dump)
    timed = drive().time_decode(engine, kv, args.steps, args.warmup)  # its first step compiles the decode program
    out: dict[str, Any] = {"times": timed.times, "launch_ms": timed.launch_ms}
    if dump is not None and first:
        Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
        text = new_step_program(dump, before)
        Path(args.hlo_dir, f"step-{name}.hlo.txt").write_text(text)
        print("  hlo:", hlo_summary(text), flush=True)
    out["sync_ms"] = 1000 * statistics.median(drive().time_synchronous(engine, kv, args.steps // 2, SYNC_WARMUP))
    # The profile comes after the timing, so that the tracer cannot touch the timed steps.
    if args.profile_dir and first:
        out["profile"] = profile_steps(engine, kv, PROFILE_STEPS, f"{args.profile_dir}/{name}")
        print("  profile:", json.dumps(out["profile"], indent=1), flush=True)
    return out


def with_tp(argv: list[str], tp: int, out: Path) -> list[str]:
    """``argv`` with its ``--tp`` sizes replaced by ``tp`` and its ``--out`` by ``out``."""
    kept, skipping = [], False
    for arg in argv:
        if arg in ("--tp", "--out"):
            skipping = True
            continue
        if skipping and not arg.startswith("--"):
            continue
        skipping = False
        kept.append(arg)
    return [*kept, "--tp", str(tp), "--out", str(out)]


def run_each_tp(args: argparse.Namespace, argv: list[str]) -> int:
    """Several TP sizes: each in a process of its own (the kernels serve one device list per process),
    one after the other, their rows in one result as one process would have written it."""
    merged: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="switchyard-decode-") as scratch:
        for tp in args.tp:
            out = Path(scratch, f"tp{tp}.json")
            if subprocess.run([sys.executable, __file__, *with_tp(argv, tp, out)]).returncode != 0:
                print(f"decode.py: the TP={tp} run failed", file=sys.stderr)
                return 1
            result = json.loads(out.read_text())
            if merged is None:
                merged = result
            else:
                merged["rows"] += result["rows"]
                if "peer" in result and "peer" not in merged:
                    merged["peer"] = result["peer"]
    assert merged is not None
    merged["command"] = result_file.command_line(argv, __file__)
    if args.out:
        result_file.write_result(args.out, merged)
    print(json.dumps(merged["rows"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if len(args.tp) > 1:
        return run_each_tp(args, list(argv if argv is not None else sys.argv[1:]))
    apply_process_defaults()  # as serve's engine process
    xla_flags = os.environ.get("XLA_FLAGS", "")
    scratch = tempfile.TemporaryDirectory(prefix="switchyard-hlo-") if args.hlo_dir else None
    dump = Path(scratch.name) if scratch else None
    if dump is not None:
        dump_step_programs(dump)

    spec = preset(args.model)
    peer = run_peer(args) if args.peer else None  # before JAX initialises the GPU and takes its memory
    device = jax.devices()[0]
    probes = copy_bandwidth(args.copy_gib)
    bandwidth = max(probes.values())
    print(f"{device.device_kind}: copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write; probes "
          + ", ".join(f"{k} {v / 1e12:.2f}" for k, v in probes.items()) + ")", flush=True)
    rows: list[dict] = []

    def result() -> dict[str, Any]:
        out = {
            **result_file.provenance(f"{jax.device_count()}x {device.device_kind}", argv, script=__file__),
            "jax": jax.__version__,
            "host": platform.node(),
            "copy_bandwidth_bytes_per_s": round(bandwidth),
            "copy_bandwidth_probes": {k: round(v) for k, v in probes.items()},
            "xla_flags": xla_flags,
            "xla_allocator": xla_allocator(),
            "rows": rows,
        }
        if peer is not None:
            out["peer"] = peer
        return out

    for tp, weights_kind in itertools.product(args.tp, args.weights):
        weights = None  # this tp's random weights in this format, shared by every configuration
        served = spec.served_as(WEIGHTS[weights_kind]["quantization"])
        configs = itertools.product(args.strategy, args.min_batch_bucket, args.attention, args.k_splits, args.kv_cache)
        for strategy, min_bucket, attn, k_splits, kv_cache in configs:
            for context in args.context:
                for batch in args.batch:
                    slots = max(batch, min_bucket)
                    config = drive().whole_tables_config(
                        slots, context + decode_room(args), strategy=strategy, dtype="bfloat16",
                        min_batch_width=min_bucket, decode_attention=ATTENTIONS[attn], row_parallel_splits=k_splits,
                        kv_cache_dtype=kv_cache, **WEIGHTS[weights_kind])
                    t0 = time.perf_counter()
                    if weights is None:
                        engine = drive().random_engine(spec, config, tp=tp, devices=jax.devices()[:tp])
                        weights = drive().weights_of(engine)
                    else:
                        engine = drive().engine_on(weights, config)
                    name = (f"tp{tp}-b{batch}-{strategy}-{attn}" + ("" if k_splits == K_SPLITS else f"-k{k_splits}")
                            + ("" if min_bucket == MIN_BATCH_WIDTH else f"-w{min_bucket}")
                            + ("" if weights_kind == "bf16" else f"-{weights_kind}")
                            + ("" if kv_cache == "auto" else "-kvfp8"))
                    first = batch == args.batch[0] and context == args.context[0]
                    got = measure(engine, args, batch, context, name, first, dump)
                    times, sync_ms = got["times"], got["sync_ms"]
                    setup = time.perf_counter() - t0
                    ms = 1000 * statistics.median(times)
                    per_gpu = served.decode_bytes_per_step(batch, context, kv_cache) / tp
                    roofline_ms = 1000 * per_gpu / bandwidth
                    kv_token = served.kv_bytes_per_token_per_gpu(1, 1, kv_cache)
                    all_weights = served.param_bytes + batch * context * kv_token
                    all_weights_ms = 1000 * all_weights / tp / bandwidth
                    row = {"model": args.model, "tp": tp, "batch": batch, "context": context, "strategy": strategy,
                           "attention": attn, "k_splits": k_splits, "min_batch_bucket": min_bucket,
                           "weights": weights_kind, "weights_label": engine.weights_label, "kv_cache": kv_cache,
                           "ms_per_token": round(ms, 4),
                           "tokens_per_s": round(batch * 1000 / ms, 1),
                           "roofline_ms": round(roofline_ms, 4), "fraction_of_roofline": round(roofline_ms / ms, 4),
                           "roofline_all_weights_ms": round(all_weights_ms, 4),
                           "fraction_of_roofline_all_weights": round(all_weights_ms / ms, 4),
                           "p90_ms": round(1000 * sorted(times)[int(0.9 * len(times))], 4),
                           "synchronous_ms_per_token": round(sync_ms, 4),
                           # The host's part: a step launched in about its own time is host-bound.
                           "host_launch_ms": round(statistics.median(got["launch_ms"]), 4)}
                    if "profile" in got:
                        row["profile"] = got["profile"]
                    rows.append(row)
                    if args.out:  # after every row: a run cut short by a time limit keeps what it measured
                        result_file.write_result(args.out, result())
                    print(f"tp={tp} batch={batch:3d} ctx={context:5d} {strategy:8s} attention {attn:6s} "
                          f"k-splits {k_splits} min-bucket {min_bucket} weights {weights_kind} kv {kv_cache} "
                          f"{ms:8.3f} ms/token "
                          f"roofline {roofline_ms:7.3f} ms ({100 * roofline_ms / ms:5.1f}%) "
                          f"sync {sync_ms:7.3f} ms  [{setup:.0f}s]", flush=True)
                    del engine
                    gc.collect()
        del weights
        gc.collect()

    if peer is not None:
        print(comparison(rows, peer["rows"]), flush=True)
    if args.out:
        result_file.write_result(args.out, result())
    print(json.dumps(rows))
    if scratch is not None:
        scratch.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
