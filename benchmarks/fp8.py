"""FP8 on the GPU, checked and timed: the layer products and the decode attention over an FP8 KV pool.

Products (Llama shapes, ``--model``'s at TP=1): for each matrix [K, N] and each count of activation
rows, the bf16 product, the FP8 weight-only product (W8A16: the e4m3 weight converted inside the
product, a scale per output channel; and with 128-wide block scales) and FP8 x FP8 (W8A8: the
activation quantized per token, XLA's FP8 GEMM writing the activation's dtype, then both scales).
Each is checked against a float32 product of the same dequantized weight (W8A16 to 2% of the largest
output, bf16's own rounding; W8A8 a cosine of 0.999 per row) and timed over ``--layers`` distinct
weights in one program (more bytes than the L2 cache holds, so each product reads its weight from
HBM; each weight a buffer of its own, as a model's are: timed over slices of one stacked array,
XLA's FP8 gate_up product took 129 µs, where a decode step's profile shows 34 µs), as µs per
product, TFLOP/s and the weight bytes' rate against the copy bandwidth. With ``--splits S ...`` the
weight-only product is also timed as ``Fp8Weight.split_product`` over S slices of K, summed
(``w8a16-split-S``): at a few rows, a product whose N gives too few output tiles to fill the GPU gets
S times the tiles. The compiled program says
whether XLA ran the FP8 GEMM (``cublas$lt$matmul$f8``). The rows where W8A8 starts to beat W8A16 on
every shape are what ``engine.DEFAULT_W8A8_MIN_ROWS`` should be.

KV: ``paged_decode_attention_packed`` over an FP8 pool (e4m3 with a scale per position and head; XLA's
ops, which dequantize as they gather) against the bf16 pool (our CUDA kernel, and XLA's ops), at the
same K/V values: checked (2% of the largest output) and timed over ``--layers`` layers' pools.

    python3 -m switchyard.kernels.build && python benchmarks/fp8.py --model llama3-8b \\
        --out benchmarks/results/current/fp8-h100.json

Exits 1 when a check fails. Engine-level FP8 (ms/token, the roofline in FP8 bytes) is
``benchmarks/decode.py --weights bf16 fp8 fp8-w8a16 fp8-w8a8 --kv-cache auto fp8``.
"""

from __future__ import annotations

import argparse
import platform
import runpy
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from switchyard.kernels import attention, kv_cache
from switchyard.kernels.weights import Fp8Weight
from switchyard.service.modelspec import preset

# benchmarks/result_file.py (provenance and writing), by its path: PYTHONSAFEPATH=1 keeps benchmarks/ off sys.path.
result_file = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("result_file.py"))))

ROWS = (1, 8, 32, 64, 128, 256, 512, 1024, 4096)
W8A16_BAR = 0.02  # of the largest output: bf16 operands and output round to 2^-9, summed over K
COSINE_BAR = 0.999
ATTENTION_BAR = 0.02


def timed(fn: Any, *args: Any, repeats: int) -> float:
    """Median seconds of ``fn(*args)`` (compiled first), each call waited for."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def copy_bandwidth(gib: float = 2.0) -> float:
    """Bytes per second of a large device copy (read + written)."""
    x = jnp.ones(int(gib * (1 << 30)) // 4, jnp.float32)
    copy = jax.jit(lambda a: a + 0)
    return 2 * x.nbytes / timed(copy, x, repeats=10)


def layer_matrices(model: str) -> dict[str, tuple[int, int]]:
    """The preset's four layer matrices at TP=1, each as [K, N]."""
    spec = preset(model)
    return {"qkv": (spec.hidden_size, spec.q_size + 2 * spec.kv_size), "o": (spec.q_size, spec.hidden_size),
            "gate_up": (spec.hidden_size, 2 * spec.intermediate_size),
            "down": (spec.intermediate_size, spec.hidden_size)}


def layer_weights(key: jax.Array, layers: int, k: int, n: int,
                  block_k: int) -> tuple[list[jax.Array], list[Fp8Weight]]:
    """``layers`` random bf16 matrices [K, N] and the same as FP8 weights (a scale per output channel,
    or per output channel and ``block_k`` input features), made on the device."""
    dense = (jax.random.normal(key, (layers, k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
    groups = -(-k // block_k) if block_k else 1
    width = block_k or k

    @jax.jit
    def quantize(w: jax.Array) -> tuple[jax.Array, jax.Array]:
        padded = jnp.pad(w.T.astype(jnp.float32), ((0, 0), (0, groups * width - k))).reshape(n, groups, width)
        scale = jnp.maximum(jnp.abs(padded).max(-1) / 448.0, 1e-12)
        q = (padded / scale[..., None]).reshape(n, -1)[:, :k].astype(jnp.float8_e4m3fn)
        return q, scale

    return list(dense), [Fp8Weight(*quantize(w), block_k) for w in dense]


SPLIT_KIND = "w8a16-split-"


def product(kind: str, x: jax.Array, weight: Any) -> jax.Array:
    """``x`` times ``weight`` as ``kind`` runs it, in ``x``'s dtype (``w8a16-split-S``: the sum of
    S partial products over slices of K)."""
    if kind.startswith(SPLIT_KIND):
        return weight.split_product(x, int(kind[len(SPLIT_KIND):])).sum(0).astype(x.dtype)
    return x @ weight


def product_program(kind: str, block_k: int, min_rows: int) -> Any:
    """One program: the activation times every weight in turn, the outputs summed so that none is
    dropped."""
    def run(x: jax.Array, weights: list[Any]) -> jax.Array:
        total = None
        for w in weights:
            weight = w if kind == "bf16" else Fp8Weight(w.w, w.scale, block_k, min_rows)
            y = product(kind, x, weight).astype(jnp.float32)
            total = y if total is None else total + y
        return total

    return jax.jit(run)


def check_product(kind: str, x: jax.Array, weight: Fp8Weight, got: jax.Array) -> dict[str, float]:
    """``got`` (x times the weight, bf16) against float32 over the same dequantized weight."""
    exact = jnp.dot(x.astype(jnp.float32), weight.dequantized(jnp.float32).T, precision=jax.lax.Precision.HIGHEST)
    got32 = got.astype(jnp.float32)
    rel = float(jnp.abs(got32 - exact).max() / jnp.abs(exact).max())
    norms = jnp.linalg.norm(got32, axis=-1) * jnp.linalg.norm(exact, axis=-1)
    cos = float((jnp.sum(got32 * exact, -1) / norms).min())
    ok = cos >= COSINE_BAR if kind.startswith("w8a8") else rel <= W8A16_BAR
    return {"max_error_of_largest": round(rel, 6), "min_cosine": round(cos, 6), "ok": bool(ok)}


def products(args: argparse.Namespace, bandwidth: float) -> tuple[list[dict], bool]:
    rows_out, all_ok = [], True
    key = jax.random.PRNGKey(0)
    for name, (k, n) in layer_matrices(args.model).items():
        for block_k in (0, 128):
            dense, fp8 = layer_weights(key, args.layers, k, n, block_k)
            for rows in args.rows:
                x = (jax.random.normal(jax.random.fold_in(key, rows), (rows, k), jnp.float32)).astype(jnp.bfloat16)
                kinds = {"w8a16": (fp8, 0)} if block_k else {"bf16": (dense, 0), "w8a16": (fp8, 0), "w8a8": (fp8, 1)}
                if not block_k:
                    kinds.update({f"{SPLIT_KIND}{s}": (fp8, 0) for s in args.splits if k % s == 0})
                for kind, (weights, min_rows) in kinds.items():
                    program = product_program(kind, block_k, min_rows)
                    seconds = timed(program, x, weights, repeats=args.repeats) / args.layers
                    text = program.lower(x, weights).compile().as_text()
                    wbytes = (k * n * 2) if kind == "bf16" else (k * n + 4 * n * (-(-k // block_k) if block_k else 1))
                    row = {"matrix": name, "k": k, "n": n, "rows": rows, "kind": kind, "block_k": block_k,
                           "us_per_product": round(seconds * 1e6, 2),
                           "tflops": float(f"{2 * rows * k * n / seconds / 1e12:.3g}"),
                           "weight_bytes_per_s": round(wbytes / seconds),
                           "fraction_of_copy_bandwidth": round(wbytes / seconds / bandwidth, 3),
                           "fp8_gemm": "$f8" in text}
                    if kind != "bf16":
                        single = Fp8Weight(weights[0].w, weights[0].scale, block_k, min_rows)
                        got = jax.jit(lambda a, w, kind=kind: product(kind, a, w))(x, single)
                        row.update(check_product(kind, x, single, got))
                        all_ok &= row["ok"]
                    rows_out.append(row)
                    print(f"{name:8s} [{k}x{n}] rows {rows:5d} {kind:15s} block {block_k:3d} "
                          f"{row['us_per_product']:9.2f} us {row['tflops']:7.1f} TFLOP/s "
                          f"{row['fraction_of_copy_bandwidth']:6.1%} of copy bw"
                          + (f"  check {'ok' if row.get('ok') else 'FAILED'} (err {row.get('max_error_of_largest')}, "
                             f"cos {row.get('min_cosine')})" if kind != "bf16" else "")
                          + ("  [FP8 GEMM]" if row["fp8_gemm"] else ""), flush=True)
    return rows_out, all_ok


def w8a8_crossover(rows: list[dict]) -> int | None:
    """The fewest activation rows from which FP8 x FP8 is faster than weight-only on every matrix at
    every larger count measured (None: never)."""
    def w8a8_faster(count: int) -> bool:
        times = {(r["matrix"], r["kind"]): r["us_per_product"] for r in rows
                 if r["rows"] == count and r["block_k"] == 0}
        return all(times[m, "w8a8"] < times[m, "w8a16"] for m, kind in times if kind == "w8a16")

    counts = sorted({r["rows"] for r in rows})
    faster = [w8a8_faster(c) for c in counts]
    for i, count in enumerate(counts):
        if all(faster[i:]):
            return count
    return None


def attention_program(layers: int, use_kernel: bool) -> Any:
    """One program: decode attention over the same pools ``layers`` times (a scan), outputs summed."""
    def run(qkv, k, v, tables, positions, write_at):
        def body(acc, _):
            out, _, _ = attention.paged_decode_attention_packed(qkv, k, v, tables, positions, write_at,
                                                                use_kernel=use_kernel)
            return acc + out.astype(jnp.float32), None

        return jax.lax.scan(body, jnp.zeros((*qkv.shape[:1], qkv.shape[1] - 2 * k.shape[1], qkv.shape[2]),
                                            jnp.float32), None, length=layers)[0]

    return jax.jit(run)


def kv_attention(args: argparse.Namespace) -> tuple[list[dict], bool]:
    spec = preset(args.model)
    kv, heads, d, bs = spec.num_kv_heads, spec.num_heads, spec.head_dim, 64
    out_rows, all_ok = [], True
    for context in args.context:
        for batch in args.batch:
            m = -(-context // bs)
            blocks = batch * m + 1
            key = jax.random.PRNGKey(context * 1000 + batch)
            dense = [jax.random.normal(jax.random.fold_in(key, i), (blocks, kv, bs, d), jnp.float32)
                     for i in range(2)]
            fp8 = [kv_cache.write(kv_cache.zeros(p.shape, "fp8", jnp.bfloat16), (slice(None),), p) for p in dense]
            # The bf16 pools hold the FP8 pools' values, so the outputs differ by arithmetic alone.
            as_bf16 = [kv_cache.read(p, (slice(None),), jnp.bfloat16) for p in fp8]
            qkv = jax.random.normal(jax.random.fold_in(key, 9), (batch, heads + 2 * kv, d), jnp.bfloat16)
            tables = (1 + jnp.arange(batch * m, dtype=jnp.int32)).reshape(batch, m)
            positions = jnp.full((batch,), context - 1, jnp.int32)
            write_at = jnp.full((batch,), -1, jnp.int32)  # nothing written: every layer reads the same pool

            results = {}
            for name, (k, v, use_kernel) in {"bf16-kernel": (*as_bf16, True), "bf16-xla": (*as_bf16, False),
                                             "fp8-xla": (*fp8, True)}.items():
                fn = attention_program(args.layers, use_kernel)
                call = (qkv, k, v, tables, positions, write_at)
                seconds = timed(fn, *call, repeats=args.repeats) / args.layers
                results[name] = (seconds, fn(*call) / args.layers)
            ref = results["bf16-kernel"][1]
            for name, (seconds, out) in results.items():
                rel = float(jnp.abs(out - ref).max() / jnp.abs(ref).max())
                ok = rel <= ATTENTION_BAR
                all_ok &= ok
                kv_bytes = 2 * batch * context * kv * (d + 4 if name.startswith("fp8") else 2 * d)
                row = {"batch": batch, "context": context, "pool": name, "us_per_layer": round(seconds * 1e6, 2),
                       "kv_bytes_per_s": round(kv_bytes / seconds), "error_of_largest": round(rel, 6), "ok": ok,
                       "vs_bf16_kernel": round(seconds / results["bf16-kernel"][0], 3)}
                out_rows.append(row)
                print(f"attention batch {batch:3d} ctx {context:5d} {name:12s} {row['us_per_layer']:9.2f} us/layer "
                      f"x{row['vs_bf16_kernel']:.2f} of the bf16 kernel  check {'ok' if ok else 'FAILED'} ({rel:.2e})",
                      flush=True)
    return out_rows, all_ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--layers", type=int, default=8, help="distinct weights (pools) per timed program")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--splits", type=int, nargs="*", default=[],
                        help="also time the weight-only product split over this many slices of K")
    parser.add_argument("--skip", nargs="*", default=[], choices=["products", "kv"])
    parser.add_argument("--out", help="result JSON path")
    args = parser.parse_args(argv)

    device = jax.devices()[0]
    bandwidth = copy_bandwidth() if device.platform == "gpu" else 1e11
    print(f"{device.device_kind}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    result: dict[str, Any] = {
        **result_file.provenance(f"{jax.device_count()}x {device.device_kind}", argv, script=__file__),
        "jax": jax.__version__, "host": platform.node(),
        "copy_bandwidth_bytes_per_s": round(bandwidth),
    }
    ok = True
    if "products" not in args.skip:
        result["products"], products_ok = products(args, bandwidth)
        result["w8a8_crossover_rows"] = w8a8_crossover(result["products"])
        print(f"FP8 x FP8 beats weight-only on every matrix from {result['w8a8_crossover_rows']} rows", flush=True)
        ok &= products_ok
    if "kv" not in args.skip:
        result["kv_attention"], kv_ok = kv_attention(args)
        spec = preset(args.model)
        ratio = spec.kv_bytes_per_token_per_gpu(1, 1) / spec.kv_bytes_per_token_per_gpu(1, 1, "fp8")
        result["kv_tokens_fp8_over_bf16"] = round(ratio, 3)
        print(f"an FP8 pool holds {ratio:.2f}x the tokens of a bf16 one in the same memory", flush=True)
        ok &= kv_ok
    return result_file.finish_checked(result, args.out, ok)


if __name__ == "__main__":
    sys.exit(main())
