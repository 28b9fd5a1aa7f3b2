"""The engine in a process of its own (service/api/engine_process.py), driven as the server's bridge
drives a scheduler: greedy tokens as in this process, the scheduler's refusals raised here with their
own types, cancels, traces, and every way the engine process can fail to start or go away."""

from __future__ import annotations

import dataclasses
import functools
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from helpers import engine_builders
from helpers.engine_fixtures import generate
from helpers.serving_harness import MAX_SEQ_LEN, SLOTS, tiny_dir
from switchyard.cli.serve import EngineOptions
from switchyard.service.api.engine_process import EngineProcess, EngineProcessLost, EngineStartError, StartupProgress
from switchyard.service.api.wire import Unavailable
from switchyard.service.engine.request import GenerationRequest
from switchyard.service.engine.sampling import SamplingParams
from switchyard.service.errors import OutOfRangeError, QueueFullError
from switchyard.service.modelspec import ModelSpecError, ServingLayout

LAYOUT = ServingLayout(tp=1, batch_slots=SLOTS, max_seq_len=MAX_SEQ_LEN)
PROMPTS = [[5, 9, 14, 3, 22, 7], list(range(3, 40)), [11] * 70]


class Served:
    """An engine process whose messages a thread reads, as the bridge's thread does."""

    def __init__(self, builder=engine_builders.tiny_from_checkpoint, max_queue: int = 16) -> None:
        self.process = EngineProcess(builder, EngineOptions(str(tiny_dir()), LAYOUT, None, False),
                                     scheduler_options={"max_queue": max_queue, "model_name": "tiny"})
        self.records: list = []
        self.stop = threading.Event()
        self.failure: list[BaseException] = []

    def start(self) -> Served:
        self.process.wait_ready(timeout=300)
        self.process.on_finish = self.records.append
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        return self

    def _read(self) -> None:
        try:
            self.process.run(self.stop)
        except BaseException as err:
            self.failure.append(err)

    def generate(self, request_id: str, prompt: list[int], max_tokens: int) -> tuple[list, threading.Event]:
        events: list = []
        done = threading.Event()

        def on_event(event) -> None:
            events.append(event)
            if event.finish_reason is not None:
                done.set()

        accepted = self.process.submit(GenerationRequest(request_id, prompt, max_tokens, SamplingParams(),
                                                         on_event=on_event, ignore_eos=True))
        accepted.result(timeout=60)
        return events, done

    def close(self) -> None:
        self.stop.set()
        if hasattr(self, "reader"):
            self.reader.join(10)
        self.process.close()


@pytest.fixture(scope="module")
def served():
    s = Served().start()
    yield s
    s.close()


@functools.cache
def in_process_engine():
    """The engine serve's builder makes, built in this process."""
    from switchyard.cli.serve import load_engine

    return load_engine(EngineOptions(str(tiny_dir()), LAYOUT, None, False))


def in_process_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    return generate(in_process_engine(), [prompt], max_tokens)[0]


def test_greedy_tokens_and_traces_are_those_of_the_scheduler_in_this_process(served):
    facts = served.process.facts
    assert (facts.max_slots, facts.max_seq_len, facts.kv_block_size) == (SLOTS, MAX_SEQ_LEN, 64)
    assert facts.kv_tokens >= MAX_SEQ_LEN and facts.step_tokens > 0
    runs = [served.generate(f"r{i}", prompt, 12) for i, prompt in enumerate(PROMPTS)]
    for (events, done), prompt in zip(runs, PROMPTS, strict=True):
        assert done.wait(120)
        assert [e.index for e in events] == list(range(12))
        assert events[-1].finish_reason == "length"
        assert [e.token_id for e in events] == in_process_tokens(prompt, 12)
    finished = {r.request_id: r for r in served.records}
    assert {f"r{i}" for i in range(len(PROMPTS))} <= set(finished)
    assert finished["r1"].prompt_tokens == len(PROMPTS[1]) and finished["r1"].output_tokens == 12


def test_the_schedulers_refusals_are_raised_here_with_their_own_types(served):
    too_long = served.process.submit(GenerationRequest("long", [5, 6], MAX_SEQ_LEN, SamplingParams()))
    with pytest.raises(OutOfRangeError, match="does not fit"):
        too_long.result(timeout=60)
    events, done = served.generate("after", [5, 6, 7], 3)  # the engine goes on serving
    assert done.wait(60) and events[-1].finish_reason == "length"


def test_a_cancel_ends_the_request_and_frees_its_slot(served):
    events, done = served.generate("cancelled", [5, 6, 7], MAX_SEQ_LEN - 8)
    deadline = time.monotonic() + 60
    while not events and time.monotonic() < deadline:
        time.sleep(0.001)
    served.process.cancel("cancelled")
    assert done.wait(60)
    assert events[-1].finish_reason == "cancelled" and len(events) < MAX_SEQ_LEN - 8
    # The counts come with the step that ended it, before its events.
    assert served.process.active_slots == 0 and served.process.queue_depth == 0


def test_a_full_queue_is_refused_as_resource_exhausted():
    served = Served(max_queue=1).start()
    try:
        futures = [served.process.submit(GenerationRequest(f"q{i}", [5, 6], 100, SamplingParams()))
                   for i in range(SLOTS + 8)]
        outcomes = []
        for future in futures:
            try:
                future.result(timeout=60)
                outcomes.append("accepted")
            except QueueFullError as err:
                assert "admission queue is full" in str(err)
                outcomes.append("full")
        assert "full" in outcomes and outcomes[0] == "accepted"
    finally:
        served.close()


@pytest.mark.parametrize(("builder", "error", "message"), [
    (engine_builders.refuses_the_layout, ModelSpecError, "needs 1.00 GiB of KV cache"),
    (engine_builders.breaks, EngineStartError, "RuntimeError: the checkpoint's shards disagree"),
    (engine_builders.exits_while_loading, EngineProcessLost, r"exited \(code 3\)"),
])
def test_an_engine_that_cannot_start_says_why(builder, error, message):
    process = EngineProcess(builder, None)
    try:
        devices = process.wait_devices(timeout=120)
        assert devices.count >= 1 and devices.platform == "cpu" and devices.label.startswith(f"{devices.count}x ")
        with pytest.raises(error, match=message):
            process.wait_ready(timeout=120)
    finally:
        process.close(timeout=10)


def test_start_up_progress_reaches_the_server_while_the_engine_builds(tmp_path):
    flag = tmp_path / "go"
    process = EngineProcess(engine_builders.reports_progress, str(flag))
    outcome: list[BaseException] = []

    def wait() -> None:
        try:
            process.wait_ready(timeout=120)
        except BaseException as err:
            outcome.append(err)

    try:
        assert process.startup == StartupProgress("starting")
        process.wait_devices(timeout=120)
        waiter = threading.Thread(target=wait)
        waiter.start()
        deadline = time.monotonic() + 60
        while process.startup.phase == "starting" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process.startup == StartupProgress("compiling step programs", 1, 3)
        assert process.startup.describe() == "compiling step programs (1 of 3)"
        flag.touch()
        waiter.join(60)
        assert len(outcome) == 1 and isinstance(outcome[0], ModelSpecError)
    finally:
        process.close(timeout=10)


def test_a_lost_engine_process_fails_the_reader_and_what_waits_for_it():
    lost = Served()
    lost.start()
    lost.process._process.kill()
    lost.reader.join(30)
    assert lost.failure and isinstance(lost.failure[0], EngineProcessLost)
    late = lost.process.submit(GenerationRequest("late", [5], 1, SamplingParams()))
    with pytest.raises(Unavailable):
        late.result(timeout=10)
    lost.process.close(timeout=5)


def test_the_engine_process_ends_with_the_server_process_even_while_loading(tmp_path):
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path[:0] = {sys.path!r}
        from helpers import engine_builders
        from switchyard.service.api.engine_process import EngineProcess
        process = EngineProcess(engine_builders.loads_forever, None)
        process.wait_devices(timeout=120)
        print(process._process.pid, flush=True)
        os._exit(0)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180,
                         env=dict(os.environ, PYTHONSAFEPATH="1"))
    assert run.returncode == 0, run.stderr[-2000:]
    child = int(run.stdout.split()[-1])
    deadline = time.monotonic() + 30
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child), "the engine process outlived the server's"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_requests_keep_their_fields_across_the_pipe():
    # Everything a request carries but its callback crosses to the engine's scheduler.
    request = GenerationRequest("x", [1, 2], 3, SamplingParams(temperature=0.5, top_k=4, seed=7), stop_token_ids=(9,),
                                deadline=12.5, on_event=print, ignore_eos=True, min_tokens=2, reuse_prefix=False)
    import pickle

    sent = pickle.loads(pickle.dumps(dataclasses.replace(request, on_event=None)))
    assert dataclasses.replace(sent, on_event=print) == request


def test_a_step_is_sent_when_it_made_events_or_changed_the_counts():
    from types import SimpleNamespace

    from switchyard.service.api.engine_process import _Outbox

    sent: list = []
    outbox = _Outbox(SimpleNamespace(send=sent.append))
    scheduler = SimpleNamespace(active_slots=0, queue_depth=0, kv_blocks_held=0)
    outbox.flush(scheduler)
    assert sent == []  # idle: nothing to say
    scheduler.queue_depth = 2  # two requests queued, no token yet
    outbox.flush(scheduler)
    scheduler.active_slots, scheduler.queue_depth = 1, 1  # one admitted, its prompt still going in
    outbox.flush(scheduler)
    scheduler.kv_blocks_held = 3  # its first chunk took blocks
    outbox.flush(scheduler)
    outbox.flush(scheduler)
    outbox.event("e1")
    outbox.record("r1")
    outbox.flush(scheduler)
    assert sent == [("step", [], [], (0, 2, 0)), ("step", [], [], (1, 1, 0)), ("step", [], [], (1, 1, 3)),
                    ("step", ["e1"], ["r1"], (1, 1, 3))]
