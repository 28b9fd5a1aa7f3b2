#!/usr/bin/env python3
"""Start-up: from process start to gRPC health SERVING, with an empty compile cache and then with the
cache that first start filled, in one run, on one checkpoint; and what the start-up log says.

``switchyard serve`` runs as a pod runs it (a subprocess on a checkpoint folder on local disk,
``--compile-cache DIR``). For each start: the seconds to SERVING, when ModelInfo's start-up phase
changed (loading weights, compiling step programs, ready), what ModelInfo says the compile cache gave,
a greedy request's tokens (a start on loaded programs must answer as one that compiled them), and
the start-up log's WARNING and ERROR lines, grouped by message. Targets (Llama-3-8B shape, weights on
local disk): warm SERVING <= 30 s at TP=1, <= 45 s at TP=2; cold no slower than before; no WARNING line.

    python benchmarks/startup.py --preset llama3-8b --tp 1 --batch-slots 64 --max-seq-len 4352

Writes benchmarks/results/current/startup-<device>[-tp<N>].json ``{"command","device","date","commit",...}``.
"""

from __future__ import annotations

import argparse
import os
import re
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# benchmarks/result_file.py (provenance and writing), by its path: PYTHONSAFEPATH=1 keeps benchmarks/ off sys.path.
result_file = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("result_file.py"))))
# A C++ (absl) log line: severity letter, MMDD, time.
CPP_LINE = re.compile(r"^([WEF])\d{4} \d\d:\d\d:\d\d")
# Python's: a logger's level name as a word, or a warnings-module line ("...: UserWarning: ...").
PY_LEVEL = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|\b[A-Z]\w*Warning: ")
NUMBER = re.compile(r"[0-9]+(\.[0-9]+)?")
WEIGHTS_LOADED = re.compile(r"loading \S+: done, .* in [0-9.]+ s")
PROMPT = "The compile cache keeps every step program of"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def switchyard(*args: str) -> list[str]:
    return [sys.executable, "-m", "switchyard.cli.main", *args]


def make_checkpoint(preset: str, folder: Path) -> dict[str, Any]:
    if not (folder / "config.json").is_file():
        t0 = time.perf_counter()
        subprocess.run(switchyard("make-checkpoint", "--preset", preset, "--out", str(folder)), check=True,
                       stdout=subprocess.DEVNULL)
        seconds = time.perf_counter() - t0
    else:
        seconds = None
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    return {"preset": preset, "bytes": size, "write_seconds": seconds}


def classify(log: str) -> dict[str, Any]:
    """The log's WARNING/ERROR lines (C++ and Python), grouped by their message with numbers blanked."""
    groups: Counter[str] = Counter()
    levels: Counter[str] = Counter()
    for line in log.splitlines():
        cpp = CPP_LINE.match(line)
        py = None if cpp else PY_LEVEL.search(line)
        if not cpp and not py:
            continue
        level = {"W": "WARNING", "E": "ERROR", "F": "FATAL"}[cpp[1]] if cpp else py[1] or "WARNING"
        levels[level] += 1
        message = line.split("] ", 1)[-1] if cpp else line[py.start():]
        groups[f"{level}: {NUMBER.sub('N', message)[:160]}"] += 1
    return {"lines": len(log.splitlines()), "by_level": dict(levels), "messages": dict(groups.most_common(20))}


def start(label: str, model: Path, cache: Path, args: argparse.Namespace, work: Path,
          env: dict[str, str] | None = None) -> dict[str, Any]:
    """One start of ``serve`` to SERVING, a greedy request, a SIGTERM stop; what it took and logged.
    ``env``: variables set for this start only."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from switchyard.service.api.client import DecodeClient
    from switchyard.service.proto import decode_pb2

    port = free_port()
    log_path = work / f"serve-{label.replace(' ', '-')}.log"
    cmd = switchyard("serve", "--model-path", str(model), "--host", "127.0.0.1", "--port", str(port),
                     "--http-port", str(free_port()),
                     "--tp", str(args.tp), "--batch-slots", str(args.batch_slots), "--max-seq-len",
                     str(args.max_seq_len), "--compile-cache", str(cache), "--grace-period", "5")
    target = f"127.0.0.1:{port}"
    with open(log_path, "w") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    phases: dict[str, float] = {}
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
    client = DecodeClient(target)
    serving_s = None
    try:
        while time.perf_counter() - t0 < args.timeout:
            if proc.poll() is not None:
                break
            try:
                info = client.model_info(timeout=2)
                phases.setdefault(info.startup or "unknown", round(time.perf_counter() - t0, 2))
                status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    serving_s = time.perf_counter() - t0
                    break
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        row: dict[str, Any] = {"label": label, "serving_s": None if serving_s is None else round(serving_s, 2),
                               "phases_first_seen_s": phases}
        if serving_s is not None:
            row["compile_cache"] = client.model_info().compile_cache
            result = client.generate(decode_pb2.GenerateRequest(text=PROMPT, max_tokens=16), timeout=60)
            row["tokens"] = list(result.token_ids)
            proc.send_signal(signal.SIGTERM)
            row["exit_code"] = proc.wait(120)
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = log_path.read_text(errors="replace")
    loaded = WEIGHTS_LOADED.search(log)
    row["weights"] = loaded.group(0) if loaded else None
    row["log"] = classify(log)
    if serving_s is None:
        row["log_tail"] = log[-4000:]
    return row


def device_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, check=True).stdout.split("\n")[0]
        return out.strip().replace("NVIDIA ", "")
    except (OSError, subprocess.CalledProcessError):
        return "cpu"


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The checkpoint ``serve`` runs on (a folder, or a preset written first) and its layout."""
    parser.add_argument("--preset", default="llama3-8b", help="make-checkpoint preset (random weights)")
    parser.add_argument("--model-path", type=Path, help="a checkpoint folder instead of a preset")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--batch-slots", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=4352)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--work", type=Path, default=Path("/tmp/switchyard-startup"),
                        help="folder for the checkpoint, the compile cache and the logs")
    parser.add_argument("--timeout", type=float, default=420, help="seconds one start may take")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--warm-env", action="append", default=[], metavar="NAME=VALUE",
                        help="one more warm start with this variable set (repeat for more starts)")
    args = parser.parse_args(argv)
    variants: list[tuple[str, dict[str, str]]] = [("cold", {}), ("warm", {})]
    for item in args.warm_env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            parser.error(f"--warm-env takes NAME=VALUE, got {item!r}")
        variants.append((f"warm {name}={value}", {name: value}))

    args.work.mkdir(parents=True, exist_ok=True)
    model = args.model_path or args.work / f"model-{args.preset}"
    checkpoint = make_checkpoint(args.preset, model) if args.model_path is None else {"path": str(model)}
    cache = args.work / "compile-cache"
    shutil.rmtree(cache, ignore_errors=True)
    device = device_name()
    stamp = result_file.provenance(device, argv, script=__file__)  # the run's, in every write below
    suffix = "" if args.tp == 1 else f"-tp{args.tp}"
    name = f"startup-{device.lower().replace(' ', '-')}{suffix}.json"
    out = args.out or ROOT / "benchmarks" / "results" / "current" / name
    runs: list[dict[str, Any]] = []
    same = False
    for label, env in variants:
        row = start(label, model, cache, args, args.work, env)
        runs.append(row)
        print(f"{row['label']}: SERVING after {row['serving_s']} s; phases {row['phases_first_seen_s']}; "
              f"{row['weights']}; {row.get('compile_cache', '')}; log {row['log']['by_level']}", flush=True)
        for message, count in row["log"]["messages"].items():
            print(f"   {count:4d}  {message}", flush=True)
        same = (len(runs) >= 2 and runs[0].get("tokens") is not None
                and all(r.get("tokens") == runs[0]["tokens"] for r in runs[1:]))
        # Written after each start, so a run cut short keeps what it measured.
        result = {**stamp, "complete": len(runs) == len(variants),
                  "layout": {"tp": args.tp, "batch_slots": args.batch_slots, "max_seq_len": args.max_seq_len},
                  "checkpoint": checkpoint, "runs": runs, "tokens_identical": same,
                  "targets": {"warm_serving_s": 30 if args.tp == 1 else 45, "warning_lines": 0}}
        result_file.write_result(out, result, indent=1)
    print(f"greedy tokens identical in every start: {same}")
    print(f"wrote {out}")
    return 0 if all(r["serving_s"] is not None for r in runs) and same else 1


if __name__ == "__main__":
    raise SystemExit(main())
