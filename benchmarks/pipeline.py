#!/usr/bin/env python3
"""Pipeline parallelism against tensor parallelism on two GPUs, in one run.

1. Correctness: a random fp32 checkpoint served through the scheduler (continuous batching, greedy
   and seeded sampling) by TP=1 on one GPU and by a PP=2 pipeline group (one process per GPU,
   joined with ``jax.distributed``, stage 0 sending every step's plan to stage 1 as serving does);
   the tokens must be identical.
2. Speed, Llama shape (default Llama-3-8B), bf16, random weights: for each number of concurrent
   streams, that many sequences seated at ``--context`` (``benchmarks/drive.py``: their random prompts
   computed in real chunk steps), then the serving loop timed (each step's blocks, plan and launch,
   then the previous step's tokens brought to the host) on the PP=2 group and on TP=2 in one process
   (the shipped all-reduce strategy).

A pipelined step runs the stages one after another over the whole batch: every step gives every
stream a token, with one stage's GPU busy at a time. Per row: ``tokens_per_s`` counts the tokens the
timed steps brought back over their wall time; ``ms_per_token`` is the time between two tokens of one
stream (streams / tokens_per_s, the mean step); ``step_ms`` the median step, ``tokens`` the tokens
counted. Both layouts run at least two decode rows (``batch_slots`` = max(streams, 2)).

    python benchmarks/pipeline.py --model llama3-8b --streams 1 8 32 64 --context 1024 \\
        --out benchmarks/results/pipeline-h200x2.json

Each part runs in its own processes (``--role``), so every measurement starts with free GPUs. With
``--cpu`` everything runs on host devices (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import platform
import runpy
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

PP = 2
# prompt, max_tokens, temperature, top_k, top_p, seed: more requests than slots, so they join and leave
CHECK_REQUESTS = [
    [[1, 40, 41, 42], 24, 0.0, 0, 1.0, 0],
    [[1, 7, 300, 12, 99, 5], 30, 0.9, 0, 1.0, 3],
    [[1, 250], 12, 1.1, 30, 1.0, 8],
    [[1, *range(3, 60)], 20, 0.0, 0, 1.0, 0],
    [[1, 77, 78], 28, 0.7, 0, 0.9, 1],
    [[1, 500, 501, 502, 503], 16, 0.0, 0, 1.0, 0],
    [[1, 9, 9, 9], 33, 0.0, 0, 1.0, 0],
]


# benchmarks/drive.py (engines built through EngineConfig, driven through the step contract), loaded on first use.
drive = functools.cache(lambda: SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("drive.py")))))
# benchmarks/result_file.py (provenance and writing), by its path: PYTHONSAFEPATH=1 keeps benchmarks/ off sys.path.
result_file = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("result_file.py"))))


def check_spec() -> Any:
    from switchyard.service.modelspec import preset

    return dataclasses.replace(preset("tiny"), name="pipeline-check", hidden_size=512, intermediate_size=1408,
                               num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64, dtype="float32")


def check_config() -> Any:
    """The check's configuration, the same for TP=1 and the group: serve's defaults at these sizes."""
    from switchyard.service.engine.engine import EngineConfig

    return EngineConfig(batch_slots=4, max_seq_len=128)


# ---- the parts, each in its own process -----------------------------------------------------------


def serve_requests(engine: Any) -> dict[str, list[int]]:
    """Run CHECK_REQUESTS through the scheduler on ``engine``; each request's tokens."""
    from switchyard.service.engine.request import GenerationRequest
    from switchyard.service.engine.sampling import SamplingParams
    from switchyard.service.engine.scheduler import Scheduler

    sched = Scheduler(engine, max_queue=64)
    tokens: dict[str, list[int]] = {}

    def on_event(e: Any) -> None:
        if e.token_id is not None:
            tokens.setdefault(e.request_id, []).append(e.token_id)

    for i, (prompt, n, temperature, top_k, top_p, seed) in enumerate(CHECK_REQUESTS):
        sched.submit(GenerationRequest(f"r{i}", prompt, n, SamplingParams(temperature, top_k, top_p, seed),
                                       ignore_eos=True, on_event=on_event))
    while sched.step() or sched.in_flight:
        pass
    return tokens


def role_check_reference(args: argparse.Namespace) -> None:
    from switchyard.service.engine.engine import Engine
    from switchyard.service.modelspec import ServingLayout

    engine = Engine.from_checkpoint(args.checkpoint, ServingLayout(tp=1), check_config(), progress=False)
    Path(args.result).write_text(json.dumps(serve_requests(engine)))


def group_layout(args: argparse.Namespace) -> Any:
    from switchyard.service.modelspec import ServingLayout

    return ServingLayout(tp=1, pp=PP, pipeline_stage=args.stage, coordinator=args.coordinator)


def role_check_stage(args: argparse.Namespace) -> None:
    from switchyard.service.engine.engine import Engine
    from switchyard.service.engine.pipeline_group import CommandChannel, LeaderEngine, follow, join

    layout = group_layout(args)
    join(layout)
    engine = Engine.from_checkpoint(args.checkpoint, layout, check_config(), progress=False)
    channel = CommandChannel.open(layout)
    if args.stage:
        follow(engine, channel)
        return
    leader = LeaderEngine(engine, channel)
    tokens = serve_requests(leader)
    leader.stop()
    Path(args.result).write_text(json.dumps(tokens))


def speed_config(args: argparse.Namespace, slots: int, **changes: Any) -> Any:
    """Room for the timed loop after seating (and the step launched ahead), every slot's whole table."""
    return drive().whole_tables_config(slots, args.context + args.steps + args.warmup + 8, dtype=args.dtype,
                                       **changes)


def timed_row(engine: Any, args: argparse.Namespace, layout: str, streams: int, t0: float) -> dict[str, Any]:
    """Seat ``streams`` sequences at ``--context`` on ``engine`` and time its decode steps."""
    kv = drive().books(engine)
    drive().seat(engine, kv, streams, args.context)
    timed = drive().time_decode(engine, kv, args.steps, args.warmup)
    return speed_row(layout, streams, engine.max_slots, timed.times, timed.tokens, time.perf_counter() - t0)


def speed_row(layout: str, streams: int, slots: int, times: list[float], tokens: int,
              setup_s: float) -> dict[str, Any]:
    tokens_per_s = tokens / sum(times)
    return {"layout": layout, "streams": streams, "batch_slots": slots,
            "ms_per_token": round(1000 * streams / tokens_per_s, 4), "tokens_per_s": round(tokens_per_s, 1),
            "step_ms": round(1000 * statistics.median(times), 4),
            "step_p90_ms": round(1000 * sorted(times)[int(0.9 * len(times))], 4),
            "steps": len(times), "tokens": tokens, "setup_s": round(setup_s, 1)}


def role_speed_stage(args: argparse.Namespace) -> None:
    from switchyard.service.engine.pipeline_group import CommandChannel, LeaderEngine, follow, join
    from switchyard.service.modelspec import preset

    spec = preset(args.model)
    layout = group_layout(args)
    join(layout)
    channel = CommandChannel.open(layout)
    rows = []
    for streams in args.streams:
        t0 = time.perf_counter()
        # Every stage builds the same engine: one program over both stages' devices.
        engine = drive().random_engine(spec, speed_config(args, max(streams, 2)), pp=PP)
        if args.stage:
            follow(engine, channel)
        else:
            leader = LeaderEngine(engine, channel)
            rows.append(timed_row(leader, args, f"PP{PP}", streams, t0))
            leader.stop()
            print(json.dumps(rows[-1]), flush=True)
        del engine
        gc.collect()
    if not args.stage:
        Path(args.result).write_text(json.dumps(rows))


def role_speed_tp(args: argparse.Namespace) -> None:
    import jax
    from switchyard.service.modelspec import preset

    spec = preset(args.model)
    rows = []
    for streams in args.streams:
        t0 = time.perf_counter()
        config = speed_config(args, max(streams, 2), strategy=args.strategy)
        engine = drive().random_engine(spec, config, tp=PP, devices=jax.devices()[:PP])
        rows.append(timed_row(engine, args, f"TP{PP}", streams, t0))
        rows[-1]["strategy"] = args.strategy
        print(json.dumps(rows[-1]), flush=True)
        del engine
        gc.collect()
    Path(args.result).write_text(json.dumps(rows))


ROLES = {"check-reference": role_check_reference, "check-stage": role_check_stage,
         "speed-stage": role_speed_stage, "speed-tp": role_speed_tp}


# ---- the driver ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def part_env(args: argparse.Namespace, gpus: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    if args.cpu:
        # The caller's XLA flags kept; the device count last, so it is the one XLA takes.
        flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={len(gpus.split(','))}"
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip())
    else:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    return env


def part_args(args: argparse.Namespace, role: str, result: Path, **kw: Any) -> list[str]:
    cmd = [sys.executable, __file__, "--role", role, "--result", str(result), "--model", args.model,
           "--context", str(args.context), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--dtype", args.dtype, "--strategy", args.strategy, "--streams", *map(str, args.streams)]
    for key, value in kw.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    return cmd


def run_parts(commands: list[tuple[list[str], dict[str, str]]], timeout: float) -> None:
    procs = [subprocess.Popen(cmd, env=env) for cmd, env in commands]
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes):
        raise SystemExit(f"a part failed (exit codes {codes}): {commands[0][0][3]}")


def run_group(args: argparse.Namespace, role: str, result: Path, extra_env: dict[str, str], **kw: Any) -> None:
    coordinator = f"127.0.0.1:{free_port()}"
    run_parts([(part_args(args, role, result, stage=stage, coordinator=coordinator, **kw),
                part_env(args, str(stage), **extra_env)) for stage in range(PP)], args.timeout)


def compare(args: argparse.Namespace) -> int:
    from switchyard.service.engine.checkpoint import write_checkpoint

    result: dict[str, Any] = {
        **result_file.provenance(device_name(args), script=__file__),
        "host": platform.node(), "model": args.model, "dtype": args.dtype, "context": args.context,
    }
    with tempfile.TemporaryDirectory(prefix="switchyard-pipeline-") as tmp:
        work = Path(tmp)
        if not args.skip_check:
            checkpoint = write_checkpoint(check_spec(), work / "check-model", progress=False)
            exact = {"JAX_DEFAULT_MATMUL_PRECISION": "highest"}  # fp32 products on both layouts
            run_parts([(part_args(args, "check-reference", work / "ref.json", checkpoint=checkpoint),
                        part_env(args, "0", **exact))], args.timeout)
            run_group(args, "check-stage", work / "pp.json", exact, checkpoint=checkpoint)
            ref = json.loads((work / "ref.json").read_text())
            got = json.loads((work / "pp.json").read_text())
            same = ref == got
            result["check"] = {"model": dataclasses.asdict(check_spec()), "requests": len(CHECK_REQUESTS),
                               "tokens": sum(map(len, ref.values())), "identical_to_tp1": same}
            print(f"check: PP={PP} group vs TP=1, {result['check']['tokens']} tokens of {len(ref)} requests: "
                  f"{'identical' if same else 'DIFFERENT'}", flush=True)
            if not same:
                result["check"]["reference"], result["check"]["pipeline"] = ref, got
        run_group(args, "speed-stage", work / "pp-speed.json", {})
        run_parts([(part_args(args, "speed-tp", work / "tp-speed.json"), part_env(args, "0,1"))], args.timeout)
        rows = json.loads((work / "pp-speed.json").read_text()) + json.loads((work / "tp-speed.json").read_text())
    by = {(r["layout"], r["streams"]): r for r in rows}
    for streams in args.streams:
        pp, tp = by[f"PP{PP}", streams], by[f"TP{PP}", streams]
        pp["throughput_vs_tp"] = round(pp["tokens_per_s"] / tp["tokens_per_s"], 3)
        pp["latency_vs_tp"] = round(pp["ms_per_token"] / tp["ms_per_token"], 3)
        print(f"streams {streams:3d}: PP{PP} {pp['ms_per_token']:7.3f} ms/token {pp['tokens_per_s']:8.1f} tok/s | "
              f"TP{PP} {tp['ms_per_token']:7.3f} ms/token {tp['tokens_per_s']:8.1f} tok/s | "
              f"PP/TP throughput {pp['throughput_vs_tp']:.2f}x", flush=True)
    result["rows"] = rows
    if args.out:
        result_file.write_result(args.out, result)
    return 0 if result.get("check", {}).get("identical_to_tp1", True) else 1


def device_name(args: argparse.Namespace) -> str:
    if args.cpu:
        return f"{PP}x cpu"
    out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    names = out.stdout.split("\n")[:PP] if out.returncode == 0 else ["unknown GPU"]
    return f"{PP}x {names[0].strip()}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--strategy", default="auto", help="TP=2's all-reduce strategy")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--cpu", action="store_true", help="host devices instead of GPUs (smoke test)")
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds each part may take")
    parser.add_argument("--out", help="result JSON path")
    # the parts
    parser.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role:
        try:
            ROLES[args.role](args)
        except BaseException:
            if args.role.endswith("stage"):  # a group member: no shutdown barrier with a broken group
                import traceback

                from switchyard.service.engine.pipeline_group import exit_now

                traceback.print_exc()
                exit_now(1)
            raise
        return 0
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
