"""Lifecycle in process: health NOT_SERVING while loading, SERVING when ready, NOT_SERVING on drain;
requests refused with UNAVAILABLE until ready; server reflection lists every service."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from helpers.serving_harness import tiny_engine, tiny_tokenizer
from switchyard.service.api import kserve
from switchyard.service.api.client import DecodeClient, make_request
from switchyard.service.api.server import DECODE_SERVICE, DecodeApp, ServeOptions, serve
from switchyard.service.engine.scheduler import Scheduler
from switchyard.service.telemetry.tracing import RequestRecorder

pytestmark = pytest.mark.timeout(180)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class InProcessServe:
    """``serve()`` on a thread, with a model load that waits until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.ports: queue.Queue[int] = queue.Queue()
        self.recorder = RequestRecorder()
        self.app = DecodeApp(model_name="tiny", recorder=self.recorder)
        self.exit_code: int | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.stop: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()
        self.port = self.ports.get(timeout=30)

    def _load(self):
        assert self.release.wait(60)
        self.scheduler = Scheduler(tiny_engine(), max_queue=8)
        return self.scheduler, tiny_tokenizer()

    def _main(self) -> None:
        async def main() -> int:
            self.loop = asyncio.get_running_loop()
            self.stop = asyncio.Event()
            return await serve(self.app, self._load, ServeOptions("127.0.0.1", 0, grace_period=10),
                               stop=self.stop, on_listening=self.ports.put)

        self.exit_code = asyncio.run(main())

    def shutdown(self) -> None:
        assert self.loop is not None and self.stop is not None
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)


def _kserve_ready(channel: grpc.Channel) -> tuple[bool, bool]:
    def call(name: str) -> object:
        method = channel.unary_unary(
            f"/{kserve.SERVICE}/{name}",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=kserve.message(f"{name}Response").FromString,
        )
        return method(kserve.message(f"{name}Request")(), timeout=10)

    return call("ServerLive").live, call("ServerReady").ready


def test_health_follows_loading_serving_and_draining() -> None:
    server = InProcessServe()
    target = f"127.0.0.1:{server.port}"
    channel = grpc.insecure_channel(target)
    health = health_pb2_grpc.HealthStub(channel)
    watched: list[int] = []
    watch = health.Watch(health_pb2.HealthCheckRequest(service=""), timeout=120)
    watcher = threading.Thread(target=lambda: [watched.append(r.status) for r in _ignore_end(watch)], daemon=True)
    watcher.start()
    try:
        for service in ("", DECODE_SERVICE, kserve.SERVICE):
            assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == NOT_SERVING
        assert _kserve_ready(channel) == (True, False)
        with DecodeClient(target) as c, pytest.raises(grpc.RpcError) as err:
            c.generate(make_request("too early", max_tokens=2), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE

        server.release.set()
        _wait_for(lambda: health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == SERVING)
        assert health.Check(health_pb2.HealthCheckRequest(service=DECODE_SERVICE), timeout=10).status == SERVING
        assert _kserve_ready(channel) == (True, True)
        with DecodeClient(target) as c:
            assert c.generate(make_request("now", max_tokens=3), timeout=60).token_ids

        _check_reflection(channel)
    finally:
        started = time.monotonic()
        server.shutdown()
    # Nothing was generating: the open Watch stream must not hold the 10 s grace period.
    assert time.monotonic() - started < 5
    watcher.join(10)
    assert server.exit_code == 0
    assert watched[0] == NOT_SERVING and SERVING in watched and watched[-1] == NOT_SERVING, watched


def _ignore_end(stream):
    try:
        yield from stream
    except grpc.RpcError:
        return  # the server went away at the end of the test


def _wait_for(condition, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def _check_reflection(channel: grpc.Channel) -> None:
    from google.protobuf.descriptor_pool import DescriptorPool

    db = ProtoReflectionDescriptorDatabase(channel)
    services = set(db.get_services())
    assert {DECODE_SERVICE, kserve.SERVICE, "grpc.health.v1.Health"} <= services
    pool = DescriptorPool(db)
    decode = pool.FindServiceByName(DECODE_SERVICE)
    assert decode.methods_by_name["Generate"].output_type.full_name == "switchyard.v1.GenerateResponse"
    infer = pool.FindServiceByName(kserve.SERVICE).methods_by_name["ModelStreamInfer"]
    assert infer.input_type.full_name == "inference.ModelInferRequest"


def test_serve_exits_nonzero_when_the_engine_loop_dies() -> None:
    """So that Kubernetes restarts the pod instead of keeping a server that can never answer."""
    server = InProcessServe()
    server.release.set()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    health = health_pb2_grpc.HealthStub(channel)
    _wait_for(lambda: health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == SERVING)

    def crash() -> bool:
        raise RuntimeError("simulated scheduler bug")

    server.scheduler.step = crash
    server.thread.join(30)
    assert not server.thread.is_alive() and server.exit_code == 1


def test_serve_reports_a_port_it_cannot_listen_on(caplog) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        app = DecodeApp(model_name="tiny")
        code = asyncio.run(serve(app, lambda: (None, None), ServeOptions("127.0.0.1", port), stop=asyncio.Event()))
    assert code == 1
    assert f"could not listen on 127.0.0.1:{port}" in caplog.text


def test_serve_reports_a_layout_the_devices_cannot_hold_in_one_line(caplog) -> None:
    from switchyard.service.modelspec import ModelSpecError

    def load():
        raise ModelSpecError("layout.kv_tokens 640 needs 9.00 GiB of KV cache per GPU, but only 1.00 GiB is free")

    app = DecodeApp(model_name="tiny")
    code = asyncio.run(serve(app, load, ServeOptions("127.0.0.1", 0), stop=asyncio.Event()))
    assert code == 1
    failed = [r for r in caplog.records if r.getMessage().startswith("loading the model failed")]
    assert len(failed) == 1 and failed[0].exc_info is None
    assert failed[0].getMessage().endswith("but only 1.00 GiB is free")
