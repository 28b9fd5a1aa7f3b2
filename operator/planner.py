"""Choose a parallel layout (tp, pp, dp, all-reduce strategy, batch, KV budget, placement) for a model
on the GPU nodes at hand, and say why. Pure and deterministic: same inputs, same plan.

The model of one decode step (every term is a measurement from ``calibration.json`` or a stated model
whose statement is printed in the reasons):

* a pipeline stage reads its share of the weights and of the batch's KV cache from HBM:
  ``bytes / (tp * pp) / HBM bandwidth``, or computes ``2 * parameters * batch / (tp * pp * flops)``,
  whichever is longer;
* plus, per layer, a fixed cost that depends on tp (launch gaps, norms, RoPE, the KV write,
  latency-bound attention): measured at each TP size the decode checks cover, extrapolated beyond;
* plus ``2 * layers / pp`` tensor-parallel all-reduces of the batch's hidden state, each fused with
  the residual add and RMSNorm as the engine runs them: the implementation the kernels' chooser
  picks for the strategy (``switchyard.kernels.selection``), timed by the calibrated table of its
  exchange, scaled from 2 GPUs to ``tp``;
* or, where it is longer, the host's launch of the stage's step: a cost per layer measured at each
  TP size and strategy the decode checks recorded it for, plus the serving loop's own work per step
  (a step the host bound took that much beyond its launch); more GPUs in one process, more launching;
* plus a hop to the next stage when ``pp > 1``. The stages run a step one after another over the
  whole batch, so a step takes ``pp`` stage times, and a group emits ``batch`` tokens in that time.

The KV cache is a pool of 64-token blocks shared by a replica's sequences, sized in tokens: of each GPU's
usable memory (``(1 - memory_headroom_fraction) x memory - runtime_reserve_bytes``, the runtime's
headroom and its workspace and activations) less the weights, the pool takes ``kvMemoryFraction``. A
layout fits when its pool holds one full-length sequence; batch slots go up to the sequences of the
expected length (prompt + half the output, whole blocks) the pool holds.

Tensor parallelism stays inside one NVSwitch domain (one HGX node); pipeline stages are separate pods
and may sit on other nodes. A pipeline group is placed whole or not at all (gang safety).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from switchyard.service.modelspec import (
    DEFAULT_STEP_TOKENS,
    KV_BLOCK_TOKENS,
    MAX_KV_MEMORY_FRACTION,
    STEP_TOKENS_MULTIPLE,
    XLA_UNSTATED_LIMIT_FRACTION,
    ModelSpec,
    compiler_room_bytes,
    is_integer,
    is_number,
    kv_tokens_for_memory,
)

from . import calibration as calibration_mod
from . import crd
from .inventory import GpuNode, Inventory
from .rejections import LayoutRejection, ServiceRejection

OBJECTIVES = ("latency", "throughput", "balanced")
TP_SIZES = (1, 2, 4, 8)
MAX_PP = 64
MAX_REPLICAS = 1024
# Balanced: the most tokens/s per GPU among layouts within this factor of the fastest ms/token.
BALANCED_LATENCY_FACTOR = 2.0
# Latency: layouts this close to the fastest count as equally fast (stated model tolerance).
LATENCY_TIE = 0.02
# The serving engine needs room for a prompt token and a generated one.
MIN_SEQ_LEN = 2
# The smallest time per token the estimate reports (its rounding step): a model too small to
# measure still gets a finite tokens/s.
MIN_MS_PER_TOKEN = 0.001
GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class Request:
    """What the DecodeService asks for (spec fields; where the spec leaves one out, the CRD schema's default)."""

    objective: str = crd.spec_default("objective")
    input_tokens: int = crd.spec_default("workload.inputTokens")
    output_tokens: int = crd.spec_default("workload.outputTokens")
    concurrency: int = crd.spec_default("workload.concurrency")
    max_tpot_ms: float | None = None
    max_ttft_ms: float | None = None
    target_tokens_per_s: float | None = None
    replicas: int | None = None  # pinned data-parallel replicas; None = auto
    tp: int | None = None
    pp: int | None = None
    strategy: str = crd.spec_default("allReduce")
    kv_memory_fraction: float = crd.spec_default("kvMemoryFraction")
    step_tokens: int | None = None  # prompt tokens per step; None = DEFAULT_STEP_TOKENS
    node_selector: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if not is_number(self.kv_memory_fraction) or not 0 < self.kv_memory_fraction <= MAX_KV_MEMORY_FRACTION:
            raise ValueError(f"kv_memory_fraction must be in (0, {MAX_KV_MEMORY_FRACTION}], "
                             f"got {self.kv_memory_fraction!r}")
        # The CRD's schema holds the operator's requests to these bounds; the command line is held here.
        for field, least in (("input_tokens", 1), ("output_tokens", 1), ("concurrency", 1), ("replicas", 0),
                             ("tp", 1), ("pp", 1)):
            value = getattr(self, field)
            if value is not None and (not is_integer(value) or value < least):
                raise ValueError(f"{field} must be an integer of at least {least}, got {value!r}")
        for field in ("max_tpot_ms", "max_ttft_ms", "target_tokens_per_s"):
            value = getattr(self, field)
            if value is not None and (not is_number(value) or not value > 0):
                raise ValueError(f"{field} must be more than 0, got {value!r}")
        step = self.step_tokens
        if step is not None and (not is_integer(step) or step < STEP_TOKENS_MULTIPLE or step % STEP_TOKENS_MULTIPLE):
            raise ValueError(f"step_tokens must be a multiple of {STEP_TOKENS_MULTIPLE} and at least "
                             f"{STEP_TOKENS_MULTIPLE}, got {step!r}")


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int  # replicas placed now
    product: str
    memory_bytes: int
    nvswitch: bool
    strategy: str  # what the pods are told: auto/xla/oneshot/twoshot
    allreduce_impl: str  # what the estimate assumed
    batch_slots: int  # sequences decoded at once per replica
    active_batch: int  # sequences per replica the estimate is for
    max_seq_len: int
    kv_tokens: int  # tokens the replica's KV pool holds (every GPU holds its share of each)
    kv_bytes_per_gpu: int  # the pool's bytes on each GPU
    kv_memory_fraction: float  # share of the memory after the weights the pool takes
    step_tokens: int  # prompt tokens one step carries
    weight_bytes_per_gpu: int
    ms_per_token: float
    tokens_per_s: float  # all replicas
    ttft_ms: float
    placement: tuple[tuple[str, ...], ...]  # per replica, the node of each stage

    @property
    def gpus_per_replica(self) -> int:
        return self.tp * self.pp

    @property
    def kv_blocks(self) -> int:
        return self.kv_tokens // KV_BLOCK_TOKENS

    @property
    def memory_per_gpu_bytes(self) -> int:
        return self.weight_bytes_per_gpu + self.kv_bytes_per_gpu

    @property
    def summary(self) -> str:
        return f"TP{self.tp}xPP{self.pp}xDP{self.dp} {self.product}"


@dataclasses.dataclass(frozen=True)
class Alternative:
    layout: str
    ms_per_token: float | None
    tokens_per_s: float | None
    rejected: str  # why, for people
    kind: LayoutRejection  # why, for code


@dataclasses.dataclass(frozen=True)
class Rejected:
    """A candidate layout left out, before it is named (``_evaluate`` does not know the label)."""

    kind: LayoutRejection
    why: str


@dataclasses.dataclass(frozen=True)
class Plan:
    layout: Layout | None
    rejection: ServiceRejection | None  # None: planned whole
    message: str
    reasons: tuple[str, ...]
    alternatives: tuple[Alternative, ...]
    replicas_wanted: int = 0
    slo_miss: str = ""  # why the chosen layout misses its SLO; "" when it meets it

    @property
    def status(self) -> str:
        """Planned | InsufficientCapacity | DoesNotFit | NoGPUNodes: the Planned condition's reason."""
        return self.rejection.value if self.rejection is not None else "Planned"

    @property
    def slo_met(self) -> bool:
        return not self.slo_miss


@dataclasses.dataclass(frozen=True)
class _Pool:
    product: str
    memory_bytes: int
    nvswitch: bool
    nodes: tuple[GpuNode, ...]

    @property
    def label(self) -> str:
        link = "NVSwitch" if self.nvswitch else "PCIe/unknown topology: xla all-reduce only"
        return f"{self.product} ({self.memory_bytes / GiB:.0f} GiB, {link})"


@dataclasses.dataclass
class _Candidate:
    layout: Layout
    slo_ok: bool
    slo_note: str
    groups_free: int
    replicas_wanted: int
    layer_cost_note: str
    host_note: str  # what the host takes per step, measured; empty where no check recorded it
    ar_us: float
    ar_bytes: int
    usable_bytes: int
    expected_tokens: int  # KV tokens a sequence of the expected length takes (whole blocks)
    seqs_at_expected: int  # such sequences the pool holds
    max_slots: int  # the batch slots the pool and the engine allow

    @property
    def gpus(self) -> int:
        return self.layout.gpus_per_replica * max(self.layout.dp, 1)


def plan(model: ModelSpec, inventory: Inventory, request: Request,
         cal: calibration_mod.Calibration | None = None) -> Plan:
    cal = cal or calibration_mod.load()
    m = cal.models
    max_seq = min(request.input_tokens + request.output_tokens, model.max_position_embeddings)
    ctx_avg = min(request.input_tokens + request.output_tokens // 2, max_seq)
    reasons = [
        f"model {model.name}: {model.param_bytes / GiB:.1f} GiB weights ({model.weights_label}), "
        f"{model.kv_bytes_per_token / 1024:.0f} KiB KV per token; sequences up to {max_seq} tokens "
        f"({request.input_tokens} in + {request.output_tokens} out), {request.concurrency} concurrent"
    ]
    if inventory.skipped:
        reasons.append(f"{len(inventory.skipped)} GPU node(s) skipped for unreadable values: "
                       + "; ".join(n.message for n in inventory.skipped[:5])
                       + (" ..." if len(inventory.skipped) > 5 else ""))
    eligible, left_out = inventory.eligible(request.node_selector, request.tolerations)
    if left_out:
        reasons.append(f"{len(left_out)} GPU node(s) left out: " + "; ".join(left_out[:5])
                       + (" ..." if len(left_out) > 5 else ""))
    if not eligible:
        msg = "no Ready, schedulable GPU node matches the nodeSelector and tolerations"
        return Plan(None, ServiceRejection.NO_GPU_NODES, msg, (*reasons, msg), ())

    pools = _pools(eligible)
    for pool in pools:
        reasons.append(f"{len(pool.nodes)} node(s) of {pool.label}: "
                       f"{sum(n.free for n in pool.nodes)} of {sum(n.gpus for n in pool.nodes)} GPUs free")

    candidates: list[_Candidate] = []
    rejected: list[Alternative] = []
    for pool in pools:
        device = cal.device(pool.product)
        usable = int(pool.memory_bytes * (1 - float(m["memory_headroom_fraction"])) - int(m["runtime_reserve_bytes"]))
        max_node_gpus = max(n.gpus for n in pool.nodes)
        for tp in TP_SIZES:
            if request.tp is not None and tp != request.tp:
                continue
            name = f"TP{tp} {pool.product}"
            if not model.valid_tp(tp):
                rejected.append(Alternative(name, None, None,
                                            f"{model.num_heads} heads / {model.num_kv_heads} KV heads "
                                            f"do not split {tp} ways", LayoutRejection.HEADS_DO_NOT_SPLIT))
                continue
            if tp > max_node_gpus:
                rejected.append(Alternative(name, None, None,
                                            f"TP{tp} needs {tp} GPUs in one NVSwitch domain; nodes have "
                                            f"{max_node_gpus}", LayoutRejection.NODE_TOO_SMALL))
                continue
            if request.strategy in ("oneshot", "twoshot") and tp > 1 and not pool.nvswitch:
                rejected.append(Alternative(name, None, None,
                                            f"all-reduce {request.strategy} needs an NVSwitch domain",
                                            LayoutRejection.NEEDS_NVSWITCH))
                continue
            fitting_pp = 0
            for pp in _divisors(model.num_layers):
                if pp > MAX_PP or (request.pp is not None and pp != request.pp):
                    continue
                if fitting_pp and pp > fitting_pp * 8:
                    break  # beyond this, pipeline stages only add hops
                cand, miss = _evaluate(model, pool, device, cal, request, tp, pp, usable, max_seq, ctx_avg)
                label = f"TP{tp}xPP{pp} {pool.product}"
                if cand is None:
                    rejected.append(Alternative(label, None, None, miss.why, miss.kind))
                    continue
                fitting_pp = fitting_pp or pp
                candidates.append(cand)

    if not candidates and request.pp is not None and model.num_layers % request.pp:
        msg = (f"pp {request.pp} does not divide the model's {model.num_layers} layers "
               f"(pipeline depths that do: {', '.join(map(str, _divisors(model.num_layers)[:12]))})")
        return Plan(None, ServiceRejection.DOES_NOT_FIT, msg, (*reasons, msg), tuple(_closest_misses(rejected)))
    if not candidates:
        best_fit = _closest_misses(rejected)
        msg = (f"{model.name} does not fit the eligible GPUs with any layout "
               f"(TP up to {max(n.gpus for n in eligible)} per node, pipeline stages across nodes)")
        return Plan(None, ServiceRejection.DOES_NOT_FIT, msg, (*reasons, msg), tuple(best_fit))

    placeable = [c for c in candidates if c.groups_free > 0 or c.replicas_wanted == 0]
    pool_for_choice = placeable or candidates
    chosen = _choose(pool_for_choice, request.objective)
    lay = chosen.layout
    rejection: ServiceRejection | None = None
    message = f"{lay.summary}: {lay.ms_per_token:.2f} ms/token, {lay.tokens_per_s:.0f} tokens/s"
    if not placeable:
        rejection = ServiceRejection.INSUFFICIENT_CAPACITY
        message = (f"{lay.summary.replace(f'DP{lay.dp}', 'DP0')} fits, but no free GPUs can take a whole "
                   f"pipeline group of {lay.pp} pod(s) x {lay.tp} GPU(s) now")
    elif lay.dp < chosen.replicas_wanted:
        rejection = ServiceRejection.INSUFFICIENT_CAPACITY
        message = (f"placed {lay.dp} of {chosen.replicas_wanted} replicas of {lay.summary}; "
                   f"no partial pipeline groups are created")

    layer_us = cal.layer_cost_us(lay.tp)[0]
    device = cal.device(lay.product)
    reasons += [
        f"objective {request.objective}: chose {lay.summary} with {lay.dp} replica(s) of {lay.tp}x{lay.pp} GPUs: "
        f"{lay.ms_per_token:.2f} ms/token, {lay.tokens_per_s:.0f} tokens/s at {lay.active_batch} sequence(s) per "
        f"replica ({_why(chosen, request.objective)})",
        f"memory per GPU: {lay.weight_bytes_per_gpu / GiB:.1f} GiB weights + {lay.kv_bytes_per_gpu / GiB:.1f} GiB KV "
        f"cache of {chosen.usable_bytes / GiB:.1f} GiB usable "
        f"({1 - float(m['memory_headroom_fraction']):.0%} of {lay.memory_bytes / GiB:.0f} GiB less "
        f"{int(m['runtime_reserve_bytes']) / GiB:.0f} GiB reserve for the runtime's workspace and activations, "
        f"stated model); the cache takes at most {lay.kv_memory_fraction:.0%} of the "
        f"{(chosen.usable_bytes - lay.weight_bytes_per_gpu) / GiB:.1f} GiB after the weights",
        f"KV budget {lay.kv_tokens} tokens per replica ({lay.kv_blocks} blocks of {KV_BLOCK_TOKENS}): "
        f"{lay.kv_tokens // lay.max_seq_len} sequence(s) at the full {lay.max_seq_len} tokens, "
        f"{chosen.seqs_at_expected} at the expected {chosen.expected_tokens} (prompt + half the output, whole "
        f"blocks); {lay.batch_slots} batch slot(s) of at most {chosen.max_slots}; steps carry up to "
        f"{lay.step_tokens} prompt tokens next to one token per decoding sequence (twice that while a burst of "
        f"prompts waits)",
        f"HBM {device.hbm_bytes_per_s / 1e12:.2f} TB/s ({device.kind}: {device.source.split(': ', 1)[0]}); "
        f"fixed cost {layer_us:.1f} us per layer ({chosen.layer_cost_note})",
    ]
    if chosen.host_note:
        reasons.append(chosen.host_note)
    if lay.tp > 1:
        reasons.append(
            f"all-reduce {lay.strategy} (estimate: {lay.allreduce_impl}, {chosen.ar_us:.1f} us per call at "
            f"{chosen.ar_bytes / 1024:.0f} KiB over {lay.tp} GPUs, {2 * model.num_layers // lay.pp} calls per "
            f"stage step; {cal.raw['allreduce']['kind']} at {cal.allreduce_basis(lay.tp)} GPUs"
            + (f", scaled to {lay.tp} GPUs by the stated model)" if lay.tp > cal.allreduce_basis(lay.tp) else ")"))
    if lay.pp > 1:
        hop_us, hop_note = cal.pipeline_hop
        reasons.append(f"{lay.pp} pipeline stages of {model.num_layers // lay.pp} layers, "
                       f"run one after another; hop {hop_us:.0f} us ({hop_note.split(', ', 1)[0]}) "
                       f"+ activations at {float(m['pipeline_hop_bytes_per_s']) / 1e9:.0f} GB/s over the network "
                       f"between nodes (stated model)")
    if chosen.slo_note:
        reasons.append(chosen.slo_note)
    if rejection is not None:
        reasons.append(message)
    alternatives = _alternatives(chosen, pool_for_choice, rejected, request.objective)
    return Plan(lay, rejection, message, tuple(reasons), tuple(alternatives),
                replicas_wanted=chosen.replicas_wanted, slo_miss="" if chosen.slo_ok else chosen.slo_note)


# ---- candidates --------------------------------------------------------------------------------------
def _pools(nodes: Sequence[GpuNode]) -> list[_Pool]:
    groups: dict[tuple[str, int, bool], list[GpuNode]] = {}
    for node in nodes:
        groups.setdefault((node.product, node.memory_bytes, node.nvswitch), []).append(node)
    return [_Pool(p, mem, nv, tuple(sorted(ns, key=lambda n: n.name)))
            for (p, mem, nv), ns in sorted(groups.items())]


def _divisors(n: int) -> list[int]:
    """Divisors of ``n`` in ascending order, by trial division up to its square root."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def place(nodes: Sequence[GpuNode], tp: int, pp: int, groups: int, use_free: bool = True) -> list[tuple[str, ...]]:
    """Place up to ``groups`` pipeline groups of ``pp`` pods x ``tp`` GPUs, first fit in node order,
    stages of a group packed onto the same node while it has room. A group that cannot be placed
    whole is not placed at all. O(nodes + groups * pp): a node skipped once never fits again."""
    free = [n.free if use_free else n.gpus for n in nodes]
    out: list[tuple[str, ...]] = []
    cursor = 0
    while len(out) < groups:
        taken: list[int] = []
        probe = cursor
        for _ in range(pp):
            while probe < len(nodes) and free[probe] < tp:
                probe += 1
            if probe == len(nodes):
                break
            free[probe] -= tp
            taken.append(probe)
        if len(taken) < pp:
            for i in taken:
                free[i] += tp
            break
        out.append(tuple(nodes[i].name for i in taken))
        while cursor < len(nodes) and free[cursor] < tp:
            cursor += 1
    return out


def _evaluate(model: ModelSpec, pool: _Pool, device: calibration_mod.Device, cal: calibration_mod.Calibration,
              request: Request, tp: int, pp: int, usable: int, max_seq: int,
              ctx_avg: int) -> tuple[_Candidate, None] | tuple[None, Rejected]:
    m = cal.models
    gpus = tp * pp
    weights = math.ceil(model.param_bytes / gpus)
    if weights >= usable:
        return None, Rejected(LayoutRejection.WEIGHTS_TOO_LARGE,
                              f"weights {weights / GiB:.1f} GiB per GPU exceed the {usable / GiB:.1f} GiB usable "
                              f"on {pool.product}")
    fraction = float(request.kv_memory_fraction)
    kv_bytes = int((usable - weights) * fraction)
    room_note = ""
    if pp == 1:
        # An engine in one process keeps its pool inside what XLA's compiler assumes usable (under the
        # virtual-memory allocator it is not told the limit: service/engine/xla_runtime.py).
        room = compiler_room_bytes(pool.memory_bytes, weights, int(m["runtime_reserve_bytes"]))
        if room < kv_bytes:
            kv_bytes = room
            room_note = f", within the {XLA_UNSTATED_LIMIT_FRACTION:.0%} of each GPU XLA's compiler counts usable"
    kv_tokens = kv_tokens_for_memory(model, tp, pp, kv_bytes)
    if kv_tokens < max_seq:
        return None, Rejected(LayoutRejection.NO_KV_ROOM,
                              f"no room for the KV cache of one {max_seq}-token sequence after the weights: "
                              f"{fraction:.0%} of the {(usable - weights) / GiB:.1f} GiB left{room_note} holds "
                              f"{kv_tokens} tokens")
    # Sequences are at every point of their decode at once: on average a prompt and half the output.
    expected = -(-ctx_avg // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
    mem_slots = kv_tokens // expected  # >= 1: the pool holds max_seq >= ctx_avg, in whole blocks
    if len(pool.nodes) * max(n.gpus for n in pool.nodes) < gpus or not place(pool.nodes, tp, pp, 1, use_free=False):
        return None, Rejected(LayoutRejection.GROUP_NEVER_FITS,
                              f"a group of {pp} pod(s) x {tp} GPUs does not fit these nodes even when empty")
    max_slots = min(mem_slots, int(m["max_batch_slots"]))

    layer_us, layer_note = cal.layer_cost_us(tp)
    bw = device.hbm_bytes_per_s
    flops = cal.prefill_flops(device)
    hop_us, hop_bw = cal.pipeline_hop[0], float(m["pipeline_hop_bytes_per_s"])

    layers = model.num_layers / pp
    # Without peer access (no NVSwitch) the engine reduces through XLA's collectives.
    host = cal.host_step_ms(layers, tp, request.strategy if pool.nvswitch else "xla")
    host_ms = host[0] if host else 0.0

    def step(batch: int) -> tuple[float, str, float, int, float] | None:
        """(ms per token, all-reduce impl, µs per all-reduce, all-reduce bytes, the GPUs' ms of a stage)
        at ``batch`` per replica."""
        mem_ms = model.decode_bytes_per_step(batch, ctx_avg) / gpus / bw * 1e3
        comp_ms = 2 * model.param_count * batch / gpus / flops * 1e3
        nbytes = model.allreduce_bytes(batch)
        ar = cal.engine_allreduce(nbytes, tp, pool.nvswitch, request.strategy, model.dtype)
        if ar is None:
            return None
        gpu_ms = max(mem_ms, comp_ms) + layers * (layer_us + 2 * ar[1]) / 1e3
        hop_ms = 0.0 if pp == 1 else (hop_us + nbytes / hop_bw * 1e6) / 1e3
        return pp * (max(gpu_ms, host_ms) + hop_ms), ar[0], ar[1], nbytes, gpu_ms

    groups_free = len(place(pool.nodes, tp, pp, MAX_REPLICAS))
    first = step(1)
    if first is None:
        return None, Rejected(LayoutRejection.NO_ALLREDUCE_FIGURE,
                              f"all-reduce {request.strategy} has no calibrated figure for this message size")

    # Replicas and batch per replica, by objective (stated in the module docstring of the reasons).
    pinned = request.replicas
    if request.objective == "throughput":
        batch = max_slots
        dp = pinned if pinned is not None else max(groups_free, 1)
    elif request.objective == "latency":
        dp = pinned if pinned is not None else max(min(groups_free, request.concurrency), 1)
        batch = min(max_slots, math.ceil(request.concurrency / max(dp, 1)))
    else:
        dp = pinned if pinned is not None else max(min(groups_free, math.ceil(request.concurrency / max_slots)), 1)
        batch = min(max_slots, math.ceil(request.concurrency / max(dp, 1)))

    slo_ok, slo_note = True, ""
    if request.max_tpot_ms is not None:
        res = step(batch)
        if res is None or res[0] > request.max_tpot_ms:
            lo, hi = 0, batch  # largest batch meeting the SLO: step time grows with the batch
            while lo < hi:
                mid = (lo + hi + 1) // 2
                r = step(mid)
                if r is not None and r[0] <= request.max_tpot_ms:
                    lo = mid
                else:
                    hi = mid - 1
            if lo == 0:
                slo_ok = False
                slo_note = (f"SLO not met: even one sequence per replica takes {first[0]:.2f} ms/token "
                            f"> {request.max_tpot_ms:g} ms")
            else:
                slo_note = (f"batch per replica held to {lo} (from {batch}) to keep time per output token "
                            f"under {request.max_tpot_ms:g} ms")
                batch = lo
                if pinned is None and request.objective != "throughput":
                    dp = max(min(groups_free, math.ceil(request.concurrency / batch)), 1)
    slots = batch
    res = step(batch)
    assert res is not None  # batch <= a size that already had a figure
    ms, impl, ar_us, ar_bytes, gpu_ms = res
    host_note = "" if host is None else (
        f"the host's share of a stage step {host_ms:.2f} ms ({host[1]})"
        + (f": it sets the step, the GPUs' share being {gpu_ms:.2f} ms" if host_ms > gpu_ms else
           f", under the GPUs' {gpu_ms:.2f} ms"))
    group_tps = batch / ms * 1e3
    if request.target_tokens_per_s is not None and pinned is None:
        needed = math.ceil(request.target_tokens_per_s / group_tps)
        if needed > dp:
            dp = min(needed, max(groups_free, 1))
        if needed > groups_free:
            slo_ok = False
            slo_note = (f"target {request.target_tokens_per_s:g} tokens/s needs {needed} replicas; "
                        f"{groups_free} can be placed ({groups_free * group_tps:.0f} tokens/s)")
    ttft = 2 * model.param_count * request.input_tokens / (tp * flops) * 1e3 + first[0]
    if request.max_ttft_ms is not None and ttft > request.max_ttft_ms:
        slo_ok = False
        slo_note = (slo_note + "; " if slo_note else "") + (
            f"SLO not met: time to first token {ttft:.0f} ms > {request.max_ttft_ms:g} ms "
            f"(prefill at {flops / 1e12:.0f} TFLOP/s, stated model)")
    dp = min(dp, MAX_REPLICAS)
    placed = place(pool.nodes, tp, pp, dp)
    strategy = request.strategy
    if tp == 1:
        strategy = "xla"  # nothing to reduce
    elif not pool.nvswitch:
        strategy = "xla"
    layout = Layout(
        tp=tp, pp=pp, dp=len(placed), product=pool.product, memory_bytes=pool.memory_bytes,
        nvswitch=pool.nvswitch, strategy=strategy, allreduce_impl=impl if tp > 1 else "none",
        batch_slots=slots, active_batch=batch, max_seq_len=max_seq,
        kv_tokens=kv_tokens, kv_bytes_per_gpu=kv_tokens * model.kv_bytes_per_token_per_gpu(tp, pp),
        kv_memory_fraction=fraction,
        step_tokens=request.step_tokens if request.step_tokens is not None else DEFAULT_STEP_TOKENS,
        weight_bytes_per_gpu=weights,
        ms_per_token=max(round(ms, 3), MIN_MS_PER_TOKEN), tokens_per_s=round(group_tps * len(placed), 1),
        ttft_ms=round(ttft, 1), placement=tuple(placed),
    )
    return _Candidate(layout, slo_ok, slo_note, groups_free, dp, layer_note, host_note, ar_us, ar_bytes, usable,
                      expected, mem_slots, max_slots), None


# ---- choice --------------------------------------------------------------------------------------------
def _per_group_tps(c: _Candidate) -> float:
    return c.layout.active_batch / c.layout.ms_per_token * 1e3


def _key(c: _Candidate, objective: str) -> tuple[Any, ...]:
    """Sort key, best first: layouts that place every replica asked for, then those meeting the
    SLO, then the objective's figure for what is actually placed."""
    lay = c.layout
    short = lay.dp < c.replicas_wanted
    tps = _per_group_tps(c) * max(lay.dp, 1)
    if objective == "latency":
        return (short, not c.slo_ok, lay.ms_per_token, c.gpus, -tps, lay.tp, lay.pp, lay.product)
    if objective == "throughput":
        return (short, not c.slo_ok, -round(tps, 1), c.gpus, lay.ms_per_token, lay.tp, lay.pp, lay.product)
    per_gpu = tps / (lay.gpus_per_replica * max(lay.dp, 1))
    return (short, not c.slo_ok, -round(per_gpu, 2), lay.ms_per_token, lay.tp, lay.pp, lay.product)


def _choose(cands: list[_Candidate], objective: str) -> _Candidate:
    if objective == "latency":
        # Within LATENCY_TIE of the fastest the step model cannot tell layouts apart (its all-reduce
        # table is measured, with noise); the fewest pipeline stages and GPUs win there, then the
        # faster, then the larger KV pool (where the host's launch bounds the step, GPU kinds tie).
        best = min(cands, key=lambda c: _key(c, objective))
        near = [c for c in cands if _key(c, objective)[:2] == _key(best, objective)[:2]
                and c.layout.ms_per_token <= best.layout.ms_per_token * (1 + LATENCY_TIE)]
        return min(near, key=lambda c: (c.layout.pp, c.gpus, c.layout.ms_per_token, -c.layout.kv_tokens, c.layout.tp,
                                        c.layout.product))
    if objective == "balanced":
        fastest = min(c.layout.ms_per_token for c in cands if c.slo_ok) if any(c.slo_ok for c in cands) else None
        if fastest is not None:
            near = [c for c in cands if c.slo_ok and c.layout.ms_per_token <= BALANCED_LATENCY_FACTOR * fastest]
            return min(near, key=lambda c: _key(c, objective))
    return min(cands, key=lambda c: _key(c, objective))


def _why(c: _Candidate, objective: str) -> str:
    if objective == "latency":
        return (f"lowest time per output token; within {LATENCY_TIE:.0%} of it, the fewest pipeline stages "
                "and GPUs, then the largest KV pool")
    if objective == "throughput":
        return "most tokens/s from the free GPUs"
    return (f"most tokens/s per GPU within {BALANCED_LATENCY_FACTOR:g}x of the fastest time per output token")


def _alternatives(chosen: _Candidate, cands: list[_Candidate], rejected: list[Alternative],
                  objective: str) -> list[Alternative]:
    out: list[Alternative] = []
    lay = chosen.layout
    others = sorted((c for c in cands if c is not chosen), key=lambda c: _key(c, objective))
    for c in others[:3]:
        o = c.layout
        kind = LayoutRejection.RANKED_LOWER
        if o.dp < c.replicas_wanted <= lay.dp or (o.dp < c.replicas_wanted and o.dp == 0):
            kind = LayoutRejection.SHORT_OF_REPLICAS
            why = f"only {o.dp} of {c.replicas_wanted} replicas can be placed"
        elif not c.slo_ok and chosen.slo_ok:
            kind, why = LayoutRejection.SLO_NOT_MET, c.slo_note
        elif objective == "latency":
            why = f"slower: {o.ms_per_token:.2f} vs {lay.ms_per_token:.2f} ms/token"
        elif objective == "throughput":
            why = (f"fewer tokens/s: {_per_group_tps(c) * max(o.dp, 1):.0f} vs "
                   f"{_per_group_tps(chosen) * max(lay.dp, 1):.0f}")
        else:
            why = (f"{o.ms_per_token:.2f} ms/token, "
                   f"{_per_group_tps(c) / o.gpus_per_replica:.0f} tokens/s per GPU vs "
                   f"{_per_group_tps(chosen) / lay.gpus_per_replica:.0f}")
        out.append(Alternative(o.summary, o.ms_per_token, o.tokens_per_s, why, kind))
    # Groups that fit no node set even when empty say nothing once a layout was found.
    out += [a for a in _closest_misses(rejected) if a.kind is not LayoutRejection.GROUP_NEVER_FITS][:3]
    return out


def _closest_misses(rejected: list[Alternative]) -> list[Alternative]:
    """The rejected layouts worth showing: per TP size and product, the smallest pipeline depth."""
    seen: set[str] = set()
    out = []
    # Memory misses say the most about a model that is too big; "no such group fits" comes last.
    for alt in sorted(rejected, key=lambda a: a.kind is LayoutRejection.GROUP_NEVER_FITS):
        key = alt.layout.split("xPP")[0] + " " + alt.layout.rsplit(" ", 1)[-1]
        if key in seen:
            continue
        seen.add(key)
        out.append(alt)
    return out


def layout_fits(layout: Mapping[str, Any], inv: Inventory, request: Request) -> tuple[bool, str]:
    """Whether a layout from a DecodeService status (``tp``, ``pp``, ``dp``, ``gpuProduct``,
    ``placement``) can still be placed whole on the eligible nodes."""
    eligible, _ = inv.eligible(request.node_selector, request.tolerations)
    names = {n.name for n in eligible}
    gone = sorted({n for group in layout.get("placement") or [] for n in group} - names)
    if gone:
        return False, f"node(s) {', '.join(gone)} no longer Ready, schedulable and eligible"
    tp, pp, dp = int(layout["tp"]), int(layout["pp"]), int(layout["dp"])
    pool = [n for n in eligible if n.product == layout.get("gpuProduct")]
    placed = len(place(pool, tp, pp, dp))
    if placed < dp:
        return False, f"only {placed} of {dp} groups of {pp} pod(s) x {tp} GPU(s) fit the nodes now"
    return True, "fits"
