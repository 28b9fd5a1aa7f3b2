#!/usr/bin/env python3
"""What the host spends launching one XLA program on 1..N GPUs of one process, by the program's
argument count, its kernel count and the scheduling of its command buffer.

A decode step of the engine at TP>1 is set by the host (benchmarks/NOTES.md): one process launches
every GPU's share. This times the two things a step's launch scales with, on a program that does
almost nothing: ``--args`` arrays sharded over the GPUs (a step's weights are ~300 arguments), and
a chain of ``--kernels`` elementwise kernels (a step is ~300 kernels per GPU, one CUDA graph each),
under XLA's command-buffer scheduling modes (``--modes``: ``default``, ``SERIALIZE``, ``CONCURRENT``,
``LHS``). Each figure is the median (and 90th percentile) host time of ``--calls`` launches, each
waited for before the next, so that no launch queues behind another.

    python benchmarks/launch.py --gpus 1 2 4 --out benchmarks/results/archive/launch-h100x4.json
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

MODES = ("default", "SERIALIZE", "CONCURRENT", "LHS")
SCHEDULING_OPTION = "xla_gpu_command_buffer_scheduling_mode"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="+", help="devices per program (default: 1, 2 and all)")
    parser.add_argument("--args", type=int, nargs="+", default=[1, 64, 300], help="sharded arguments per program")
    parser.add_argument("--kernels", type=int, nargs="+", default=[1, 600], help="kernels per program")
    parser.add_argument("--modes", nargs="+", default=list(MODES[:3]), choices=MODES,
                        help="command-buffer scheduling (timed at the most arguments and kernels only; "
                             "default elsewhere)")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--cpu", action="store_true", help="host devices (JAX_PLATFORMS=cpu): a smoke test")
    parser.add_argument("--out", help="result JSON path")
    args = parser.parse_args(argv)
    if min(args.gpus or [1]) < 1 or min(args.args) < 1 or min(args.kernels) < 1 or args.calls < 1:
        parser.error("--gpus, --args, --kernels and --calls must be at least 1")
    return args


def chain(kernels: int):
    """A program of ``kernels`` kernels in a row: the barrier keeps XLA from fusing them into one."""
    import jax

    def program(x, *unused):
        for _ in range(kernels):
            x = jax.lax.optimization_barrier(x * 1.0001 + 1.0)
        return x

    return program


def launch_ms(compiled, arguments: list, calls: int) -> tuple[float, float]:
    """Median and 90th percentile of the host's time in ``compiled(*arguments)``, each call waited for."""
    import jax
    import numpy as np

    for _ in range(10):
        jax.block_until_ready(compiled(*arguments))
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        out = compiled(*arguments)
        times.append((time.perf_counter() - t0) * 1e3)
        jax.block_until_ready(out)
    return statistics.median(times), float(np.percentile(times, 90))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu:
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    sizes = sorted(set(args.gpus or [1, 2, len(devices)]))
    if sizes[-1] > len(devices):
        print(f"--gpus {sizes[-1]}: this process sees {len(devices)} device(s)", file=sys.stderr)
        return 2
    rows = []
    for gpus in sizes:
        sharding = NamedSharding(Mesh(np.array(devices[:gpus]), ("x",)), P("x"))
        for count in args.args:
            arguments = [jax.device_put(jnp.ones((gpus * 8, 256), jnp.bfloat16), sharding) for _ in range(count)]
            for kernels in args.kernels:
                widest = count == max(args.args) and kernels == max(args.kernels)
                for mode in args.modes if widest else ["default"]:
                    options = {} if mode == "default" else {SCHEDULING_OPTION: mode}
                    compiled = jax.jit(chain(kernels), keep_unused=True).lower(*arguments).compile(
                        compiler_options=options)
                    median, p90 = launch_ms(compiled, arguments, args.calls)
                    rows.append({"gpus": gpus, "args": count, "kernels": kernels, "mode": mode,
                                 "median_ms": round(median, 4), "p90_ms": round(p90, 4)})
                    print(f"gpus {gpus} args {count:4d} kernels {kernels:4d} {mode:10s} launch {median:.3f} ms "
                          f"(p90 {p90:.3f})", flush=True)
    result = {
        **result_file.provenance(f"{len(devices)}x {devices[0].device_kind}", argv, script=__file__),
        "jax": jax.__version__,
        "rows": rows,
    }
    if args.out:
        result_file.write_result(args.out, result)
        print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
