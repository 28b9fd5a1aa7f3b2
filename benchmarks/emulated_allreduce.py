#!/usr/bin/env python3
"""All-reduce kernels with 2, 4 and 8 ranks emulated on ONE GPU (tests/helpers/emulated_ranks.cu).

What it is for: a GPU run of the kernels' exchange protocol, and of changes to it, where no
machine with several GPUs is lent. Every rank is a stream of its own with its own workspace; a
"peer" store is a local store, so these are NOT NVLink timings and no figure here stands for a
node's: they compare two builds of the kernels under the same emulation, nothing more. The result
file is marked ``experiment`` so that the planner's calibration never reads it.

Method: for each kernel, world size and message size, every rank's chain of ``--calls`` dependent
calls is one branch of one CUDA graph; a sample is one replay's time / calls (median of
``--graph-reps`` replays); the builds are sampled in turn, ``--rounds`` times, and the figure is
the median of the rounds. Every result is checked against float64 in the same run (bf16).

``--baseline-counter`` adds a build whose launches close as before the per-block launch counters
(common.cuh, Epochs): one counter, the last block found by a fence and an atomic increment.

  python3 benchmarks/emulated_allreduce.py --baseline-counter --out benchmarks/results/emulated-counters-h100.json
"""

from __future__ import annotations

import argparse
import json
import re
import runpy
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# benchmarks/result_file.py (provenance and writing), by its path: PYTHONSAFEPATH=1 keeps benchmarks/ off sys.path.
result_file = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("result_file.py"))))
sys.path.insert(0, str(ROOT / "tests"))

from helpers.emulated_ranks import Emulation, HarnessError, build_harness, load, rel  # noqa: E402

SIZES = [1 << 10, 8 << 10, 16 << 10, 64 << 10, 256 << 10, 512 << 10, 1 << 20]  # bytes per rank, bf16
HIDDEN = 4096

# The launch counter before per-block counters, for --baseline-counter: epoch from one word, the
# last block to finish (counted by a fence and an atomic increment) publishes it; no other entries.
BASELINE_COUNTER = """__device__ __forceinline__ uint32_t read_epoch(const Peers& P) {
  return *reinterpret_cast<volatile uint32_t*>(&P.self->calls[0]) + 1u;
}

__device__ __forceinline__ void store_absent_counters(const Peers&, uint32_t) {}

__device__ __forceinline__ void finish_launch(const Peers& P, uint32_t epoch) {
  __syncthreads();
  if (threadIdx.x == 0) {
    if (gridDim.x == 1) {
      *reinterpret_cast<volatile uint32_t*>(&P.self->calls[0]) = epoch;
      return;
    }
    __threadfence();
    if (atomicAdd(&P.self->pad[0], 1u) == gridDim.x - 1) {
      P.self->pad[0] = 0;
      *reinterpret_cast<volatile uint32_t*>(&P.self->calls[0]) = epoch;
      __threadfence();
    }
  }
}

"""


def baseline_counter_csrc(dest: Path) -> Path:
    """A copy of kernels/csrc whose read_epoch and finish_launch are BASELINE_COUNTER."""
    src = ROOT / "kernels" / "csrc"
    shutil.copytree(src, dest)
    common = dest / "common.cuh"
    text = common.read_text()
    pattern = re.compile(r"__device__ __forceinline__ uint32_t read_epoch\(.*?(?=// A bounded wait gave up)", re.S)
    new, count = pattern.subn(lambda _: BASELINE_COUNTER, text)
    if count != 1:
        raise SystemExit("baseline counter: read_epoch .. finish_launch not found in common.cuh")
    common.write_text(new)
    return dest


def device_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True).stdout.strip().splitlines()
        return f"{len(out)}x {out[0]}" if out else "unknown"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def inputs(kernel: str, world: int, nbytes: int, rng: np.random.Generator) -> tuple[np.ndarray, dict]:
    import ml_dtypes

    n = nbytes // 2
    x = rng.standard_normal((world, n)).astype(ml_dtypes.bfloat16)
    if kernel != "fused":
        return x, {}
    hidden = min(HIDDEN, n)
    extra = {"residual": rng.standard_normal(n).astype(ml_dtypes.bfloat16),
             "weight": rng.uniform(0.5, 1.5, hidden).astype(ml_dtypes.bfloat16)}
    return x, extra


def check(kernel: str, x: np.ndarray, extra: dict, out: np.ndarray, normed: np.ndarray | None) -> float:
    """Largest relative error of any rank against float64."""
    total = np.asarray(x, np.float64).sum(0)
    if kernel == "fused":
        w = np.asarray(extra["weight"], np.float64)
        nr = (np.asarray(extra["residual"], np.float64) + total).reshape(-1, w.size)
        refs = [(out, nr.ravel()), (normed, (w * nr / np.sqrt(np.mean(nr**2, -1, keepdims=True) + 1e-5)).ravel())]
    else:
        refs = [(out, total)]
    return max(rel(np.asarray(got[r], np.float64), ref) for got, ref in refs for r in range(got.shape[0]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--kernels", nargs="+", default=["oneshot", "fused", "twoshot"])
    parser.add_argument("--sizes", type=int, nargs="+", default=SIZES, help="bytes per rank (bf16)")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--graph-reps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline-counter", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="emulated-"))
    builds = {"current": load(build_harness(tmp / "current.so"))}
    if args.baseline_counter:
        csrc = baseline_counter_csrc(tmp / "csrc-baseline")
        builds["baseline_counter"] = load(build_harness(tmp / "baseline.so", csrc))
    rng = np.random.default_rng(0)
    rows: list[dict] = []
    for world in args.worlds:
        emus = {name: Emulation(lib, world, timeout_s=2.0) for name, lib in builds.items()}
        try:
            for kernel in args.kernels:
                for nbytes in args.sizes:
                    x, extra = inputs(kernel, world, nbytes, rng)
                    samples: dict[str, list[float]] = {name: [] for name in emus}
                    errs: dict[str, float] = {}
                    try:
                        for _ in range(args.rounds):
                            for name, emu in emus.items():
                                out, normed, us = emu.run(kernel, x, "bfloat16", calls=args.calls,
                                                          graph_reps=args.graph_reps, **extra)
                                samples[name].append(us)
                                errs[name] = check(kernel, x, extra, out, normed)
                    except HarnessError as exc:
                        print(f"world {world} {kernel} {nbytes} B: {exc}")
                        continue
                    for name, emu in emus.items():
                        if emu.error():
                            raise SystemExit(f"{name}: a bounded wait gave up (world {world}, {kernel}, {nbytes} B)")
                        row = {"build": name, "kernel": kernel, "world": world, "bytes": nbytes, "dtype": "bf16",
                               "us_per_call": round(statistics.median(samples[name]), 3),
                               "rounds": [round(v, 3) for v in samples[name]], "max_rel_err": errs[name]}
                        rows.append(row)
                        print(json.dumps({k: v for k, v in row.items() if k != "rounds"}))
        finally:
            for emu in emus.values():
                emu.close()
    result = {
        "experiment": "emulated ranks on one GPU: every rank a stream, peer stores are local stores (not NVLink)",
        **result_file.provenance(device_name(), script=__file__),
        "rows": rows,
    }
    if args.out:
        result_file.write_result(args.out, result, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
