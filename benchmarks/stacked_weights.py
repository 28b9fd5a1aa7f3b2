#!/usr/bin/env python3
"""Layer products over weights held as a buffer each, or as slices of one stacked array: does XLA's
product read a layer's slice in place, or copy it first?

At TP>1 the host sets a decode step, and about 0.75 µs of its launch per argument per GPU
(benchmarks/NOTES.md, 2026-11-27): the ~300 weight arrays of an 8B step, stacked into one array per
kind of matrix ([layers, ...]), would be ~10 arguments. That pays only if the products read their
layer's slice of a stacked array as fast as a buffer of their own. This times, for ``--model``'s four
layer matrices at a few activation rows, the bf16 product and the FP8 weight-only product (as
``Fp8Weight`` runs it) over ``--layers`` weights held three ways:

- ``buffers``: one array per layer (as the engine holds its weights);
- ``slices``: one stacked array, each layer's matrix a static slice of it (the layers unrolled);
- ``scan``: one stacked array, ``lax.scan`` over the layers (a dynamic slice per iteration);

as µs per product, with the compiled program's instructions that materialise a whole weight
matrix outside the products (``weight_copies``: a slice copied, or converted, before its product
reads it; one in a loop body runs once per layer; on a CPU, whose dots take float32, every layout
converts each weight). Each layout's
sum is checked against the ``buffers`` one. Exits 1 when a check fails.

    python benchmarks/stacked_weights.py --model llama3-8b --out benchmarks/results/archive/stacked-weights-h200.json
"""

from __future__ import annotations

import argparse
import platform
import re
import runpy
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from switchyard.kernels.weights import Fp8Weight

# benchmarks/result_file.py (provenance and writing), by its path: PYTHONSAFEPATH=1 keeps benchmarks/ off sys.path.
result_file = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("result_file.py"))))
fp8_bench = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("fp8.py"))))

LAYOUTS = ("buffers", "slices", "scan")
KINDS = ("bf16", "w8a16")
AGREE = 1e-2  # of the largest output: the same products in another order, rounded to bf16 per layer


def stacked(kind: str, dense: list[jax.Array], fp8: list[Fp8Weight]) -> Any:
    """The layers' weights as one stacked array ([layers, K, N]; FP8: e4m3 [layers, N, K] and scales)."""
    if kind == "bf16":
        return jnp.stack(dense)
    return Fp8Weight(jnp.stack([w.w for w in fp8]), jnp.stack([w.scale for w in fp8]))


def weight_only(kind: str, w: Any) -> Any:
    """A layer's weight as the product takes it: the bf16 matrix, or the FP8 weight's weight-only product."""
    return w if kind == "bf16" else Fp8Weight(w.w, w.scale, 0, 0)


def program(layout: str, kind: str, layers: int) -> Any:
    """jit: the activation times every layer's weight, the float32 products summed (none dropped)."""
    def product(x: jax.Array, w: Any) -> jax.Array:
        return (x @ weight_only(kind, w)).astype(jnp.float32)

    def buffers(x: jax.Array, weights: list[Any]) -> jax.Array:
        total = product(x, weights[0])
        for w in weights[1:]:
            total = total + product(x, w)
        return total

    def slices(x: jax.Array, weights: Any) -> jax.Array:
        return buffers(x, [jax.tree.map(lambda a, i=i: a[i], weights) for i in range(layers)])

    def scan(x: jax.Array, weights: Any) -> jax.Array:
        def body(total: jax.Array, w: Any) -> tuple[jax.Array, None]:
            return total + product(x, w), None

        n = weights.shape[-1] if kind == "bf16" else weights.w.shape[-2]
        return jax.lax.scan(body, jnp.zeros((x.shape[0], n), jnp.float32), weights)[0]

    return jax.jit({"buffers": buffers, "slices": slices, "scan": scan}[layout])


def weight_copies(text: str, k: int, n: int) -> int:
    """Instructions of the compiled program, outside fusion bodies (the entry and loop bodies), whose
    result is one whole weight matrix ([K, N] or [N, K], of any element type) and that are not
    parameters or views: a layer's slice copied (or converted) before its product reads it."""
    fused = set(re.findall(r"calls=(%[\w.\-]+)", text))
    shapes = {f"{k},{n}", f"{n},{k}", f"1,{k},{n}", f"1,{n},{k}"}
    count, skip = 0, False
    for line in text.splitlines():
        head = re.match(r"(?:ENTRY\s+)?(%[\w.\-]+)\s*\(.*\{\s*$", line)
        if head:
            skip = head.group(1) in fused
            continue
        m = re.match(r"\s*(?:ROOT\s+)?%[\w.\-]+\s*=\s*\w+\[([\d,]*)\]\S*\s+([\w\-]+)", line)
        if (not skip and m and m.group(1) in shapes
                and m.group(2) not in ("parameter", "bitcast", "get-tuple-element", "tuple")):
            count += 1
    return count


def measure(args: argparse.Namespace) -> tuple[list[dict], bool]:
    rows_out, ok = [], True
    key = jax.random.PRNGKey(0)
    for name, (k, n) in fp8_bench.layer_matrices(args.model).items():
        dense, fp8 = fp8_bench.layer_weights(key, args.layers, k, n, 0)
        for kind in KINDS:
            held = {"buffers": dense if kind == "bf16" else fp8}
            held["slices"] = held["scan"] = stacked(kind, dense, fp8)
            for rows in args.rows:
                x = jax.random.normal(jax.random.fold_in(key, rows), (rows, k), jnp.float32).astype(jnp.bfloat16)
                reference = None
                for layout in LAYOUTS:
                    fn = program(layout, kind, args.layers)
                    got = np.asarray(fn(x, held[layout]), np.float64)
                    reference = got if reference is None else reference
                    error = float(np.abs(got - reference).max() / max(np.abs(reference).max(), 1e-30))
                    seconds = fp8_bench.timed(fn, x, held[layout], repeats=args.repeats) / args.layers
                    text = fn.lower(x, held[layout]).compile().as_text()
                    row = {"matrix": name, "k": k, "n": n, "kind": kind, "rows": rows, "layout": layout,
                           "us_per_product": round(seconds * 1e6, 2),
                           "weight_copies": weight_copies(text, k, n),
                           "error_of_largest_vs_buffers": round(error, 6), "ok": error <= AGREE}
                    ok &= row["ok"]
                    rows_out.append(row)
                    print(f"{name:8s} {kind:6s} rows {rows:2d} {layout:8s} {row['us_per_product']:9.2f} µs"
                          f"  copies {row['weight_copies']:2d}  {'ok' if row['ok'] else 'MISMATCH'}", flush=True)
    return rows_out, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8])
    parser.add_argument("--layers", type=int, default=8, help="weights per timed program (more than L2 holds)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", help="result JSON path")
    args = parser.parse_args(argv)
    if args.layers < 2 or args.repeats < 1 or min(args.rows) < 1:
        parser.error("--layers must be at least 2, --repeats and --rows at least 1")
    device = jax.devices()[0]
    result: dict[str, Any] = {
        **result_file.provenance(f"{jax.device_count()}x {device.device_kind}", argv, script=__file__),
        "jax": jax.__version__, "host": platform.node(), "model": args.model, "layers": args.layers,
    }
    result["products"], ok = measure(args)
    return result_file.finish_checked(result, args.out, ok, "CHECKS FAILED: a layout's sum disagrees with the buffers'")


if __name__ == "__main__":
    sys.exit(main())
