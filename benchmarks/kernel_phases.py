"""Where a kernel's time goes: per-phase timers inside the one-shot, fused and decode-attention kernels.

Builds the diagnostic library (``-DSWITCHYARD_PHASE_TIMER``, see ``kernels/csrc/phase_timer.cuh``)
into a temporary folder, loads it instead of the installed one, runs the same chains as
``benchmarks/allreduce.py`` (all-reduces), a chain of decode-attention calls and ``benchmarks/attention.py``'s
chains of paged decode attention over 16-bit and FP8 pools, and reports for every
phase the mean time from a block's start to the phase's end (SM cycles and ns), plus, from the last
launch, how far apart the blocks started and ended (paged attention: also each phase per slice of the
context). Timers cost a few atomics per block: compare phases with each other, not the chain times
with ``allreduce.py``'s.

    python benchmarks/kernel_phases.py --tag h200x2 --out benchmarks/results/kernel-phases-h200x2.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import runpy
import statistics
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

# benchmarks/result_file.py (provenance and writing), by its path: PYTHONSAFEPATH=1 keeps benchmarks/ off sys.path.
result_file = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("result_file.py"))))

PHASES = {
    "oneshot": ["push", "reduce", "finish"],
    "fused": ["push", "take_reduce_residual", "block_sum", "normed", "finish"],
    "attention": ["q_to_smem", "scores", "chunks", "warp_merge", "cluster_sync", "cluster_merge", "cluster_exit"],
    # csrc/paged_attention.cuh: the block table read and the first stages' copies issued, then the rest of
    # the prologue (the queries, FP8's scaling of them, the new K/V), then the stages (scores and chunks in one loop).
    "paged_attention": ["copies_issued", "prologue", "stages", "warp_merge", "cluster_sync", "cluster_merge",
                        "cluster_exit"],
}


def _load_bench(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_bench", Path(__file__).with_name(f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def summarise(kernel: str, counters) -> dict:
    """Mean ns/cycles from a block's start to each phase's end; block start/end spread of the last launch.
    Empty where the library has no phase timer (then only the chain times are reported)."""
    if counters is None:
        return {}
    n = max(counters.block_launches, 1)
    phases = {}
    for i, name in enumerate(PHASES[kernel], start=1):
        if counters.cycles[i]:
            phases[name] = {"ns": round(counters.ns[i] / n, 1), "cycles": round(counters.cycles[i] / n, 1)}
    last = [b for b in counters.last if b[0]]
    starts = [b[0] for b in last]
    ends = [max(b) for b in last]
    spread = {}
    if last:
        t0 = min(starts)
        spread = {"blocks": len(last), "start_spread_ns": max(starts) - t0, "end_of_last_block_ns": max(ends) - t0,
                  "median_block_ns": statistics.median(e - s for s, e in zip(starts, ends, strict=True))}
    return {"block_launches": counters.block_launches, "phases": phases, "last_launch": spread}


def by_slice(kernel: str, counters, blocks_per_slice: int) -> dict[str, dict[str, float]]:
    """The last launch's blocks grouped by their slice of the context (paged attention's grid is
    [rows x KV heads, slices], so block i is slice i // blocks_per_slice): per slice, the mean ns from a
    block's start to each phase's end. Slice 0 also writes the new K/V and attends the new token, and
    the cluster's barrier waits for its slowest block: this says whether that block is the late one."""
    if counters is None or blocks_per_slice < 1:
        return {}
    spans: dict[int, dict[str, list[int]]] = {}
    for i, stamps in enumerate(counters.last):
        if not stamps[0]:
            continue
        phases = spans.setdefault(i // blocks_per_slice, {})
        for slot, name in enumerate(PHASES[kernel], start=1):
            if stamps[slot]:
                phases.setdefault(name, []).append(stamps[slot] - stamps[0])
    return {str(slice_): {name: round(statistics.fmean(ns), 1) for name, ns in phases.items()}
            for slice_, phases in sorted(spans.items())}


def allreduce_rows(ar, reps: int, sizes: list[int]) -> list[dict]:
    from switchyard.kernels import native

    bench = ar.JaxBench(reps)
    ordinals = [int(d.local_hardware_id) for d in bench.devices]
    rows = []
    for nbytes in sizes:
        for kernel, (fn, args, k) in (("oneshot", bench.plain("oneshot", nbytes)[0]),
                                      ("fused", bench.fused("oneshot", nbytes))):
            bench.jax.block_until_ready(fn(*args))
            for o in ordinals:
                native.phase_counters(o)  # clear what compilation and warm-up left
            samples = [bench.sample(fn, args, k)[0] for _ in range(reps)]
            for rank, o in enumerate(ordinals):
                row = {"kernel": kernel, "bytes": nbytes, "gpu": rank,
                       "chain_us_per_call": round(statistics.median(samples), 2)}
                row.update(summarise(kernel, native.phase_counters(o)))
                rows.append(row)
                print(json.dumps(row), flush=True)
    bench.kernels.check_errors()
    return rows


def attention_rows(ar, reps: int, shapes: list[tuple[int, int]], k: int = 64) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from switchyard.kernels import attention, native

    if not native.attention_ready():
        raise SystemExit("decode-attention kernel unavailable")
    dev = jax.devices("gpu")[0]
    kv, group, d = 8, 4, 128  # Llama-3-8B at TP=1
    rows = []
    for n, ctx in shapes:
        rng = np.random.default_rng(n * 7919 + ctx)
        q = jax.device_put(jnp.asarray(rng.standard_normal((n, kv * group, d)), jnp.bfloat16), dev)
        kn = jax.device_put(jnp.asarray(rng.standard_normal((n, kv, d)), jnp.bfloat16), dev)
        kc = jax.device_put(jnp.asarray(rng.standard_normal((n, kv, ctx + 128, d)), jnp.bfloat16), dev)
        vc = jax.device_put(jnp.asarray(rng.standard_normal((n, kv, ctx + 128, d)), jnp.bfloat16), dev)
        pos = jnp.full((n,), ctx, jnp.int32)

        def body(q, kc, vc, kn=kn, pos=pos):
            q, t0 = native.timestamp(q)
            for _ in range(k):  # each call's queries are the previous call's output: latency, as in a step
                q, kc, vc = attention.decode_attention(q, kn, kn, kc, vc, pos, pos)
            q, t1 = native.timestamp(q)
            return t0, t1, q, kc, vc

        f = jax.jit(body, donate_argnums=(1, 2))
        t0, t1, q2, kc, vc = f(q, kc, vc)
        jax.block_until_ready(q2)
        native.phase_counters(int(dev.local_hardware_id))
        us = []
        for _ in range(reps):
            t0, t1, q2, kc, vc = f(q, kc, vc)
            (a,), (b,) = ar.stamps_ns(t0), ar.stamps_ns(t1)
            us.append((b - a) / k / 1000)
        row = {"kernel": "attention", "rows": n, "context": ctx, "splits": attention.splits_for(n, kv, ctx + 128),
               "chain_us_per_call": round(statistics.median(us), 2)}
        row.update(summarise("attention", native.phase_counters(int(dev.local_hardware_id))))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def paged_attention_rows(reps: int, shapes: list[tuple[int, int]], min_calls: int = 64) -> list[dict]:
    """``benchmarks/attention.py``'s chains of paged decode attention (Llama-3-8B heads, blocks of 64,
    shuffled tables, layers cycled through so that the pools come from HBM), over 16-bit pools and the
    same pools rounded to FP8: per pool kind the chain's time per call and the phases."""
    import jax
    import jax.numpy as jnp
    from switchyard.kernels import native

    if not native.attention_ready():
        raise SystemExit("decode-attention kernel unavailable")
    bench = _load_bench("attention")
    dev = jax.devices("gpu")[0]
    kv, group, d, block = 8, 4, 128, 64
    rows = []
    for n, ctx in shapes:
        p = bench.plan(n, ctx, kv, d, block, 2, min_calls)
        key = jax.random.PRNGKey(n * 7919 + ctx)
        _, paged, tables = bench.make_layers(key, n, kv, d, block, p["m"], p["layers"], jnp.bfloat16, True)
        base = {"qkv": jax.random.normal(jax.random.fold_in(key, 1), (n, kv * group + 2 * kv, d), jnp.bfloat16),
                "tables": tables, "positions": jnp.full((n,), ctx, jnp.int32)}
        states = {"bf16": {**base, "ks": [c[0] for c in paged], "vs": [c[1] for c in paged]},
                  "fp8": {**base, "ks": [bench.to_fp8(c[0]) for c in paged], "vs": [bench.to_fp8(c[1]) for c in paged]}}
        del paged
        for pool, state in states.items():
            fn = bench.chain("paged", p["calls"], p["layers"])
            bench.time_chain(fn, state, 2)  # compiled and warm
            native.phase_counters(int(dev.local_hardware_id))  # clear what compilation and warm-up left
            seconds = [bench.time_chain(fn, state, 1) / p["calls"] for _ in range(reps)]
            splits = bench.attention.splits_for(n, kv, p["m"] * block, fp8_pools=pool == "fp8")
            row = {"kernel": "paged_attention", "pool": pool, "rows": n, "context": ctx, "splits": splits,
                   "calls": p["calls"],
                   "chain_us_per_call": round(statistics.median(seconds) * 1e6, 2)}
            counters = native.phase_counters(int(dev.local_hardware_id))
            row.update(summarise("paged_attention", counters))
            row["last_launch_by_slice"] = by_slice("paged_attention", counters, n * kv)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del states
    return rows


def pairs(text: str) -> list[tuple[int, int]]:
    """'rows:context,...' as pairs ('' for none)."""
    return [tuple(int(v) for v in s.split(":")) for s in text.split(",") if s]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default="local")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--lib", type=Path, default=None, help="an already built diagnostic library")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--sizes", type=int, nargs="*", default=[8192, 16384, 65536])
    parser.add_argument("--attention", default="2:1024,8:1024,32:1024",
                        help="rows:context pairs for the attention chains ('' for none)")
    parser.add_argument("--paged-attention", default="1:1024,8:1024,1:4096",
                        help="rows:context pairs for the paged chains, 16-bit and FP8 pools ('' for none)")
    args = parser.parse_args()
    ar = _load_bench("allreduce")
    ar.environment()  # no NVLink multicast, command buffers on: before JAX starts
    lib = args.lib
    if lib is None:
        from switchyard.kernels import build

        lib = build.build(Path(tempfile.mkdtemp()) / build.LIB_NAME, defines=(build.PHASE_TIMER,))
    os.environ["SWITCHYARD_KERNELS_LIB"] = str(lib)
    import jax

    rows = allreduce_rows(ar, args.reps, args.sizes) if len(jax.devices("gpu")) > 1 and args.sizes else []
    rows += attention_rows(ar, args.reps, pairs(args.attention))
    rows += paged_attention_rows(args.reps, pairs(args.paged_attention))
    if args.out:
        device = f"{len(jax.devices('gpu'))}x {jax.devices('gpu')[0].device_kind}"
        result_file.write_result(args.out, {**result_file.provenance(device, script=__file__), "rows": rows}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
