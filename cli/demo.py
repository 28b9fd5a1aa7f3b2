"""``switchyard demo``: the whole path on the embedded tiny model.

Starts ``switchyard serve --tiny`` (a random-weight tiny Llama, written on the spot) as its own
process, waits until gRPC health says SERVING, streams a generation with ``switchyard generate``,
then reads the request's per-token trace back with ``switchyard trace`` (table, percentiles, PNG).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from switchyard.cli.usage import not_negative, positive_seconds, writable_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", default="Once upon a time", help="prompt text")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--png", default="switchyard-trace.png", help="where to write the trace timeline")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for SERVING")


def _holds_a_request_trace(path: Path) -> bool:
    """Whether the trace file has a request's span yet: metric points share the file (a periodic
    export may land before the span), and a line may be half written."""
    from switchyard.service.telemetry.traces import read_trace_file

    try:
        return path.exists() and bool(read_trace_file(path))
    except ValueError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_serving(target: str, server: subprocess.Popen, timeout: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise RuntimeError(f"switchyard serve exited with code {server.returncode}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"the service at {target} was not SERVING after {timeout:.0f} s")


def run(args: argparse.Namespace) -> int:
    from switchyard.cli.main import main as switchyard

    # Found before the server starts: its warm-up takes a minute.
    not_negative(args.max_tokens, "--max-tokens")
    positive_seconds(args.startup_timeout, "--startup-timeout")
    if args.png:
        writable_file(args.png, "--png")
    port = _free_port()
    target = f"127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="switchyard-demo-") as scratch:
        trace_file = Path(scratch) / "traces.jsonl"
        # -P: the working directory may be a checkout whose operator/ would shadow the standard library.
        command = [sys.executable, "-P", "-m", "switchyard.cli.main", "serve", "--tiny", "--host", "127.0.0.1",
                   "--port", str(port), "--http-port", str(_free_port()), "--trace-file", str(trace_file)]
        print("$ switchyard " + " ".join(command[4:]), flush=True)
        env = dict(os.environ, OTEL_BSP_SCHEDULE_DELAY=os.environ.get("OTEL_BSP_SCHEDULE_DELAY", "100"))
        server = subprocess.Popen(command, env=env)
        try:
            _wait_serving(target, server, args.startup_timeout)
            print(f"\n$ switchyard generate --target {target} --max-tokens {args.max_tokens} {args.prompt!r}",
                  flush=True)
            code = switchyard(["generate", "--target", target, "--max-tokens", str(args.max_tokens), args.prompt])
            if code:
                return code
            for _ in range(50):  # the span reaches the file within the exporter's schedule delay
                if _holds_a_request_trace(trace_file):
                    break
                time.sleep(0.1)
            print(f"\n$ switchyard trace {trace_file.name} --png {args.png}", flush=True)
            return switchyard(["trace", str(trace_file), "--png", args.png, "--rows", "10"])
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
