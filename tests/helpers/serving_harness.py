"""One tiny random-weight checkpoint and one Engine for every server test in the session, and a
context manager that serves them on a real localhost gRPC port (server on its own event-loop thread).

Engines are shared because compiling their steps is the slow part on CPU; a scheduler (cheap) is made
per server. Only one server uses the engine at a time: tests run sequentially.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SLOTS = 8
MAX_SEQ_LEN = 256


@functools.cache
def tiny_dir() -> Path:
    from switchyard.service.engine.checkpoint import write_checkpoint
    from switchyard.service.modelspec import preset

    folder = Path(tempfile.mkdtemp(prefix="switchyard-test-tiny-"))
    atexit.register(shutil.rmtree, folder, True)
    return write_checkpoint(preset("tiny"), folder, seed=0, progress=False)


@functools.cache
def tiny_engine() -> Any:
    from switchyard.service.engine.paged import PagedEngine
    from switchyard.service.modelspec import ServingLayout

    layout = ServingLayout(tp=1, batch_slots=SLOTS, max_seq_len=MAX_SEQ_LEN)
    return PagedEngine.from_checkpoint(tiny_dir(), layout, progress=False)


@functools.cache
def tiny_tokenizer() -> Any:
    from switchyard.service.engine.tokenizer import Tokenizer

    return Tokenizer.from_dir(tiny_dir())


@dataclasses.dataclass
class Served:
    target: str
    scheduler: Any
    recorder: Any
    app: Any
    server: Any

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until no request is queued, generating, or known to the scheduler (or fail)."""
        end = time.monotonic() + timeout
        s = self.scheduler
        while time.monotonic() < end:
            if s.active_slots == 0 and s.queue_depth == 0 and s.in_flight == 0:
                return
            time.sleep(0.01)
        raise AssertionError(
            f"scheduler not idle after {timeout}s: {s.active_slots} active, {s.queue_depth} queued, "
            f"{s.in_flight} in flight"
        )

    def wait_recorded(self, request_ids: list[str], timeout: float = 10.0) -> list[Any]:
        """Their traces, once the scheduler has handed over every record (it does so just after the
        final event, so a client can see the end of its stream a moment before)."""
        end = time.monotonic() + timeout
        while True:
            found = {t.request_id: t for t in self.recorder.recent()}
            if all(r in found for r in request_ids):
                return [found[r] for r in request_ids]
            if time.monotonic() > end:
                raise AssertionError(f"no record for {[r for r in request_ids if r not in found]}")
            time.sleep(0.01)

    def assert_no_leaked_slots(self) -> None:
        self.wait_idle()
        engine = self.scheduler.engine
        assert len(engine.free_slots()) == engine.max_slots, "engine slots still occupied"


@contextlib.contextmanager
def serving(
    *, max_queue: int = 64, telemetry: Any = None, limits: Any = None, keep: int = 256
) -> Iterator[Served]:
    from switchyard.service.api.server import DecodeApp, ServerThread
    from switchyard.service.api.wire import Limits
    from switchyard.service.engine.scheduler import Scheduler
    from switchyard.service.telemetry.tracing import RequestRecorder

    engine, tokenizer = tiny_engine(), tiny_tokenizer()
    recorder = RequestRecorder(telemetry, keep=keep)
    scheduler = Scheduler(engine, tokenizer, max_queue=max_queue, on_finish=recorder.on_finish, model_name="tiny")
    app = DecodeApp(
        model_name="tiny", limits=limits or Limits(default_max_tokens=16), recorder=recorder,
        info={"tensor_parallel": 1, "allreduce_strategy": "xla", "max_queue": max_queue},
    )
    server = ServerThread(app, scheduler, tokenizer)
    try:
        yield Served(server.target, scheduler, recorder, app, server)
    finally:
        server.stop(grace=5.0)
        free = set(engine.free_slots())
        for slot in range(engine.max_slots):  # leave a clean engine for the next server, whatever happened
            if slot not in free:
                engine.evict(slot)
