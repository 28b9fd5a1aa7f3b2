"""``switchyard serve`` as the pod runs it (a subprocess), then SIGTERM: it stops taking requests,
finishes every accepted one (generating or queued) within the grace period, and exits 0."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers.serve_process import serve_tiny, wait_for, wait_serving
from switchyard.service.api.client import DecodeClient, make_request

pytestmark = pytest.mark.timeout(300)
SLOTS = 4
STREAMS = 7  # 4 generating, 3 queued when SIGTERM arrives
MAX_TOKENS = 240


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started that are still alive (Linux: /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(FileNotFoundError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _serve(tmp_path: Path, grace: float = 60, max_seq_len: int = 256, **popen):
    return serve_tiny(tmp_path, slots=SLOTS, grace=grace, max_seq_len=max_seq_len, **popen)


def _engine_process(proc: subprocess.Popen) -> int:
    """The pid of serve's engine process (its one Python child that is not multiprocessing's tracker)."""
    engines = [c for c in _children(proc.pid)
               if "resource_tracker" not in Path(f"/proc/{c}/cmdline").read_text()]
    assert len(engines) == 1, engines
    return engines[0]


def _long_stream(target: str) -> tuple[threading.Thread, list[object]]:
    """A stream well under way (a few tokens in) and where its outcome lands: the result or the error.
    Greedy over the tiny model's fixed weights, its prompt runs for hundreds of tokens."""
    client = DecodeClient(target)
    client.generate(make_request("compile the steps", max_tokens=4), timeout=120)
    outcome: list[object] = []
    texts: list[str] = []

    def stream() -> None:
        try:
            outcome.append(client.generate(make_request("hello there", max_tokens=1000), timeout=120,
                                           on_text=texts.append))
        except grpc.RpcError as err:
            outcome.append(err)

    thread = threading.Thread(target=stream)
    thread.start()
    wait_for(lambda: len(texts) > 2, 60, "the stream's first tokens")
    return thread, outcome


def test_sigterm_drains_every_accepted_request(tmp_path: Path) -> None:
    with _serve(tmp_path) as (proc, target, log):
        channel = grpc.insecure_channel(target)
        health = health_pb2_grpc.HealthStub(channel)
        check = health_pb2.HealthCheckRequest(service="")
        serving = health_pb2.HealthCheckResponse.SERVING
        wait_for(lambda: health.Check(check, timeout=2).status == serving, 120, f"SERVING; log:\n{log.read_text()}")
        engine = _engine_process(proc)
        client = DecodeClient(target)
        client.generate(make_request("compile the steps", max_tokens=MAX_TOKENS), timeout=120)

        results: dict[int, object] = {}

        def stream(i: int) -> None:
            try:
                results[i] = client.generate(make_request(f"drain {i}", max_tokens=MAX_TOKENS), timeout=120)
            except grpc.RpcError as err:
                results[i] = err

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
        for t in threads:
            t.start()

        def all_accepted() -> bool:
            info = client.model_info(timeout=2)
            return info.active_slots + info.queue_depth == STREAMS and info.queue_depth > 0

        wait_for(all_accepted, 30, "every stream accepted")
        proc.send_signal(signal.SIGTERM)

        def draining() -> bool:
            try:
                return health.Check(check, timeout=2).status != serving
            except grpc.RpcError as err:
                return err.code() == grpc.StatusCode.UNAVAILABLE

        wait_for(draining, 10, "NOT_SERVING after SIGTERM")
        with pytest.raises(grpc.RpcError) as refused:
            client.generate(make_request("too late", max_tokens=2), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert any(t.is_alive() for t in threads), "streams ended before the drain was tested"

        for t in threads:
            t.join(120)
        assert proc.wait(60) == 0
        assert not _alive(engine), "the engine process outlived serve"
    for i in range(STREAMS):
        r = results[i]
        assert not isinstance(r, grpc.RpcError), f"stream {i} lost: {r}"
        assert r.finish_reason in ("length", "stop")
        assert len(r.token_ids) == MAX_TOKENS or r.finish_reason == "stop"
    text = log.read_text()
    assert "draining" in text and "stopped" in text
    # The server's process delivers the tokens: its heap is frozen once the engine is ready.
    assert "objects of the server's process frozen" in text


def test_a_lost_engine_process_fails_its_streams_and_stops_serve(tmp_path: Path) -> None:
    with _serve(tmp_path, max_seq_len=2048) as (proc, target, log):  # the tiny model's whole context
        wait_serving(target, log)
        thread, outcome = _long_stream(target)
        os.kill(_engine_process(proc), signal.SIGKILL)
        thread.join(60)
        assert not thread.is_alive(), "the stream hung after its engine went away"
        err, = outcome
        assert isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.INTERNAL
        assert "the engine failed while generating" in err.details()
        assert proc.wait(60) == 1  # so that the pod restarts
    text = log.read_text()
    assert "the engine process exited (code -9); failing 1 request(s) in flight" in text
    assert "stopping so that the pod restarts" in text


def test_ctrl_c_to_the_process_group_drains_as_sigterm_does(tmp_path: Path) -> None:
    # A terminal sends SIGINT to every process of the group, the engine process included.
    with _serve(tmp_path, max_seq_len=2048, start_new_session=True) as (proc, target, log):
        wait_serving(target, log)
        engine = _engine_process(proc)
        thread, outcome = _long_stream(target)
        os.killpg(proc.pid, signal.SIGINT)
        thread.join(120)
        assert proc.wait(60) == 0
        assert not _alive(engine), "the engine process outlived serve"
    result, = outcome
    assert not isinstance(result, grpc.RpcError), f"the stream was lost: {result}"
    assert result.finish_reason in ("length", "stop") and len(result.token_ids) > 2
    assert "draining" in log.read_text()
