#!/usr/bin/env python3
"""All-reduce benchmark: builds the kernels, checks them, times them, rewrites the auto table.

It builds and loads the diagnostic library (``python -m switchyard.kernels.build --diagnostics``:
the product library's kernels and handlers from the same sources and flags, plus the device
timestamp; ``--no-build`` loads the one built before, ``$SWITCHYARD_KERNELS_LIB`` another).

One run, one timing method for every implementation: K dependent calls of the operation are
chained inside one jitted program (XLA command buffers on, so the chain is replayed as CUDA
graphs) and bracketed by two device-side %globaltimer stamps (``native.timestamp``), taken on
every GPU; a sample is min over GPUs of (t_end - t_start) / K (the GPU that starts first also
times its wait for the others); the implementations of one size are sampled in turn, and the
figure is the median of ``--reps`` samples. PyTorch (NCCL and symm_mem one-shot/two-shot, one process per GPU) is timed
the same way: K calls captured in one CUDA graph, device events around each replay, median.

Implementations (``impl`` in the rows): xla (psum -> NCCL), oneshot, twoshot, auto (after the
table is rewritten), fused (all-reduce + residual + RMSNorm in one kernel), xla_norm (psum, then
residual add and RMSNorm in XLA), twoshot_norm (two-shot kernel, then XLA), torch_nccl,
symm_mem_oneshot, symm_mem_twoshot; floor_empty_kernel (a chain of one-thread kernels: the cost of
a dependent kernel node in a command buffer); oneshot_again/twoshot_again (sampled in turn with
auto, after the table is written). bf16; message sizes are bytes per GPU, 1 KB .. 64 MB.

Writes benchmarks/results/current/allreduce-<tag>.json ``{"command","device","date","commit","rows"}`` and
kernels/auto_table.json (fastest of xla/oneshot/twoshot and of fused/twoshot_norm/xla_norm per size).
Run on the GPU node:  python3 benchmarks/allreduce.py --tag h200x2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import runpy
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
# benchmarks/result_file.py (provenance and writing), by its path: PYTHONSAFEPATH=1 keeps benchmarks/ off sys.path.
result_file = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("result_file.py"))))
# bytes per GPU: every power of two 1 KB .. 1 MB (decode sizes, where the auto bounds matter), then
# 4, 16, 64 MB
SIZES = [1024 << i for i in range(11)] + [4 << 20, 16 << 20, 64 << 20]
FUSED_MAX = 16 << 20
HIDDEN = 4096  # Llama-3-8B hidden size: rows of the fused op
COMMAND_BUFFER_FLAGS = (
    "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,COLLECTIVES --xla_gpu_graph_min_graph_size=1"
)


def environment() -> None:
    """Before JAX or torch start: no NVLink multicast anywhere, command buffers on."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    os.environ["NVSHMEM_DISABLE_NVLS"] = "1"
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_command_buffer" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {COMMAND_BUFFER_FLAGS}".strip()


def _chain_length(nbytes: int, world: int) -> int:
    k = 100 if nbytes <= (1 << 20) else 20
    # plain chains multiply by `world` each call: stay inside bf16 range from a 2^-80 start
    return min(k, 1 + int(150 / max(1.0, math.log2(world))))


def stamps_ns(t) -> list[int]:
    """The %globaltimer stamps of ``native.timestamp`` (uint32 low, high words; one pair per GPU)."""
    import numpy as np

    t = np.asarray(t).astype(np.uint64)
    return [int(lo) | (int(hi) << 32) for lo, hi in t.reshape(-1, 2)]


# ---- PyTorch baselines (separate processes, one per GPU) ---------------------------------------
def _torch_worker(rank: int, world: int, port: int, sizes: list[int], reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=dev)
    group = dist.group.WORLD.group_name
    rows: list[dict] = []
    notes: list[str] = []
    try:
        import torch.distributed._symmetric_memory as symm_mem

        sbuf = symm_mem.empty(max(sizes) // 2, dtype=torch.bfloat16, device=dev)
        symm_mem.rendezvous(sbuf, group)
    except Exception as exc:  # symm_mem missing or refused: record, keep NCCL
        sbuf = None
        notes.append(f"symm_mem unavailable: {exc!r}")
    plain = torch.empty(max(sizes) // 2, dtype=torch.bfloat16, device=dev)
    ops = {
        "torch_nccl": lambda t: dist.all_reduce(t),
        "symm_mem_oneshot": lambda t: torch.ops.symm_mem.one_shot_all_reduce(t, "sum", group),
        "symm_mem_twoshot": lambda t: torch.ops.symm_mem.two_shot_all_reduce_(t, "sum", group),
    }
    for nbytes in sizes:
        n = nbytes // 2
        k = _chain_length(nbytes, world)
        for impl, op in ops.items():
            buf = plain if impl == "torch_nccl" else sbuf
            if buf is None:
                continue
            t = buf[:n]
            try:
                t.copy_(torch.randn(n, device=dev, dtype=torch.float32).mul_(2.0**-80).to(torch.bfloat16))
                for _ in range(3):
                    op(t)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(k):
                        op(t)
                graph.replay()
                torch.cuda.synchronize()
                samples = []
                for _ in range(reps):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    graph.replay()
                    end.record()
                    end.synchronize()
                    samples.append(start.elapsed_time(end) * 1000.0 / k)
                # min over ranks, as for our chains: the rank whose replay started first also
                # times its wait for the others
                med = torch.tensor([statistics.median(samples)], device=dev)
                dist.all_reduce(med, op=dist.ReduceOp.MIN)
                rows.append({"impl": impl, "gpus": world, "bytes": nbytes, "dtype": "bfloat16", "us": med.item()})
                del graph
            except Exception as exc:
                notes.append(f"{impl} {nbytes}: {exc!r}"[:300])
                torch.cuda.synchronize()
    if rank == 0:
        Path(out).write_text(json.dumps({"rows": rows, "notes": notes}))
    dist.barrier()
    dist.destroy_process_group()


def run_torch(world: int, sizes: list[int], reps: int, timeout: int) -> tuple[list[dict], list[str]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "torch.json"
        cmd = [sys.executable, __file__, "--torch-worker", out.as_posix(), "--world", str(world), "--reps", str(reps),
               "--sizes", ",".join(map(str, sizes))]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return [], [f"torch baselines timed out after {timeout} s"]
        if not out.exists():
            return [], [f"torch baselines failed (rc {proc.returncode}): {proc.stderr[-1500:]}"]
        data = json.loads(out.read_text())
        return data["rows"], data["notes"]


def _torch_main(out: str, world: int, reps: int, sizes: list[int]) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_torch_worker, args=(world, port, sizes, reps, out), nprocs=world, join=True)


# ---- JAX: our kernels and XLA psum --------------------------------------------------------------
class JaxBench:
    def __init__(self, reps: int) -> None:
        import jax
        import numpy as np
        from jax.sharding import Mesh
        from switchyard import kernels

        self.jax, self.np, self.kernels = jax, np, kernels
        self.devices = jax.devices("gpu")
        self.world = len(self.devices)
        cap = kernels.init(self.devices)
        if not cap.available:
            raise SystemExit(f"kernels unavailable: {kernels.status()}")
        self.mesh = Mesh(np.array(self.devices), ("tp",))
        self.reps = reps
        self.rng = np.random.default_rng(0)

    def put(self, a, spec):
        import jax.numpy as jnp
        from jax.sharding import NamedSharding

        return self.jax.device_put(jnp.asarray(a, jnp.bfloat16), NamedSharding(self.mesh, spec))

    def sample(self, fn, args, k: int) -> tuple[float, object]:
        """One sample: µs per call of the chain on the GPU that started last (min over GPUs of
        elapsed / K). The GPU that starts first waits in its first call for the others, so its
        elapsed time includes the skew between the GPUs' program starts, which is not the op's."""
        t0, t1, y = fn(*args)
        s0, s1 = stamps_ns(t0), stamps_ns(t1)
        return min(b - a for a, b in zip(s0, s1, strict=True)) / k / 1000.0, y

    def measure(self, chains: dict[str, tuple]) -> dict[str, tuple[float, object]]:
        """Median µs per call for each chain ``name -> (fn, args, k)``, samples interleaved
        (chain A, B, C, A, B, C, ...) so that drift of the machine hits every chain alike."""
        samples: dict[str, list[float]] = {name: [] for name in chains}
        last: dict[str, object] = {}
        for fn, args, _ in chains.values():  # compile + record command buffers
            self.jax.block_until_ready(fn(*args))
        for _ in range(self.reps):
            for name, (fn, args, k) in chains.items():
                us, last[name] = self.sample(fn, args, k)
                samples[name].append(us)
        self.kernels.check_errors()
        return {name: (statistics.median(v), last[name]) for name, v in samples.items()}

    def plain(self, strategy: str, nbytes: int) -> tuple:
        """Chain of K all-reduces ``(fn, args, k)`` and a check of its result against float64."""
        from jax.sharding import PartitionSpec as P
        from switchyard.kernels import native

        jax, np, world = self.jax, self.np, self.world
        n = nbytes // 2
        k = _chain_length(nbytes, world)

        def body(x):
            v, t0 = native.timestamp(x[0])
            for _ in range(k):
                v = self.kernels.all_reduce(v, "tp", strategy)
            v, t1 = native.timestamp(v)
            return t0[None], t1[None], v[None]

        fn = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=P("tp"), out_specs=(P("tp"),) * 3, check_vma=False))
        xs = self.rng.standard_normal((world, n)).astype(np.float32) * 2.0**-80
        x = self.put(xs, P("tp"))

        def check(y) -> float:
            got = np.asarray(y[0].astype(jax.numpy.float32), np.float64) / float(world) ** (k - 1)
            ref = np.asarray(x.astype(jax.numpy.float32), np.float64).sum(0)
            return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))

        return (fn, (x,), k), check

    def floor(self) -> tuple:
        """The method's floor: a chain of K one-thread kernels (timestamps) in the same command
        buffer, i.e. what launching one dependent kernel node costs before it does any work."""
        from jax.sharding import PartitionSpec as P
        from switchyard.kernels import native

        jax, k = self.jax, 100

        def body(x):
            v, t0 = native.timestamp(x[0])
            for _ in range(k):
                v, _ = native.timestamp(v)
            v, t1 = native.timestamp(v)
            return t0[None], t1[None], v[None]

        fn = jax.jit(jax.shard_map(body, mesh=self.mesh, in_specs=P("tp"), out_specs=(P("tp"),) * 3, check_vma=False))
        return fn, (self.put(self.np.zeros((self.world, 8)), P("tp")),), k

    def fused(self, strategy: str, nbytes: int) -> tuple:
        from jax.sharding import PartitionSpec as P
        from switchyard.kernels import native

        jax, np, world = self.jax, self.np, self.world
        hidden = min(HIDDEN, nbytes // 2)
        rows = nbytes // 2 // hidden
        k = _chain_length(nbytes, 1)

        def body(x, res, w):
            h, t0 = native.timestamp(x[0])
            r = res
            for _ in range(k):
                r, h = self.kernels.all_reduce_residual_rmsnorm(h, r, w, 1e-5, "tp", strategy)
            h, t1 = native.timestamp(h)
            return t0[None], t1[None], h[None]

        fn = jax.jit(
            jax.shard_map(body, mesh=self.mesh, in_specs=(P("tp"), P(), P()), out_specs=(P("tp"),) * 3,
                          check_vma=False)
        )
        # Same inputs for every implementation at one size, so their chains can be compared.
        rng = np.random.default_rng(nbytes)
        x = self.put(rng.standard_normal((world, rows, hidden)), P("tp"))
        res = self.put(rng.standard_normal((rows, hidden)), P())
        w = self.put(rng.uniform(0.5, 1.5, hidden), P())
        return fn, (x, res, w), k


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default="h200x2")
    parser.add_argument("--reps", type=int, default=25)
    parser.add_argument("--max-bytes", type=int, default=SIZES[-1])
    parser.add_argument("--skip-torch", action="store_true")
    parser.add_argument("--no-build", action="store_true")
    parser.add_argument("--no-table", action="store_true", help="do not rewrite kernels/auto_table.json")
    parser.add_argument("--torch-worker", metavar="OUT", help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    environment()
    if args.torch_worker:
        _torch_main(args.torch_worker, args.world, args.reps, [int(s) for s in args.sizes.split(",")])
        return 0

    sys.path.insert(0, str(ROOT))
    sizes = [s for s in SIZES if s <= args.max_bytes]
    from switchyard.kernels import build

    if not args.no_build:
        print(f"built {build.build(diagnostics=True)}", flush=True)
    lib = Path(os.environ.setdefault("SWITCHYARD_KERNELS_LIB", str(build.DIAGNOSTIC_LIB)))  # before JAX loads it
    if not lib.is_file():
        raise SystemExit(f"{lib} not built (python -m switchyard.kernels.build --diagnostics)")

    import subprocess as sp

    gpus = sp.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout
    gpu_names = [g.strip() for g in gpus.splitlines() if g.strip()]
    world = len(gpu_names)
    rows: list[dict] = []
    notes: list[str] = []
    if not args.skip_torch:  # before JAX owns the GPUs
        trows, tnotes = run_torch(world, sizes, args.reps, timeout=300)
        rows += trows
        notes += tnotes
        print(f"torch baselines: {len(trows)} rows; notes: {tnotes}", flush=True)

    bench = JaxBench(args.reps)
    checks: list[dict] = []

    partial = Path(os.environ["OUT"], "allreduce-partial.json") if os.environ.get("OUT") else None

    def record(impl: str, nbytes: int, us: float, err: float | None = None) -> None:
        rows.append({"impl": impl, "gpus": bench.world, "bytes": nbytes, "dtype": "bfloat16", "us": round(us, 3)})
        if partial is not None:  # survive a run cut short by the device's time limit
            partial.write_text(json.dumps({"rows": rows, "checks": checks, "notes": notes}))
        if err is not None:
            checks.append({"impl": impl, "bytes": nbytes, "rel_err": err})
        print(f"{impl:>14} {nbytes:>10} B {us:9.2f} us" + (f"  err {err:.1e}" if err is not None else ""), flush=True)

    cap = bench.kernels.status()
    us, _ = bench.measure({"floor": bench.floor()})["floor"]
    record("floor_empty_kernel", 0, us)

    def fits(impl: str, nbytes: int) -> bool:
        """One-shot and fused carry the whole message in one workspace slot."""
        return impl not in ("oneshot", "fused") or nbytes <= cap["oneshot_bytes"]

    def run_size(nbytes: int) -> None:
        chains, checks_of = {}, {}
        for impl in ("xla", "oneshot", "twoshot"):
            if fits(impl, nbytes):
                chains[impl], checks_of[impl] = bench.plain(impl, nbytes)
        if nbytes <= FUSED_MAX:
            for impl, strategy in (("fused", "oneshot"), ("twoshot_norm", "twoshot"), ("xla_norm", "xla")):
                if fits(impl, nbytes):
                    chains[impl] = bench.fused(strategy, nbytes)
        try:
            results = bench.measure(chains)
        except Exception as exc:
            notes.append(f"{nbytes}: {exc!r}"[:400])
            print(notes[-1], flush=True)
            return
        for impl, (us, y) in results.items():
            err = checks_of[impl](y) if impl in checks_of else None
            if err is not None and not err < 2e-2:
                notes.append(f"CHECK FAILED {impl} {nbytes}: rel err {err}")
            record(impl, nbytes, us, err)
        ref = results.get("xla_norm")
        for impl in ("fused", "twoshot_norm"):
            if impl in results and ref is not None:
                np = bench.np
                a = np.asarray(results[impl][1].astype("float32"), np.float64)
                b = np.asarray(ref[1].astype("float32"), np.float64)
                err = float(np.linalg.norm(a - b) / np.linalg.norm(b))
                checks.append({"impl": impl, "bytes": nbytes, "rel_err_vs_xla_chain": err})
                if not err < 5e-2:
                    notes.append(f"CHECK FAILED {impl} {nbytes}: chain differs from xla_norm by {err}")

    for nbytes in sizes:
        run_size(nbytes)

    from switchyard.kernels import selection

    table = selection.build_table(rows, source=f"benchmarks/results/current/allreduce-{args.tag}.json")
    # Other GPU counts' rules stay as their own machines measured them.
    shipped = selection.merge_tables(selection.load_table(), table)
    if not args.no_table:
        result_file.write_result(selection.TABLE_PATH, shipped)
        selection.load_table.cache_clear()
    # auto, with the table just written, interleaved with what it chose from so that "within 5%
    # of the best" compares samples of one sitting (rows named *_again)
    for nbytes in sizes:
        chains, checks_of = {}, {}
        chains["auto"], checks_of["auto"] = bench.plain("auto", nbytes)
        for impl in ("oneshot", "twoshot"):
            if fits(impl, nbytes):
                chains[f"{impl}_again"], _ = bench.plain(impl, nbytes)
        try:
            results = bench.measure(chains)
        except Exception as exc:
            notes.append(f"auto {nbytes}: {exc!r}"[:400])
            continue
        for impl, (us, y) in results.items():
            record(impl, nbytes, us, checks_of["auto"](y) if impl == "auto" else None)

    result = {
        **result_file.provenance(f"{world}x {gpu_names[0] if gpu_names else '?'}", script=__file__),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "method": "median of per-call time over reps; K chained calls per sample between device timestamps "
        "(JAX: %globaltimer custom calls inside command buffers, min over GPUs of elapsed / K, "
        "implementations of one size interleaved; torch: CUDA graph + events, min over ranks of the median)",
        "rows": rows,
        "checks": checks,
        "notes": notes,
        "auto_table": table,
    }
    out = ROOT / "benchmarks" / "results" / "current" / f"allreduce-{args.tag}.json"
    result_file.write_result(out, result, indent=1)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], out.name).write_text(out.read_text())
        result_file.write_result(Path(os.environ["OUT"], "auto_table.json"), shipped)
    _summary(rows, sizes)
    print("notes:", *notes, sep="\n  ")
    return 0


def _summary(rows: list[dict], sizes: list[int]) -> None:
    impls = sorted({r["impl"] for r in rows})
    by = {(r["impl"], r["bytes"]): r["us"] for r in rows}
    print("bytes".rjust(10) + "".join(i[:12].rjust(13) for i in impls))
    for s in sizes:
        print(str(s).rjust(10) + "".join((f"{by[(i, s)]:.2f}" if (i, s) in by else "-").rjust(13) for i in impls))


if __name__ == "__main__":
    sys.exit(main())
