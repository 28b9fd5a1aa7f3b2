"""Batch-1 matrix products written as an explicit split over K, against XLA's own dot.

At decode batch sizes XLA runs the engine's products as split-K GEMMs and folds the sum of the partial
products into the elementwise kernel that consumes the product (rope, residual add). A custom kernel in
that place cannot take the sum, so it costs a separate reduce kernel. If the engine wrote the product
as a dot batched over K slices (float32 partial products), our kernels could sum the slices as they
load them. This measures what that form costs: per product, in one run,
  dot        x @ w, bf16 out (XLA's split-K GEMM and the kernel that sums its partials)
  dot+add    x @ w + r (XLA fuses the sum of the partials into the add)
  splitS     the partial products of S K-slices, float32 [S, m, n] (what a kernel would take)
  splitS+add their sum + r, in XLA
Each jitted program runs the product for `--layers` different weight matrices (more bytes than L2
holds); the figure is GPU kernel time per product from a profile of `--reps` calls (launch gaps, which
the decode step's command buffer mostly hides, are not counted).

    python benchmarks/split_product.py --out benchmarks/results/split-product-h200.json
"""

from __future__ import annotations

import argparse
import functools
import platform
import runpy
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
from switchyard.kernels import split_product

# (name, rows, K, N): Llama-3-8B's products whose sums XLA fuses into the next kernel, at TP=1 and 2.
SHAPES = [("o_proj tp1", 2, 4096, 4096), ("down tp1", 2, 14336, 4096), ("qkv tp1", 2, 4096, 6144),
          ("o_proj tp2", 2, 2048, 4096), ("down tp2", 2, 7168, 4096), ("qkv tp2", 2, 4096, 3072)]


def product(variant: str, x: jax.Array, w: jax.Array, r: jax.Array) -> jax.Array:
    if variant.startswith("dot"):
        y = x @ w
    else:
        parts = split_product(x, w, int(variant[5:].split("+")[0]))
        if not variant.endswith("+add"):
            return parts
        y = parts.sum(0).astype(x.dtype)
    return y + r if variant.endswith("+add") else y


def kernels_per_product(compiled_text: str, products: int) -> float:
    """Kernels (fusions and library calls) the optimised program launches per product."""
    entry = compiled_text[compiled_text.index("\nENTRY"):]
    launches = sum(" fusion(" in ln or "custom-call(" in ln for ln in entry.splitlines())
    return launches / products


def time_variant(variant: str, xs, ws, r, reps: int, trace_dir: str) -> tuple[float, float]:
    """GPU kernel time per product (from a profile of ``reps`` calls) and kernels per product."""
    fn = jax.jit(lambda xs, ws, r: [product(variant, x, w, r) for x, w in zip(xs, ws, strict=True)])
    kernels = kernels_per_product(fn.lower(xs, ws, r).compile().as_text(), len(ws))
    jax.block_until_ready(fn(xs, ws, r))

    def run() -> None:
        for _ in range(reps):
            jax.block_until_ready(fn(xs, ws, r))

    events, _ = decode_bench().trace_gpu(run, trace_dir)
    busy = sum(e.get("dur", 0) for e in events if not e["name"].startswith("Memcpy"))
    return busy / (reps * len(ws)), kernels


# benchmarks/decode.py (its profiler helper), loaded on first use.
decode_bench = functools.cache(lambda: SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("decode.py")))))
# benchmarks/result_file.py (provenance and writing), by its path: PYTHONSAFEPATH=1 keeps benchmarks/ off sys.path.
result_file = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("result_file.py"))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--splits", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--shapes", nargs="+", default=[name for name, *_ in SHAPES],
                        choices=[name for name, *_ in SHAPES], metavar="SHAPE", help="which products (default: all)")
    parser.add_argument("--out", help="result JSON path")
    args = parser.parse_args(argv)
    variants = ["dot", "dot+add"] + [f"split{s}{a}" for s in args.splits for a in ("", "+add")]
    key = jax.random.PRNGKey(0)
    rows = []
    for name, m, k, n in (shape for shape in SHAPES if shape[0] in args.shapes):
        xs = [jax.random.normal(jax.random.fold_in(key, i), (m, k), jnp.bfloat16) for i in range(args.layers)]
        ws = [jax.random.normal(jax.random.fold_in(key, 1000 + i), (k, n), jnp.bfloat16) * 0.02
              for i in range(args.layers)]
        r = jnp.ones((m, n), jnp.bfloat16)
        for variant in variants:
            us, kernels = time_variant(variant, xs, ws, r, args.reps, tempfile.mkdtemp(prefix="split-product-"))
            rate = k * n * 2 / us * 1e6 if us else 0.0  # 0: no GPU kernels in the trace (CPU)
            rows.append({"shape": name, "rows": m, "k": k, "n": n, "variant": variant, "us": round(us, 3),
                         "weight_bytes_per_s": round(rate), "kernels_per_product": kernels})
            print(f"{name:12s} {variant:12s} {us:8.2f} us  {rate / 1e12:5.2f} TB/s  {kernels:.1f} kernels", flush=True)
        del xs, ws
    result = {**result_file.provenance(f"{jax.device_count()}x {jax.devices()[0].device_kind}", argv, script=__file__),
              "jax": jax.__version__, "host": platform.node(), "rows": rows}
    if args.out:
        result_file.write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
