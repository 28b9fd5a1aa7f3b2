"""One tiny random-weight checkpoint, its tokenizer and an engine for every server test in the session,
and a context manager that serves them on a real localhost gRPC port (server on its own event-loop
thread).

The server tests exercise the protocols, the text and the scheduling, so they serve the fake engine
(``service/engine/fake.py``: the real scheduler and KV books, no model, nothing to compile); the real
engine is served by the tests that run ``switchyard serve`` itself and by the engine's own tests.
A scheduler (cheap) is made per server.
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
STEP_SECONDS = 0.002  # each fake step takes as long as a short step of a real device


@functools.cache
def tiny_dir() -> Path:
    from switchyard.service.engine.checkpoint import write_checkpoint
    from switchyard.service.modelspec import preset

    folder = Path(tempfile.mkdtemp(prefix="switchyard-test-tiny-"))
    atexit.register(shutil.rmtree, folder, True)
    return write_checkpoint(preset("tiny"), folder, seed=0, progress=False)


def tiny_engine(step_seconds: float = STEP_SECONDS) -> Any:
    """A fresh fake engine of the tiny model's shape (its KV books start empty), each step taking
    ``step_seconds``."""
    from switchyard.service.engine.engine import EngineConfig
    from switchyard.service.engine.fake import FakeEngine
    from switchyard.service.modelspec import ModelSpec

    return FakeEngine(ModelSpec.from_file(tiny_dir()), EngineConfig(batch_slots=SLOTS, max_seq_len=MAX_SEQ_LEN),
                      step_seconds=step_seconds)


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

    @property
    def http_url(self) -> str:
        """The HTTP front end's base URL (``serving(http=True)``)."""
        assert self.server.http_port, "served without http=True"
        return f"http://127.0.0.1:{self.server.http_port}"

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
        kv = self.scheduler.kv
        assert len(kv.free_slots()) == kv.max_slots, "engine slots still occupied"
        assert kv.held_blocks() == 0, "KV blocks still held"


@contextlib.contextmanager
def serving(
    *, max_queue: int = 64, telemetry: Any = None, limits: Any = None, keep: int = 256, http: bool = False,
    chat_template: Any = None, eos_token_ids: tuple[int, ...] | None = None, step_seconds: float = STEP_SECONDS,
) -> Iterator[Served]:
    """``http``: the OpenAI-compatible HTTP front end too (``Served.http_url``); ``chat_template``: the
    tiny checkpoint's unless given; ``eos_token_ids``: the model's end-of-sequence ids, unless the
    checkpoint's; ``step_seconds``: how long each engine step takes."""
    from switchyard.service.api.http.chat_template import ChatTemplate
    from switchyard.service.api.server import DecodeApp, ServerThread
    from switchyard.service.api.wire import Limits
    from switchyard.service.engine.scheduler import Scheduler
    from switchyard.service.telemetry.tracing import RequestRecorder

    engine, tokenizer = tiny_engine(step_seconds), tiny_tokenizer()
    recorder = RequestRecorder(telemetry, keep=keep)
    scheduler = Scheduler(engine, max_queue=max_queue, model_name="tiny", eos_token_ids=eos_token_ids)
    app = DecodeApp(
        model_name="tiny", limits=limits or Limits(default_max_tokens=16), recorder=recorder,
        info={"tensor_parallel": 1, "allreduce_strategy": "xla", "max_queue": max_queue},
        chat_template=chat_template or ChatTemplate.from_dir(tiny_dir()),
    )
    server = ServerThread(app, scheduler, tokenizer, http=http)
    try:
        yield Served(server.target, scheduler, recorder, app, server)
    finally:
        server.stop(grace=5.0)
