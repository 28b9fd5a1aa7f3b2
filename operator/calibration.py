"""Calibration data for the planner: HBM bandwidth per device, per-layer decode cost, all-reduce tables.

The numbers live in ``calibration.json`` next to this file, each with its provenance ("measured" on
which device by which benchmark, or "stated model"). :func:`from_results` rebuilds that file from the
benchmark JSON files under ``benchmarks/results/current/`` (the measurements the product reads; older
and experimental ones lie in ``benchmarks/results/archive/``, which this never reads):

    {"command": ..., "device": "NVIDIA H200", "date": ..., "rows": [...]}

with decode rows ``model,tp,batch,context,strategy,ms_per_token,tokens_per_s,roofline_ms,
fraction_of_roofline`` (and ``host_launch_ms``, the host's time to launch a step, where recorded),
all-reduce rows ``impl,gpus,bytes,dtype,us`` and pipeline rows ``layout (PP<n>),streams,batch_slots,
step_ms,ms_per_token`` (model and context from the file). Pure except for the file loaders at the edges.
"""

from __future__ import annotations

import argparse
import bisect
import copy
import dataclasses
import functools
import json
import math
import statistics
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from switchyard.kernels import selection

CALIBRATION_FILE = Path(__file__).resolve().parent / "calibration.json"
IMPLS = ("xla", "oneshot", "twoshot")
# The engine's all-reduce + residual + RMSNorm (selection.FUSED_IMPLS) by the plain all-reduce whose
# exchange it runs, the only ones measured here: ``fused`` is one-shot's exchange with the norm in
# the same kernel, ``twoshot`` and ``xla`` are followed by XLA's norm (stated model).
FUSED_TIMED_AS = {"xla": "xla", "fused": "oneshot", "twoshot": "twoshot"}
# What stands in for one of our implementations where it was not measured (torch on the same GPUs).
STAND_INS = {"xla": "torch_nccl", "oneshot": "symm_mem_oneshot", "twoshot": "symm_mem_twoshot"}
# A decode benchmark records baselines next to the engine in one file: XLA's attention ops beside the
# kernel the engine ships (rows without the field predate the kernel and used XLA's ops) ...
SHIPPED_ATTENTION = "kernel"
# ... and the step without communication (``none``) beside the engine's all-reduce strategies
# (selection.STRATEGIES). Baselines are no checks.
# The engine's narrowest decode width (service/engine/step_policy.MIN_BATCH_WIDTH, which imports
# numpy: the operator does not): a row that ran one sequence as one row ran a program the engine
# never runs (``min_batch_bucket`` 1).
ENGINE_MIN_WIDTH = 2
# A decode check whose host launch took this share of its step or more timed the host, not the GPUs
# (the step's launch ends about when the GPUs finish the step before it).
HOST_BOUND_SHARE = 0.8
# The host's launch cost at TP=1, where the all-reduce strategy changes nothing.
ANY_STRATEGY = "*"


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    hbm_bytes_per_s: float
    kind: str  # "measured" or "stated model"
    source: str


@dataclasses.dataclass(frozen=True)
class Calibration:
    raw: Mapping[str, Any]

    # ---- devices ------------------------------------------------------------------------------
    def device(self, product: str) -> Device:
        """The calibrated device whose ``match`` strings occur in a GFD product label."""
        devices = self.raw["devices"]
        upper = product.upper()
        # Longest match first, so "H100 NVL" style names could get their own entry later.
        candidates = sorted(((m, name) for name, d in devices.items() for m in d.get("match", [])),
                            key=lambda pair: -len(pair[0]))
        for match, name in candidates:
            if match.upper() in upper:
                return self._device(name)
        return self._device("default")

    def _device(self, name: str) -> Device:
        d = self.raw["devices"][name]
        return Device(name, float(d["hbm_bytes_per_s"]), d["kind"], d["source"])

    @functools.cached_property
    def _layer_costs(self) -> dict[int, float]:
        """Per TP size, the fixed time a decode step spends per layer on the GPUs beyond reading its
        bytes and its all-reduces (launch gaps, norms, RoPE, the KV write, latency-bound attention), in
        µs: from each measured decode check the host did not bound, its step time less the HBM roofline
        of its bytes per GPU and the all-reduce time this table predicts, over the model's layers; the
        median per TP size."""
        from switchyard.service.modelspec import PRESETS  # the only service module we may use

        by_tp: dict[int, list[float]] = {}
        for check in self.raw["decode"]["checks"]:
            spec = PRESETS.get(check["model"])
            if spec is None or _host_bound(check):
                continue  # no built-in shape to give a roofline, or a step timed by its launch
            tp, batch = int(check["tp"]), int(check["batch"])
            device = self.device(check["device"])
            roofline_ms = spec.decode_bytes_per_step(batch, int(check["context"])) / tp / device.hbm_bytes_per_s * 1e3
            ar = self.engine_allreduce(spec.allreduce_bytes(batch), tp, nvswitch=True,
                                       strategy=check.get("strategy", "xla"), dtype=spec.dtype)
            ar_ms = 2 * spec.num_layers * (ar[1] if ar else 0.0) / 1e3
            beyond_ms = float(check["ms_per_token"]) - roofline_ms - ar_ms
            by_tp.setdefault(tp, []).append(beyond_ms * 1e3 / spec.num_layers)
        if not by_tp:
            raise ValueError("the calibration has no usable decode check")
        return {tp: max(statistics.median(v), 0.0) for tp, v in sorted(by_tp.items())}

    def layer_cost_us(self, tp: int) -> tuple[float, str]:
        """(µs per layer, provenance) of a decode step's fixed cost on the GPUs at a TP size: measured
        where checks exist, a stated model around them (:func:`_per_tp`)."""
        return _per_tp(self._layer_costs, tp)

    @functools.cached_property
    def _host_costs(self) -> tuple[dict[str, dict[int, float]], float]:
        """What the host spends on a decode step, from the checks that recorded their launch: per
        strategy and TP size, µs per layer to launch a step (its ``host_launch_ms`` over the model's
        layers, the median; at TP=1 over every strategy, there being nothing to reduce); and the ms a
        step the host bound took beyond its launch (the serving loop's own work, median over such
        checks, 0 without one)."""
        from switchyard.service.modelspec import PRESETS

        per_layer: dict[str, dict[int, list[float]]] = {}
        beyond: list[float] = []
        for check in self.raw["decode"]["checks"]:
            spec = PRESETS.get(check["model"])
            if spec is None or check.get("host_launch_ms") is None:
                continue
            tp = int(check["tp"])
            strategy = ANY_STRATEGY if tp == 1 else str(check.get("strategy", "xla"))
            launch_ms = float(check["host_launch_ms"])
            per_layer.setdefault(strategy, {}).setdefault(tp, []).append(launch_ms * 1e3 / spec.num_layers)
            if _host_bound(check):
                beyond.append(float(check["ms_per_token"]) - launch_ms)
        medians = {s: {tp: statistics.median(v) for tp, v in sorted(by_tp.items())} for s, by_tp in per_layer.items()}
        return medians, max(statistics.median(beyond), 0.0) if beyond else 0.0

    def host_step_ms(self, layers: float, tp: int, strategy: str) -> tuple[float, str] | None:
        """(ms, provenance) the host takes per decode step of ``layers`` layers at a TP size: their
        launch (µs per layer as measured for the strategy, or over every strategy where that one was
        not measured at TP>1; a stated model around the measured sizes, :func:`_per_tp`) and the
        serving loop's work beyond it. None where no check recorded its launch."""
        medians, beyond_ms = self._host_costs
        table = dict(medians.get(strategy, {}))
        if not table:
            pooled: dict[int, list[float]] = {}
            for name, by_tp in medians.items():
                for size, us in by_tp.items():
                    if name != ANY_STRATEGY:
                        pooled.setdefault(size, []).append(us)
            table = {size: statistics.median(v) for size, v in pooled.items()}
        table.update(medians.get(ANY_STRATEGY, {}))
        if not table:
            return None
        us, note = _per_tp(table, tp)
        return layers * us / 1e3 + beyond_ms, (f"launch {us:.1f} us per layer, {note}; {beyond_ms:.2f} ms a step "
                                                f"beyond it")

    @property
    def models(self) -> Mapping[str, Any]:
        return self.raw["models"]

    def stage_ms(self, spec: Any, micro_batch: int, context: int, tp: int, pp: int, device: Device,
                 strategy: str = "auto") -> float:
        """Predicted time of one pipeline stage's share of a decode step (its layers' weights and KV,
        their fixed cost, its tensor-parallel all-reduces; or the host's launch of it, if longer),
        without the hop to the next stage."""
        mem_ms = spec.decode_bytes_per_step(micro_batch, context) / (tp * pp) / device.hbm_bytes_per_s * 1e3
        ar = self.engine_allreduce(spec.allreduce_bytes(micro_batch), tp, nvswitch=True, strategy=strategy,
                                   dtype=spec.dtype)
        layers = spec.num_layers / pp
        gpu_ms = mem_ms + layers * (self.layer_cost_us(tp)[0] + 2 * (ar[1] if ar else 0.0)) / 1e3
        host = self.host_step_ms(layers, tp, strategy)
        return max(gpu_ms, host[0]) if host else gpu_ms

    @functools.cached_property
    def pipeline_hop(self) -> tuple[float, str]:
        """(µs, provenance) a pipeline tick costs beyond its stage's work: the hand-over of the
        activations and the tick's own overhead. Measured where pipeline checks exist: each tick's
        measured time less the stage time this calibration predicts, median over the checks."""
        from switchyard.service.modelspec import PRESETS

        section = self.raw.get("pipeline") or {}
        hops = []
        for check in section.get("checks", []):
            spec = PRESETS.get(check["model"])
            if spec is None:
                continue
            pp, tp = int(check["pp"]), int(check["tp"])
            micro_batch = max(int(check["batch_slots"]) // pp, 1)
            stage = self.stage_ms(spec, micro_batch, int(check["context"]), tp, pp, self.device(check["device"]))
            hops.append((float(check["step_ms"]) - stage) * 1e3)
        if not hops:
            return float(self.models["pipeline_hop_us"]), "stated model"
        return max(statistics.median(hops), 0.0), (f"measured: median over {len(hops)} pipeline checks "
                                                   f"(stages on one node), {section.get('source', '?')}")

    def prefill_flops(self, device: Device) -> float:
        table = self.models["prefill_flops_per_s"]
        return float(table.get(device.name, table["default"]))

    # ---- all-reduce ---------------------------------------------------------------------------
    def allreduce_us(self, impl: str, nbytes: int, gpus: int, beyond_table: bool = False) -> float | None:
        """Estimated latency of one all-reduce of ``nbytes`` over ``gpus`` GPUs of one NVSwitch
        domain (from the table measured at that count, else scaled from the nearest count below), or
        None where the table offers no figure (oneshot beyond its largest size, unless
        ``beyond_table``: where the kernels' chooser runs one-shot there, its figure is extrapolated)."""
        if gpus <= 1:
            return 0.0
        measured_gpus, table = self._allreduce_table(impl, gpus)
        if not table:
            return None
        sizes = [float(s) for s, _ in table]
        times = [float(t) for _, t in table]
        if impl == "oneshot" and nbytes > sizes[-1] and not beyond_table:
            return None
        t_at = _interpolate(sizes, times, max(nbytes, 1))
        latency = times[0]
        bandwidth_part = max(t_at - latency, 0.0)
        doublings = max(math.log2(gpus / measured_gpus), 0.0)
        growth = float(self.models["latency_growth_per_doubling"][impl])
        latency *= 1.0 + growth * doublings
        bandwidth_part *= _bytes_factor(impl, gpus) / _bytes_factor(impl, measured_gpus)
        return latency + bandwidth_part

    def allreduce_counts(self) -> list[int]:
        """The GPU counts the all-reduce tables were measured at."""
        ar = self.raw["allreduce"]
        return sorted({int(ar["gpus"]), *(int(n) for n in ar.get("at_gpus", {}))})

    def allreduce_basis(self, gpus: int) -> int:
        """The measured GPU count an estimate for ``gpus`` GPUs starts from: ``gpus`` itself where
        measured, else the nearest measured count below (the smallest above all of them)."""
        counts = self.allreduce_counts()
        return max((c for c in counts if c <= gpus), default=counts[0])

    def _allreduce_table(self, impl: str, gpus: int) -> tuple[int, list | None]:
        """The GPU count and ``impl``'s table to estimate ``gpus`` GPUs from: the largest measured
        count up to ``gpus`` whose table has ``impl`` (the smallest measured count below all of them)."""
        ar = self.raw["allreduce"]
        counts = {int(ar["gpus"]): ar["us"]}
        counts.update({int(n): entry["us"] for n, entry in ar.get("at_gpus", {}).items()})
        having = sorted(n for n, tables in counts.items() if tables.get(impl))
        if not having:
            return int(ar["gpus"]), None
        n = max((c for c in having if c <= gpus), default=having[0])
        return n, counts[n][impl]

    def engine_allreduce(self, nbytes: int, gpus: int, nvswitch: bool, strategy: str = "auto",
                         dtype: str = "bfloat16") -> tuple[str, float] | None:
        """(implementation, µs) of one tensor-parallel all-reduce as the engine runs it: fused with
        the residual add and RMSNorm, the implementation picked by the kernels' own chooser
        (``switchyard.kernels.selection.choose_fused``) for a pod of ``gpus`` GPUs with the default
        workspaces (peer access needs an NVSwitch domain). Timed by the table of the exchange it
        runs (``FUSED_TIMED_AS``), past the table's end as ``allreduce_us`` extrapolates; None where
        that table is empty."""
        if gpus <= 1:
            return ("xla", 0.0)
        cap = selection.Capability.node_group(gpus, peer_access=nvswitch)
        impl = selection.choose_fused(strategy, nbytes, gpus, dtype, cap)
        us = self.allreduce_us(FUSED_TIMED_AS[impl], nbytes, gpus, beyond_table=True)
        if us is None:
            return None
        if not nvswitch:
            us *= float(self.models["pcie_allreduce_factor"])
        return impl, us


def _host_bound(check: Mapping[str, Any]) -> bool:
    launch = check.get("host_launch_ms")
    return launch is not None and float(launch) >= HOST_BOUND_SHARE * float(check["ms_per_token"])


def _per_tp(measured_at: Mapping[int, float], tp: int) -> tuple[float, str]:
    """(µs, provenance) at a TP size of a per-layer cost measured at some sizes: the measured figure
    where there is one; around them a stated model: the cost never falls as the group grows (more GPUs
    add synchronisation and launches and remove no per-layer work; a lower figure at a larger TP size
    is the spread of the checks), and beyond the largest measured TP size it grows linearly in
    log2(TP) as it did between the two largest, if it grew."""
    measured = sorted(measured_at)
    floor = {t: max(measured_at[u] for u in measured if u <= t) for t in measured}
    if tp in measured_at:
        if floor[tp] == measured_at[tp]:
            return measured_at[tp], f"measured at TP={tp}"
        below = max(u for u in measured if u < tp and measured_at[u] == floor[tp])
        return floor[tp], (f"TP={tp} measured {measured_at[tp]:.1f} us, held at TP={below}'s (stated model: no "
                           f"fall with TP)")
    slope = 0.0
    if len(measured) >= 2:
        t1, t2 = measured[-2], measured[-1]
        slope = max((floor[t2] - floor[t1]) / math.log2(t2 / t1), 0.0)
    base = max((t for t in measured if t <= tp), default=measured[0])
    value = floor[base] + slope * math.log2(tp / base)
    return value, (f"TP={tp} extrapolated from TP={base} by {slope:+.1f} us per doubling of TP "
                   f"(stated model)")


def _bytes_factor(impl: str, gpus: int) -> float:
    if impl == "oneshot":
        return float(gpus - 1)
    return 2.0 * (gpus - 1) / gpus


def _interpolate(sizes: list[float], times: list[float], nbytes: float) -> float:
    """Log-log interpolation inside the table; flat below it; linear in bytes above it."""
    if nbytes <= sizes[0]:
        return times[0]
    if nbytes >= sizes[-1]:
        if len(sizes) == 1:
            return times[-1]
        slope = (times[-1] - times[-2]) / (sizes[-1] - sizes[-2])
        return times[-1] + slope * (nbytes - sizes[-1])
    i = bisect.bisect_right(sizes, nbytes)
    x0, x1, y0, y1 = sizes[i - 1], sizes[i], times[i - 1], times[i]
    f = (math.log(nbytes) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))


@functools.cache
def _load_default() -> Calibration:
    return Calibration(json.loads(CALIBRATION_FILE.read_text()))


def load(path: str | Path | None = None) -> Calibration:
    if path is None:
        return _load_default()
    return Calibration(json.loads(Path(path).read_text()))


# ---- regeneration from benchmarks/results/current/*.json -------------------------------------------
def device_name(device: str, devices: Mapping[str, Any]) -> str | None:
    for name, d in devices.items():
        if any(m.upper() in device.upper() for m in d.get("match", [])):
            return name
    return None


def _where(result: Mapping[str, Any], name: str = "") -> str:
    command = result.get("command", "?")
    if isinstance(command, list):
        command = " && ".join(command)
    return f"{name or '?'} ({result.get('device', '?')}, {result.get('date', '?')}): {command}"


def _allreduce_tables(tables: Mapping[str, Mapping[int, list[float]]],
                      sources: Mapping[str, str]) -> tuple[dict[str, list[list[float]]], str]:
    """One GPU count's rows as the planner's tables (median per size; a stand-in where one of ours
    was not measured) and where each came from."""
    us: dict[str, list[list[float]]] = {}
    labels = []
    for impl in IMPLS:
        chosen = impl if impl in tables else STAND_INS[impl] if STAND_INS[impl] in tables else None
        if chosen is None:
            continue
        us[impl] = [[size, round(statistics.median(v), 3)] for size, v in sorted(tables[chosen].items())]
        label = impl if chosen == impl else f"{impl} = {chosen} (stand-in)"
        labels.append(f"{label} from {sources[chosen]}")
    return us, "; ".join(labels)


def from_results(results: Iterable[Mapping[str, Any]], base: Mapping[str, Any],
                 names: Iterable[str] = ()) -> dict[str, Any]:
    """A new calibration: ``base`` with its measured entries replaced by what the result files hold.

    * all-reduce rows (``impl,gpus,bytes,dtype,us``, bf16), per GPU count (the smallest in ``us``, the
      others in ``at_gpus``): our own implementations
      (``xla`` = JAX psum, ``oneshot``, ``twoshot``) by name, median per size; where one of them was
      not measured, its stand-in (``torch_nccl``, ``symm_mem_oneshot``, ``symm_mem_twoshot``),
      labelled as such; other rows (fused, norm variants, auto) are not planner inputs;
    * decode rows (``model,tp,batch,context,strategy,ms_per_token,...``) of the engine's configuration
      (its attention kernel, a strategy it ships, no narrower than its narrowest width, 16-bit weights and
      KV) become the decode checks the
      planner derives its per-layer cost from; for each configuration and GPU (as ``devices`` names it)
      the newest result file wins (an older engine's figures are superseded), rows of that file are kept;
    * ``copy_bandwidth_bytes_per_s`` of the newest result on a device sets that device's HBM figure.

    Every result given is used except the baseline rows named above (measured beside the engine, in
    the same run, for comparison). Anything the result files do not cover stays as it was, with its
    provenance.
    """
    out = copy.deepcopy(dict(base))
    results = list(results)
    labels = list(names) or [f"result {i}" for i in range(len(results))]
    ordered = sorted(zip(labels, results, strict=True), key=lambda pair: str(pair[1].get("date", "")))
    tables: dict[int, dict[str, dict[int, list[float]]]] = {}  # by GPU count, then implementation
    table_source: dict[int, dict[str, str]] = {}
    newest_check: dict[tuple[Any, ...], tuple[str, list[dict[str, Any]]]] = {}
    for label, result in ordered:
        where = _where(result, label)
        device = str(result.get("device", ""))
        if result.get("copy_bandwidth_bytes_per_s"):
            name = device_name(device, out["devices"])
            if name is not None:
                out["devices"][name].update(
                    hbm_bytes_per_s=float(result["copy_bandwidth_bytes_per_s"]), kind="measured",
                    source=f"copy_bandwidth_bytes_per_s of {where}")
        for row in result.get("rows", []):
            if "impl" in row and "us" in row:
                if str(row.get("dtype", "bfloat16")) not in ("bfloat16", "bf16"):
                    continue
                impl, gpus = str(row["impl"]).lower(), int(row["gpus"])
                per_size = tables.setdefault(gpus, {}).setdefault(impl, {})
                per_size.setdefault(int(row["bytes"]), []).append(float(row["us"]))
                table_source.setdefault(gpus, {})[impl] = where
            elif "step_ms" in row and str(row.get("layout", "")).startswith("PP"):
                pp = int(str(row["layout"])[2:])
                check = {"model": row.get("model", result.get("model")), "pp": pp, "tp": int(row.get("tp", 1)),
                         "streams": int(row["streams"]), "batch_slots": int(row["batch_slots"]),
                         "context": int(row.get("context", result.get("context", 0))),
                         "step_ms": float(row["step_ms"]), "ms_per_token": float(row["ms_per_token"]),
                         "device": device, "source": where}
                key = ("pipeline", check["model"], pp, check["tp"], check["streams"], check["context"])
                newest_check[key] = (where, [check])
            elif "ms_per_token" in row and "model" in row:
                if (row.get("attention", "xla") != SHIPPED_ATTENTION
                        or row.get("strategy", "xla") not in selection.STRATEGIES):
                    continue  # a baseline: XLA's attention ops or no communication
                if max(int(row.get("batch", 1)), int(row.get("min_batch_bucket", ENGINE_MIN_WIDTH))) < ENGINE_MIN_WIDTH:
                    continue  # narrower than the engine runs
                if row.get("weights", "bf16") != "bf16" or row.get("kv_cache", "auto") != "auto":
                    continue  # FP8 weights or KV: the planner prices a model's 16-bit bytes
                gpu = device_name(device, out["devices"]) or device
                key = (*(row.get(k) for k in ("model", "tp", "batch", "context", "strategy")), gpu)
                check = {k: row[k] for k in ("model", "tp", "batch", "context", "strategy", "ms_per_token",
                                             "host_launch_ms") if row.get(k) is not None}
                check.update(device=device, source=where)
                if key in newest_check and newest_check[key][0] == where:
                    newest_check[key][1].append(check)
                else:
                    newest_check[key] = (where, [check])  # a newer file supersedes
    for rank, gpus in enumerate(sorted(tables)):
        us, sources = _allreduce_tables(tables[gpus], table_source[gpus])
        if not sources:
            continue
        if rank == 0:  # the smallest count measured: the base the others extrapolate from where unmeasured
            out["allreduce"]["us"].update(us)
            out["allreduce"].update(gpus=gpus, kind="measured", source=sources)
        else:
            out["allreduce"].setdefault("at_gpus", {})[str(gpus)] = {"us": us, "source": sources}
    ordered_checks = sorted(newest_check.items(), key=lambda kv: str(kv[0]))
    checks = [c for key, (_, rows) in ordered_checks if key[0] != "pipeline" for c in rows]
    if checks:
        out["decode"]["checks"] = checks
        out["decode"]["kind"] = "measured"
    pipeline = [c for key, (_, rows) in ordered_checks if key[0] == "pipeline" for c in rows]
    if pipeline:
        out["pipeline"] = {
            "kind": "measured",
            "source": "; ".join(sorted({c["source"] for c in pipeline})),
            "note": "pipeline ticks as benchmarked (benchmarks/pipeline.py, one process per stage); the planner "
                    "derives the cost of a hop between stages from these: measured tick time less the stage "
                    "time it predicts",
            "checks": pipeline,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="rebuild the planner calibration from benchmark results")
    parser.add_argument("--results", type=Path, default=Path("benchmarks/results/current"))
    parser.add_argument("--out", type=Path, default=CALIBRATION_FILE)
    args = parser.parse_args(argv)
    files = sorted(args.results.glob("*.json"))
    results = [json.loads(f.read_text()) for f in files]
    new = from_results(results, json.loads(CALIBRATION_FILE.read_text()),
                       names=[str(f) for f in files])
    args.out.write_text(json.dumps(new, indent=2) + "\n")
    print(f"{args.out}: from {len(files)} result file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
