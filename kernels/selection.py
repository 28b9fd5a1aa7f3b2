"""Which implementation runs an all-reduce: pure logic, no JAX, no I/O (but the table file).

The one chooser: the engine stages what it picks (``collectives.plan``) and the operator's planner
estimates what it picks for the pods it plans (the operator's image has no JAX, so this module
imports none).

``auto`` looks the message size up in ``auto_table.json``, which ``benchmarks/allreduce.py``
writes from its own measurements (fastest implementation per GPU count and message size). Every
choice falls back to ``xla`` (XLA psum, NCCL on GPU) where the custom kernels cannot run: library
or peer access missing, a mesh axis that is not the registered GPU group, an unsupported dtype, or
a message larger than the workspace.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# The all-reduce strategies a pod can be told (the serving layout, the engine, the planner).
STRATEGIES = ("xla", "oneshot", "twoshot", "auto")
# What can run: plain all-reduce -> xla | oneshot | twoshot;
# all-reduce + residual + RMSNorm -> xla | fused (one kernel) | twoshot (kernel, then XLA norm).
PLAIN_IMPLS = ("xla", "oneshot", "twoshot")
FUSED_IMPLS = ("xla", "fused", "twoshot")
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
TABLE_PATH = Path(__file__).resolve().parent / "auto_table.json"
# Workspace per GPU that ``native.init`` asks for: 2 halves x world x ONESHOT_BYTES for one-shot and
# fused, 2 x TWOSHOT_BYTES for two-shot. 8 MiB / 64 MiB: 160 MiB per GPU on 2 GPUs, 256 MiB on 8.
DEFAULT_ONESHOT_BYTES = 8 << 20
DEFAULT_TWOSHOT_BYTES = 64 << 20

# Used for GPU counts the table has not measured: one-shot moves (world-1) x the message per GPU
# but has one barrier, two-shot moves 2 (world-1)/world with two; one-shot wins while latency
# dominates. A prior, not a measurement: `benchmarks/allreduce.py` replaces it per GPU count.
DEFAULT_RULE: dict[str, list[list]] = {
    "allreduce": [[256 << 10, "oneshot"], [None, "twoshot"]],
    "fused": [[256 << 10, "fused"], [None, "twoshot"]],
}


@dataclass(frozen=True)
class Capability:
    available: bool
    world: int = 0
    oneshot_bytes: int = 0
    twoshot_bytes: int = 0
    reason: str = ""

    @staticmethod
    def unavailable(reason: str) -> Capability:
        return Capability(False, reason=reason)

    @staticmethod
    def node_group(world: int, peer_access: bool = True) -> Capability:
        """What ``native.init`` gives ``world`` GPUs of one node with the default workspaces: the
        capability a planner assumes for the pods it places (peer access needs an NVSwitch domain)."""
        if not peer_access:
            return Capability.unavailable("no peer access between the GPUs")
        return Capability(True, world, DEFAULT_ONESHOT_BYTES, DEFAULT_TWOSHOT_BYTES, reason="planned")


def check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown all-reduce strategy {strategy!r} (choose from {', '.join(STRATEGIES)})")


@lru_cache(maxsize=4)
def load_table(path: Path = TABLE_PATH) -> dict:
    """The measured table; an empty one (DEFAULT_RULE applies) if the file is missing."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def lookup(rules: Sequence[Sequence], nbytes: int) -> str:
    """First ``[max_bytes, impl]`` rule whose bound (None = unbounded) covers ``nbytes``."""
    for bound, impl in rules:
        if bound is None or nbytes <= bound:
            return impl
    return "xla"


def table_rules(table: Mapping, kind: str, world: int) -> Sequence[Sequence]:
    return table.get(kind, {}).get(str(world)) or DEFAULT_RULE[kind]


def _custom_ok(nbytes: int, world: int, dtype: str, cap: Capability) -> bool:
    return cap.available and world > 1 and cap.world == world and dtype in SUPPORTED_DTYPES and nbytes > 0


def _fit(impl: str, nbytes: int, cap: Capability) -> str:
    """Degrade a choice that does not fit its workspace: one-shot -> two-shot -> xla."""
    if impl in ("oneshot", "fused") and nbytes > cap.oneshot_bytes:
        impl = "twoshot"
    if impl == "twoshot" and nbytes > cap.twoshot_bytes:
        impl = "xla"
    return impl


def choose(strategy: str, nbytes: int, world: int, dtype: str, cap: Capability, table: Mapping | None = None) -> str:
    """Implementation for a plain all-reduce of ``nbytes`` per GPU over ``world`` GPUs."""
    check_strategy(strategy)
    if strategy == "xla" or not _custom_ok(nbytes, world, dtype, cap):
        return "xla"
    if strategy == "auto":
        impl = lookup(table_rules(table if table is not None else load_table(), "allreduce", world), nbytes)
    else:
        impl = strategy
    return _fit(impl, nbytes, cap)


def choose_fused(
    strategy: str, nbytes: int, world: int, dtype: str, cap: Capability, table: Mapping | None = None
) -> str:
    """Implementation for all-reduce + residual + RMSNorm: ``xla``, ``fused`` or ``twoshot``."""
    check_strategy(strategy)
    if strategy == "xla" or not _custom_ok(nbytes, world, dtype, cap):
        return "xla"
    if strategy == "auto":
        impl = lookup(table_rules(table if table is not None else load_table(), "fused", world), nbytes)
    else:
        impl = {"oneshot": "fused", "twoshot": "twoshot"}[strategy]
    return _fit(impl, nbytes, cap)


def build_table(rows: Sequence[Mapping], source: str) -> dict:
    """Auto table from benchmark rows ``{impl, gpus, bytes, dtype, us}`` measured in one run, whose
    result file is ``source`` (recorded under ``sources`` for each GPU count the rows hold).

    For each GPU count and size, the fastest candidate wins; runs of equal winners merge, and the
    bound between two runs is the geometric midpoint of the sizes on either side. The last run
    is unbounded (the workspace check still applies).
    """
    out: dict = {"sources": {str(g): source for g in sorted({int(r["gpus"]) for r in rows})},
                 "allreduce": {}, "fused": {}}
    candidates = {"allreduce": PLAIN_IMPLS, "fused": tuple(f"{i}" for i in ("fused", "twoshot_norm", "xla_norm"))}
    rename = {"twoshot_norm": "twoshot", "xla_norm": "xla"}
    for kind, impls in candidates.items():
        best: dict[int, dict[int, tuple[float, str]]] = {}
        for r in rows:
            if r["impl"] not in impls:
                continue
            per = best.setdefault(int(r["gpus"]), {})
            cur = per.get(int(r["bytes"]))
            if cur is None or r["us"] < cur[0]:
                per[int(r["bytes"])] = (float(r["us"]), rename.get(r["impl"], r["impl"]))
        for gpus, per in best.items():
            sizes = sorted(per)
            rules: list[list] = []
            for i, size in enumerate(sizes):
                impl = per[size][1]
                if rules and rules[-1][1] == impl:
                    rules[-1][0] = size
                else:
                    rules.append([size, impl])
                if i + 1 < len(sizes) and per[sizes[i + 1]][1] != impl:
                    rules[-1][0] = int((size * sizes[i + 1]) ** 0.5)
            if rules:
                rules[-1][0] = None
            out[kind][str(gpus)] = rules
    return out


def merge_tables(shipped: Mapping, measured: Mapping) -> dict:
    """``shipped`` with the GPU counts ``measured`` holds replaced by its rules and sources: a run on
    one machine size re-measures that size and keeps the others' (each measured on a machine of its
    own size)."""
    out: dict = {"sources": {**shipped.get("sources", {}), **measured.get("sources", {})}}
    for kind in ("allreduce", "fused"):
        out[kind] = {**shipped.get(kind, {}), **measured.get(kind, {})}
    return out
