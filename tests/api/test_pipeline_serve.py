"""``switchyard serve`` as a two-stage pipeline group: two processes, one layout file, the stage from
the environment (as the operator renders it); stage 0 answers Generate, stage 1 answers health."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import cpu_xla_flags
from helpers.engine_fixtures import generate, tiny_engine, varied_checkpoint
from switchyard.service.api.client import DecodeClient, make_request

PROMPT = [1, 7, 300, 12, 99, 5]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_checkpoint_dir):
    return varied_checkpoint(tmp_path_factory.mktemp("pp-serve-model"), tiny_checkpoint_dir, seed=5)


@contextlib.contextmanager
def _serving_group(tmp_path, checkpoint, **layout: Any) -> Iterator[tuple[list[subprocess.Popen], list[int]]]:
    """A two-stage group of ``switchyard serve`` processes on ``checkpoint`` (the stage from the
    environment, as the operator renders it), once both say SERVING: (processes, gRPC ports). Stages
    still running on the way out are killed; the output of any that did not exit 0 is printed."""
    layout = {"tp": 1, "pp": 2, "strategy": "xla", "coordinator": f"127.0.0.1:{_free_port()}",
              "extra": {"pipeline_stage_env": "STAGE"}, **layout}
    (tmp_path / "layout.json").write_text(json.dumps(layout))
    ports = [_free_port(), _free_port()]
    procs = []
    for stage, port in enumerate(ports):
        env = dict(os.environ, STAGE=str(stage), XLA_FLAGS=cpu_xla_flags(1),
                   JAX_PLATFORMS="cpu")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "switchyard.cli.main", "serve", "--layout", str(tmp_path / "layout.json"),
             "--model-path", str(checkpoint), "--host", "127.0.0.1", "--port", str(port),
             "--http-port", str(_free_port())],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        deadline = time.monotonic() + 180
        while not all(_serving(p) for p in ports):
            assert all(p.poll() is None for p in procs), "a stage exited during start-up"
            assert time.monotonic() < deadline, "the group did not become SERVING"
            time.sleep(0.5)
        yield procs, ports
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            out = p.communicate()[0]
            if p.returncode not in (0, None):
                print(out[-3000:])


def test_two_stage_group_serves_generate_like_one_device(checkpoint, tmp_path):
    expected = generate(tiny_engine(checkpoint, slots=2, max_seq_len=64), [PROMPT], 10)[0]

    with _serving_group(tmp_path, checkpoint, batch_slots=4, max_seq_len=64) as (procs, ports):
        with DecodeClient(f"127.0.0.1:{ports[0]}") as client:
            result = client.generate(make_request(PROMPT, max_tokens=10), timeout=120)
        assert result.token_ids == expected
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(timeout=60) == 0
        assert procs[1].wait(timeout=60) == 0, "stage 1 was not released by stage 0"


def _run_lone_stage(tmp_path, stage: int, coordinator: str, timeout: float,
                    join_timeout_s: float = 30.0) -> tuple[subprocess.CompletedProcess, float]:
    """``switchyard serve --tiny`` as one stage of a two-stage group whose other stage never comes:
    the finished process and the seconds it took."""
    (tmp_path / "layout.json").write_text(json.dumps(
        {"tp": 1, "pp": 2, "batch_slots": 2, "max_seq_len": 256, "coordinator": coordinator,
         "join_timeout_s": join_timeout_s}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWITCHYARD_")}
    env.update(SWITCHYARD_PIPELINE_STAGE=str(stage), XLA_FLAGS="", JAX_PLATFORMS="cpu")
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "switchyard.cli.main", "serve", "--tiny", "--layout", str(tmp_path / "layout.json"),
         "--host", "127.0.0.1", "--port", str(_free_port()), "--http-port", str(_free_port())],
        env=env, capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - started


def test_a_later_stage_whose_stage_0_never_comes_exits_with_one_line(tmp_path):
    coordinator = f"127.0.0.1:{_free_port()}"  # nothing listens there
    done, took = _run_lone_stage(tmp_path, 1, coordinator, timeout=120, join_timeout_s=4)
    assert done.returncode > 0, (done.returncode, done.stderr[-3000:])  # an exit status, not a signal
    # The runtime's own wait would be 300 s and end in a C++ abort (a signal, a stack dump).
    assert took < 4 + 60, took
    assert "within 4 s" in done.stderr, done.stderr[-3000:]  # the layout's bound, not the default 30 s
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and coordinator in errors[0] and "stage 1 of 2" in errors[0], done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Check failure" not in done.stderr, done.stderr[-3000:]
    assert len(done.stderr.strip().splitlines()) <= 2, done.stderr[-3000:]  # the "joining" line and the error


def test_stage_0_that_cannot_listen_on_the_coordinator_port_exits_at_once_with_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        coordinator = f"127.0.0.1:{taken.getsockname()[1]}"
        done, took = _run_lone_stage(tmp_path, 0, coordinator, timeout=120)
    assert done.returncode == 1, (done.returncode, done.stderr[-3000:])
    assert took < 30, took  # start-up and a failed bind: seconds, not the runtime's 300 s and a C++ abort
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and f"cannot listen on the coordinator port {coordinator.split(':')[1]}" in errors[0], \
        done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Check failure" not in done.stderr, done.stderr[-3000:]


def test_a_lost_later_stage_fails_stage_0s_streams_and_stops_it_at_once(checkpoint, tmp_path):
    """Stage 1 killed mid-stream: stage 0's engine process fails its loop and exits at once (an orderly
    exit would wait in the group's runtime for the lost stage); the stream ends INTERNAL, serve exits 1."""
    with _serving_group(tmp_path, checkpoint, batch_slots=2, max_seq_len=256) as (procs, ports):
        outcome: list = []
        with DecodeClient(f"127.0.0.1:{ports[0]}") as client:
            tokens: list[str] = []

            def generate() -> None:
                try:
                    outcome.append(client.generate(make_request(PROMPT, max_tokens=240), timeout=120,
                                                   on_text=tokens.append))
                except grpc.RpcError as err:
                    outcome.append(err)

            thread = threading.Thread(target=generate)
            thread.start()
            deadline = time.monotonic() + 60
            while len(tokens) < 3:
                assert time.monotonic() < deadline and thread.is_alive(), "the stream did not start"
                time.sleep(0.01)
            procs[1].kill()
            killed = time.monotonic()
            thread.join(60)
            assert not thread.is_alive(), "the stream hung after stage 1 went away"
        (err,) = outcome
        assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.INTERNAL, err
        assert procs[0].wait(timeout=60) == 1
        took = time.monotonic() - killed
        # Within the runtime's heartbeat timeout (10 s) and the drain, not the engine process's stop timeout.
        assert took < 25, took
