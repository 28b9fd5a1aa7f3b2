#!/usr/bin/env python3
"""The sampling tail of a step, by part, on one device: what picking a token costs per row count.

For each ``--batch`` (rows of logits over ``--vocab`` columns, float32): the engine's sampler
(``sampling.sample_sharded`` over a one-device mesh) greedy-only and sampling (top-k 50, top-p 0.9,
temperature 0.8), and its candidate search alone: ``jax.lax.top_k`` of the sampler's 1024 candidates
over every column beside ``top_k_by_groups``, which the sampler runs, each checked equal to the other
(values and indices) on bf16-rounded logits, whose ties are many. ms per call, the median of
``--repeats`` timings of ``--calls`` calls each.

    python benchmarks/sampling.py --batch 1 8 64 --out benchmarks/results/archive/sampling-h100.json
"""

from __future__ import annotations

import argparse
import os
import runpy
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

# benchmarks/result_file.py (provenance and writing), by its path: PYTHONSAFEPATH=1 keeps benchmarks/ off sys.path.
result_file = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("result_file.py"))))

LLAMA3_VOCAB = 128256


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=LLAMA3_VOCAB)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="host devices (JAX_PLATFORMS=cpu): a smoke test")
    parser.add_argument("--out", help="result JSON path")
    args = parser.parse_args(argv)
    if args.vocab < 2 or min(args.batch) < 1 or args.calls < 1 or args.repeats < 1:
        parser.error("--vocab must be at least 2, and --batch, --calls and --repeats at least 1")
    return args


def timed_ms(fn, args: tuple, calls: int, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compiles
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / calls * 1e3)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P
    from switchyard.service.engine.sampling import MAX_TOP_K, sample_sharded, top_k_by_groups

    mesh = Mesh(np.array(jax.devices()[:1]), ("vocab",))
    k = min(MAX_TOP_K, args.vocab)

    def sampler(greedy_only: bool):
        def body(logits, temperature, top_k, top_p, seeds, counters):
            return sample_sharded(logits, args.vocab, "vocab", greedy_only=greedy_only, temperature=temperature,
                                  top_k=top_k, top_p=top_p, seeds=seeds, counters=counters)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(None, "vocab"),) + (P(),) * 5, out_specs=P(),
                                     check_vma=False))

    greedy, sampled = sampler(True), sampler(False)
    full_top_k = jax.jit(lambda x: jax.lax.top_k(x, k))
    grouped_top_k = jax.jit(lambda x: top_k_by_groups(x, k))
    rows = []
    for batch in args.batch:
        logits = jax.random.normal(jax.random.PRNGKey(batch), (batch, args.vocab), jnp.float32) * 3
        request = (jnp.full((batch,), 0.8, jnp.float32), jnp.full((batch,), 50, jnp.int32),
                   jnp.full((batch,), 0.9, jnp.float32), jnp.arange(batch, dtype=jnp.int32),
                   jnp.zeros((batch,), jnp.int32))
        tied = jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32)
        (gv, gi), (fv, fi) = grouped_top_k(tied), full_top_k(tied)
        equal = bool(jnp.array_equal(gv, fv)) and bool(jnp.array_equal(gi, fi))
        row = {"batch": batch, "vocab": args.vocab, "candidates": k,
               "greedy_ms": timed_ms(greedy, (logits, *request), args.calls, args.repeats),
               "sampled_ms": timed_ms(sampled, (logits, *request), args.calls, args.repeats),
               "lax_top_k_ms": timed_ms(full_top_k, (logits,), args.calls, args.repeats),
               "top_k_by_groups_ms": timed_ms(grouped_top_k, (logits,), args.calls, args.repeats),
               "top_k_by_groups_equals_lax_top_k": equal}
        row = {name: round(v, 4) if isinstance(v, float) else v for name, v in row.items()}
        rows.append(row)
        print(f"batch {batch:4d}: greedy {row['greedy_ms']:.3f} ms, sampled {row['sampled_ms']:.3f} ms; top-{k} "
              f"over every column {row['lax_top_k_ms']:.3f} ms, by groups {row['top_k_by_groups_ms']:.3f} ms "
              f"({'equal' if equal else 'NOT EQUAL'})", flush=True)
    result = {
        **result_file.provenance(f"1x {jax.devices()[0].device_kind}", argv, script=__file__),
        "jax": jax.__version__,
        "rows": rows,
    }
    if args.out:
        result_file.write_result(args.out, result)
        print(f"wrote {args.out}", flush=True)
    return 0 if all(r["top_k_by_groups_equals_lax_top_k"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
