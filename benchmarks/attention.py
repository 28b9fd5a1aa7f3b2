"""Decode attention over a paged KV cache (block tables) against the contiguous cache, on one GPU.

For each (batch, context): every row attends over ``context`` cached positions plus its new token
(written at position ``context``, the usual decode step), Llama-3-8B's shard at TP=1 by default (32
query heads, 8 KV heads, head_dim 128, bf16). The contiguous caches are [batch, kv, M*B, D]; the
paged pools hold the same K/V cut into blocks of B positions, placed at a random permutation of the
pool's blocks (block 0 is the null block), so both kernels compute on the same values: their outputs
are compared (they should be bitwise equal) before anything is timed. With ``--fp8-pools`` the
paged pools are also rounded to FP8 (``kv_cache.Fp8Pool``: e4m3 and a float32 scale per position and
KV head) and the kernel's FP8 variant is timed beside the others (its output checked against the
16-bit pools' within the rounding).

Timing: one jitted function runs ``calls`` kernel launches one after another, cycling over enough
layers' caches that their K/V far exceed the L2 (as a decode step's 32 layers do), with the caches
donated; several such calls are queued back to back and timed on the host once the last is ready,
so dispatch overlaps the GPU's work. Repeats alternate the two layouts; the median per launch is
reported with the spread over repeats, and the K/V bytes read per launch over that time.

    python benchmarks/attention.py --out benchmarks/results/current/paged-attention-h200.json
    python benchmarks/attention.py --fp8-pools --out benchmarks/results/current/paged-attention-fp8-h200.json
"""

from __future__ import annotations

import argparse
import math
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
import numpy as np
from switchyard.kernels import attention, kv_cache, native
from switchyard.kernels.fp8 import quantize_rows

# benchmarks/result_file.py (provenance and writing), by its path: PYTHONSAFEPATH=1 keeps benchmarks/ off sys.path.
result_file = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("result_file.py"))))

ROTATE_BYTES = 1 << 30  # K/V cycled through per layout: many times the L2 (50-60 MB on H100/H200)
MAX_LAYERS = 32


def shapes(batches: list[int], contexts: list[int], long_batches: list[int], long_contexts: list[int]):
    return [(b, c) for c in contexts for b in batches] + [(b, c) for c in long_contexts for b in long_batches]


def plan(batch: int, context: int, kv: int, d: int, block: int, itemsize: int, min_calls: int) -> dict[str, int]:
    """Table entries per row, layers cycled through and launches per jitted call."""
    m = math.ceil((context + 1) / block)
    layer_bytes = 2 * batch * m * block * kv * d * itemsize
    layers = max(2, min(MAX_LAYERS, math.ceil(ROTATE_BYTES / layer_bytes)))
    calls = layers * max(1, math.ceil(min_calls / layers))
    return {"m": m, "layers": layers, "calls": calls}


def make_layers(key, batch: int, kv: int, d: int, block: int, m: int, layers: int, dtype, shuffled: bool):
    """Per layer a contiguous cache pair and the same K/V as pools; the block tables (the pool's
    blocks in a random permutation, or in order when not ``shuffled``)."""
    rng = np.random.default_rng(batch * 1_000_003 + m)
    num_blocks = 1 + batch * m
    order = rng.permutation(batch * m) if shuffled else np.arange(batch * m)
    tables = jnp.asarray((1 + order).reshape(batch, m), jnp.int32)

    @jax.jit
    def layer(key):
        kk, kv_ = jax.random.split(key)
        caches = [jax.random.normal(k, (batch, kv, m * block, d), dtype) for k in (kk, kv_)]

        def to_pool(cache):
            blocks = cache.reshape(batch, kv, m, block, d).transpose(0, 2, 1, 3, 4).reshape(batch * m, kv, block, d)
            return jnp.zeros((num_blocks, kv, block, d), dtype).at[tables.reshape(-1)].set(blocks)

        return caches, [to_pool(c) for c in caches]

    contiguous, paged = [], []
    for layer_key in jax.random.split(key, layers):
        caches, pools = layer(layer_key)
        contiguous.append(caches)
        paged.append(pools)
    return contiguous, paged, tables


@jax.jit
def to_fp8(pool: jax.Array) -> kv_cache.Fp8Pool:
    """A 16-bit pool as kv_cache's FP8 pool holds it."""
    q, scale = quantize_rows(pool)
    return kv_cache.Fp8Pool(q, scale[..., 0])


def chain(kind: str, calls: int, layers: int):
    """jit: ``calls`` launches over the layers' caches in turn (donated); the last output and the caches."""

    def run(qkv, ks, vs, tables, positions):
        ks, vs = list(ks), list(vs)
        out = None
        for i in range(calls):
            j = i % layers
            if kind.startswith("paged"):
                out, ks[j], vs[j] = attention.paged_decode_attention_packed(qkv, ks[j], vs[j], tables, positions,
                                                                             positions)
            else:
                out, ks[j], vs[j] = attention.decode_attention_packed(qkv, ks[j], vs[j], positions, positions)
        return out, ks, vs

    return jax.jit(run, donate_argnums=(1, 2))


def time_chain(fn, state: dict, queued: int) -> float:
    """Seconds for ``queued`` calls of ``fn`` dispatched back to back (each consumes the last's caches)."""
    jax.block_until_ready(state["ks"])
    t0 = time.perf_counter()
    for _ in range(queued):
        out, state["ks"], state["vs"] = fn(state["qkv"], state["ks"], state["vs"], state["tables"], state["positions"])
    jax.block_until_ready(out)
    return time.perf_counter() - t0


def measure(args: argparse.Namespace, batch: int, context: int) -> dict:
    dtype = jnp.bfloat16
    kv, group, d, block = args.kv_heads, args.q_heads // args.kv_heads, args.head_dim, args.block_size
    p = plan(batch, context, kv, d, block, jnp.dtype(dtype).itemsize, args.min_calls)
    key = jax.random.PRNGKey(batch * 7919 + context)
    contiguous, paged, tables = make_layers(key, batch, kv, d, block, p["m"], p["layers"], dtype,
                                            args.tables == "shuffled")
    qkv = jax.random.normal(jax.random.fold_in(key, 1), (batch, kv * group + 2 * kv, d), dtype)
    positions = jnp.full((batch,), context, jnp.int32)
    states = {
        "contiguous": {"qkv": qkv, "ks": [c[0] for c in contiguous], "vs": [c[1] for c in contiguous],
                       "tables": tables, "positions": positions},
        "paged": {"qkv": qkv, "ks": [c[0] for c in paged], "vs": [c[1] for c in paged], "tables": tables,
                  "positions": positions},
    }
    if args.fp8_pools:
        states["paged_fp8"] = {**states["paged"], "ks": [to_fp8(c[0]) for c in paged],
                               "vs": [to_fp8(c[1]) for c in paged]}
    del contiguous, paged
    # Same values, same split of the sequence: the two kernels must agree exactly on one launch.
    first = {kind: chain(kind, 1, 1) for kind in states}
    outs = {}
    for kind, st in states.items():
        out, ks, vs = first[kind](st["qkv"], st["ks"][:1], st["vs"][:1], st["tables"], st["positions"])
        st["ks"][0], st["vs"][0] = ks[0], vs[0]
        outs[kind] = np.asarray(out.astype(jnp.float32))
    max_diff = float(np.max(np.abs(outs["paged"] - outs["contiguous"])))
    if not np.isfinite(outs["paged"]).all() or max_diff > 0.05:
        raise SystemExit(f"batch {batch} context {context}: paged and contiguous outputs differ by {max_diff}")
    fp8_err = None
    if args.fp8_pools:  # a sanity bound: the rounding of K/V to e4m3 moves the output by 1-12% (long contexts most)
        fp8_err = float(np.linalg.norm(outs["paged_fp8"] - outs["paged"]) / np.linalg.norm(outs["paged"]))
        if not np.isfinite(outs["paged_fp8"]).all() or fp8_err > 0.25:
            raise SystemExit(f"batch {batch} context {context}: FP8 pools' output off the 16-bit one by {fp8_err}")
    fns = {kind: chain(kind, p["calls"], p["layers"]) for kind in states}
    for kind, fn in fns.items():
        time_chain(fn, states[kind], 2)  # compile and warm up
    per_launch: dict[str, list[float]] = {kind: [] for kind in states}
    for _ in range(args.repeats):
        for kind, fn in fns.items():
            per_launch[kind].append(time_chain(fn, states[kind], args.queued) / (args.queued * p["calls"]))
    kv_bytes = 2 * batch * (context + 1) * kv * d * jnp.dtype(dtype).itemsize
    row = {"batch": batch, "context": context, "block_size": block, "tables": args.tables, "table_entries": p["m"],
           "layers": p["layers"],
           "launches_per_call": p["calls"], "queued_calls": args.queued, "repeats": args.repeats,
           "splits": attention.splits_for(batch, kv, p["m"] * block), "max_abs_diff": max_diff,
           "kv_bytes_per_launch": kv_bytes}
    for kind, times in per_launch.items():
        us = 1e6 * statistics.median(times)
        row[f"{kind}_us"] = round(us, 3)
        row[f"{kind}_us_min_max"] = [round(1e6 * min(times), 3), round(1e6 * max(times), 3)]
        row[f"{kind}_tb_per_s"] = round(kv_bytes / us / 1e6, 3)
    row["paged_over_contiguous"] = round(row["paged_us"] / row["contiguous_us"], 4)
    if args.fp8_pools:
        fp8_bytes = 2 * batch * (context + 1) * kv * (d + kv_cache.FP8_SCALE_BYTES)
        row.update(fp8_splits=attention.splits_for(batch, kv, p["m"] * block, fp8_pools=True),
                   fp8_kv_bytes_per_launch=fp8_bytes, fp8_rel_err_vs_paged=round(fp8_err, 5),
                   paged_fp8_tb_per_s=round(fp8_bytes / row["paged_fp8_us"] / 1e6, 3),
                   paged_fp8_over_paged=round(row["paged_fp8_us"] / row["paged_us"], 4))
    del states, fns, first
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--long-batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--long-context", type=int, nargs="*", default=[32768])
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--tables", choices=["shuffled", "sequential"], default="shuffled",
                        help="the pool's blocks handed out in a random permutation, or in order")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--min-calls", type=int, default=128, help="kernel launches per jitted call (at least)")
    parser.add_argument("--queued", type=int, default=8, help="jitted calls queued back to back per timing")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--fp8-pools", action="store_true", help="also time the kernel on the pools rounded to FP8")
    parser.add_argument("--out", help="result JSON path")
    args = parser.parse_args(argv)
    if not native.attention_ready():
        raise SystemExit(f"decode-attention kernels unavailable: {native.status()}")
    group = args.q_heads // args.kv_heads
    if not attention.paged_kernel_supports(jnp.bfloat16, args.head_dim, group, args.block_size):
        raise SystemExit("the kernel does not support this head_dim, GQA group or block size")
    device = jax.devices()[0]
    rows = []
    header = (f"{'batch':>5} {'context':>7} {'contig us':>10} {'paged us':>10} {'paged/contig':>12} {'paged TB/s':>10}"
              + (f" {'fp8 us':>8} {'fp8/paged':>9}" if args.fp8_pools else ""))
    print(header, flush=True)
    for batch, context in shapes(args.batch, args.context, args.long_batch, args.long_context):
        row = measure(args, batch, context)
        rows.append(row)
        print(f"{batch:>5} {context:>7} {row['contiguous_us']:>10.2f} {row['paged_us']:>10.2f} "
              f"{row['paged_over_contiguous']:>12.3f} {row['paged_tb_per_s']:>10.2f}"
              + (f" {row['paged_fp8_us']:>8.2f} {row['paged_fp8_over_paged']:>9.3f}" if args.fp8_pools else "")
              + "   "
              f"(spread contig {row['contiguous_us_min_max']}, paged {row['paged_us_min_max']})", flush=True)
    result = {
        **result_file.provenance(f"{jax.device_count()}x {device.device_kind}", argv, script=__file__),
        "jax": jax.__version__,
        "host": platform.node(),
        "shape": {"q_heads": args.q_heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": "bfloat16",
                  "block_size": args.block_size, "tables": args.tables},
        "rows": rows,
    }
    if args.out:
        result_file.write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
