"""``switchyard serve --tiny`` as the pod runs it: a subprocess on a free local port, its log in a file."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Until ``condition()`` holds (an RPC error counts as not yet), or AssertionError naming ``what``."""
    end = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except grpc.RpcError:
            pass
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@contextlib.contextmanager
def serve_tiny(tmp_path: Path, *, slots: int, grace: float = 60, max_seq_len: int = 256,
               extra: tuple[str, ...] = (), warmup: bool = False, log_name: str = "serve.log",
               http_port: int | None = None, **popen) -> Iterator[tuple[subprocess.Popen, str, Path]]:
    """``switchyard serve --tiny`` as a subprocess (steps compiled on first use unless ``warmup``):
    (process, target, log); killed on the way out if still running. Its HTTP API on ``http_port`` (a
    free port unless given)."""
    port = free_port()
    log = tmp_path / log_name
    cmd = [sys.executable, "-m", "switchyard.cli.main", "serve", "--tiny", *(() if warmup else ("--no-warmup",)),
           "--host", "127.0.0.1",
           "--port", str(port), "--batch-slots", str(slots), "--max-seq-len", str(max_seq_len),
           "--grace-period", str(grace), "--http-port", str(http_port or free_port()), *extra]
    # Its programs compiled as deployed, not as the test process compiles them (tests/conftest.py): the
    # longest-gap test times eight 1800-token prompts, which XLA's unoptimized CPU programs run too slowly.
    env = {k: v for k, v in os.environ.items() if k != "JAX_DISABLE_MOST_OPTIMIZATIONS"}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, **popen)
    try:
        yield proc, f"127.0.0.1:{port}", log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def serving(target: str) -> bool:
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
    status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
    return status == health_pb2.HealthCheckResponse.SERVING


def wait_serving(target: str, log: Path, timeout: float = 120) -> None:
    try:
        wait_for(lambda: serving(target), timeout, "SERVING")
    except AssertionError as err:
        raise AssertionError(f"{err}; log:\n{log.read_text()}") from None
