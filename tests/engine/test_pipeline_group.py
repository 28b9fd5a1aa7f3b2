"""Pipeline groups of 2 and 4 stages, one process per stage joined with jax.distributed (gloo on CPU):
the same tokens as one device, and a killed stage stops the group."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import HELPERS, cpu_xla_flags
from helpers.engine_fixtures import tiny_engine, varied_checkpoint
from switchyard.service.engine.request import GenerationRequest
from switchyard.service.engine.sampling import SamplingParams
from switchyard.service.engine.scheduler import Scheduler
from switchyard.service.modelspec import ServingLayout

RUNNER = HELPERS / "pipeline_group_run.py"
# prompt, max_tokens, temperature, top_k, top_p, seed
REQUESTS = [
    [[1, 40, 41, 42], 9, 0.0, 0, 1.0, 0],
    [[1, 7, 300, 12, 99, 5], 12, 0.9, 0, 1.0, 3],
    [[1, 250], 5, 1.1, 30, 1.0, 8],
    [[1, *range(3, 30)], 7, 0.0, 0, 1.0, 0],
    [[1, 77, 78], 11, 0.7, 0, 0.9, 1],
    [[1, 500, 501, 502, 503], 6, 0.0, 0, 1.0, 0],
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_checkpoint_dir):
    return varied_checkpoint(tmp_path_factory.mktemp("pp-group-model"), tiny_checkpoint_dir)


@pytest.fixture(scope="module")
def reference(checkpoint) -> dict[str, list[int]]:
    engine = tiny_engine(checkpoint, slots=4, max_seq_len=64, step_tokens=8, block_size=8)
    sched = Scheduler(engine, max_queue=16)
    out: dict[str, list[int]] = {}
    for i, (prompt, n, t, k, p, seed) in enumerate(REQUESTS):
        sched.submit(GenerationRequest(f"r{i}", prompt, n, SamplingParams(t, k, p, seed), ignore_eos=True,
                                       on_event=lambda e: e.token_id is not None and out.setdefault(
                                           e.request_id, []).append(e.token_id)))
    while sched.step() or sched.in_flight:
        pass
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_group(pp: int, checkpoint: Path, out: Path, requests: list) -> list[subprocess.Popen]:
    coordinator = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, XLA_FLAGS=cpu_xla_flags(1), JAX_PLATFORMS="cpu",
               PYTHONUNBUFFERED="1")
    return [subprocess.Popen([sys.executable, str(RUNNER), str(stage), str(pp), "1", coordinator, str(checkpoint),
                              str(out), json.dumps(requests)], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
            for stage in range(pp)]


@pytest.mark.parametrize("pp", [2, 4])
def test_group_of_processes_gives_the_tokens_of_one_device(checkpoint, reference, tmp_path, pp):
    out = tmp_path / "tokens.json"
    procs = start_group(pp, checkpoint, out, REQUESTS)
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * pp, "\n".join(log[-1500:] for log in logs)
    result = json.loads(out.read_text())
    assert result["tokens"] == reference
    assert set(result["finish"].values()) == {"length"}


def test_a_killed_stage_stops_the_group(checkpoint, tmp_path):
    long = [[[1, 5 + i, 6], 60, 0.0, 0, 1.0, 0] for i in range(40)]  # far more work than the kill leaves time for
    procs = start_group(2, checkpoint, tmp_path / "never.json", long)
    leader, follower = procs
    deadline = time.monotonic() + 120
    seen = ""
    while "ready" not in seen and time.monotonic() < deadline:  # the follower has joined and loaded
        seen += follower.stdout.readline()
    time.sleep(2.0)
    follower.kill()
    try:
        log = leader.communicate(timeout=90)[0]
    except subprocess.TimeoutExpired:
        leader.kill()
        pytest.fail("stage 0 kept running after stage 1 died")
    follower.communicate()
    assert leader.returncode != 0, log[-2000:]
    assert not (tmp_path / "never.json").exists()


def test_commands_round_trip_and_a_closed_channel_is_a_lost_stage():
    import numpy as np
    from switchyard.service.engine.pipeline_group import STEP, STOP, CommandChannel, GroupBrokenError

    a, b = socket.socketpair()
    leader, follower = CommandChannel([a]), CommandChannel([b])
    leader.send(STEP, np.array([7, 8, 9], np.int32))
    leader.send(STOP)
    step, stop = follower.receive(), follower.receive()
    assert step.tolist() == [STEP, 7, 8, 9] and stop.tolist() == [STOP]
    leader.close()
    with pytest.raises(GroupBrokenError, match="closed the command channel"):
        follower.receive()
    follower.close()


def test_a_failed_launch_on_stage_0_breaks_the_group_and_nothing_more_is_sent():
    from switchyard.service.engine.engine import EngineConfig
    from switchyard.service.engine.fake import FakeEngine
    from switchyard.service.engine.kv_manager import KVManager
    from switchyard.service.engine.pipeline_group import STEP, GroupBrokenError, LeaderEngine

    class Recorder:
        def __init__(self) -> None:
            self.ops: list[int] = []

        def send(self, op: int, words=None) -> None:
            self.ops.append(op)

    class DeviceLost(FakeEngine):
        def launch(self, plan):
            raise RuntimeError("device lost")

    engine = DeviceLost(config=EngineConfig(batch_slots=2, max_seq_len=64))
    channel = Recorder()
    leader = LeaderEngine(engine, channel)
    kv = KVManager(max_slots=2, max_seq_len=64, kv_tokens=engine.kv_tokens, block_size=engine.kv_block_size)
    kv.begin(0, [1, 2, 3], SamplingParams())
    plan = engine.policy.plan(kv, [0])
    with pytest.raises(GroupBrokenError, match="device lost"):
        leader.launch(plan)
    assert leader.broken is not None
    with pytest.raises(GroupBrokenError, match="broken"):
        leader.launch(plan)
    assert channel.ops == [STEP]


def _stage_1_of(coordinator: str, join_timeout_s: float = 30.0) -> ServingLayout:
    return ServingLayout(tp=1, pp=2, batch_slots=2, max_seq_len=64, pipeline_stage=1, coordinator=coordinator,
                         join_timeout_s=join_timeout_s)


def test_a_later_stage_whose_coordinator_never_answers_gives_up_at_its_bound():
    from switchyard.service.engine.pipeline_group import GroupFormationError, join

    coordinator = f"127.0.0.1:{_free_port()}"  # nothing listens there
    started = time.monotonic()
    with pytest.raises(GroupFormationError, match=rf"stage 1 of 2: .*{coordinator} .*within 1.5 s") as caught:
        join(_stage_1_of(coordinator, join_timeout_s=1.5))
    assert 1.5 <= time.monotonic() - started < 10
    assert "\n" not in str(caught.value)


def test_a_later_stage_joins_a_coordinator_that_starts_after_it():
    import threading

    from switchyard.service.engine.pipeline_group import wait_for_coordinator

    port = _free_port()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def open_late() -> None:
        time.sleep(1.0)
        listener.bind(("127.0.0.1", port))
        listener.listen()

    opener = threading.Thread(target=open_late)
    opener.start()
    try:
        started = time.monotonic()
        wait_for_coordinator(_stage_1_of(f"127.0.0.1:{port}"), timeout_s=20).close()
        assert 1.0 <= time.monotonic() - started < 10
    finally:
        opener.join()
        listener.close()


def _stage_of(stage: int, pp: int, coordinator: str) -> ServingLayout:
    return ServingLayout(tp=1, pp=pp, batch_slots=2, max_seq_len=64, pipeline_stage=stage, coordinator=coordinator)


def test_stage_0_whose_port_is_taken_fails_at_once():
    from switchyard.service.engine.pipeline_group import GroupFormationError, gather_stages

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(GroupFormationError, match=rf"stage 0 of 2: cannot listen on the coordinator port {port}"):
            gather_stages(_stage_of(0, 2, f"127.0.0.1:{port}"), timeout_s=60)
        assert time.monotonic() - started < 5


def test_stage_0_names_the_stages_that_never_came_and_lets_go_of_those_that_did():
    import threading

    from switchyard.service.engine.pipeline_group import GroupFormationError, gather_stages, meet_coordinator

    coordinator = f"127.0.0.1:{_free_port()}"
    outcome: list[BaseException | None] = []

    def stage_2() -> None:
        try:
            meet_coordinator(_stage_of(2, 4, coordinator), connect_timeout_s=10, formation_timeout_s=60)
            outcome.append(None)
        except BaseException as err:
            outcome.append(err)

    later = threading.Thread(target=stage_2)
    later.start()
    started = time.monotonic()
    with pytest.raises(GroupFormationError, match=rf"stage 0 of 4: stages 1, 3 did not join at {coordinator} "
                                                  r"within 2 s") as caught:
        gather_stages(_stage_of(0, 4, coordinator), timeout_s=2)
    assert 2 <= time.monotonic() - started < 10
    later.join(timeout=10)
    assert not later.is_alive()  # stage 0 giving up ends the later stages' wait at once
    assert isinstance(outcome[0], GroupFormationError), outcome
    assert "closed the connection before the group formed" in str(outcome[0])
    assert "\n" not in str(caught.value)


def test_stages_meet_then_the_port_is_free_for_the_runtime():
    import threading

    from switchyard.service.engine.pipeline_group import gather_stages, meet_coordinator, wait_for_coordinator

    port = _free_port()
    coordinator = f"127.0.0.1:{port}"
    lead = threading.Thread(target=gather_stages, args=(_stage_of(0, 3, coordinator), 20))
    lead.start()
    # Junk on the port (a probe, a stray client) is dropped, not counted as a stage.
    with wait_for_coordinator(_stage_of(1, 3, coordinator), timeout_s=10) as stray:
        stray.sendall(b"GET / HTTP/1.0\r\n\r\n")
        with contextlib.suppress(OSError):
            assert stray.recv(1) == b""
    met: list[int] = []

    def later(stage: int) -> None:
        meet_coordinator(_stage_of(stage, 3, coordinator), connect_timeout_s=20, formation_timeout_s=20)
        met.append(stage)

    threads = [threading.Thread(target=later, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in (*threads, lead):
        t.join(timeout=20)
    assert sorted(met) == [1, 2] and not lead.is_alive()
    with socket.socket() as runtime:  # the distributed runtime's coordinator binds the same port next
        runtime.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        runtime.bind(("", port))


def test_a_later_stage_gives_up_when_the_group_never_forms():
    import threading

    from switchyard.service.engine.pipeline_group import GroupFormationError, gather_stages, meet_coordinator

    coordinator = f"127.0.0.1:{_free_port()}"
    def stage_0() -> None:
        with pytest.raises(GroupFormationError):
            gather_stages(_stage_of(0, 3, coordinator), timeout_s=6)

    lead = threading.Thread(target=stage_0)
    lead.start()
    try:
        with pytest.raises(GroupFormationError, match=r"stage 1 of 3: the group at .* did not form within 1\.5 s"):
            meet_coordinator(_stage_of(1, 3, coordinator), connect_timeout_s=10, formation_timeout_s=1.5)
    finally:
        lead.join(timeout=20)


@pytest.mark.parametrize("coordinator", ["stage-0", "stage-0:", ":8476", "stage-0:port", "stage-0:70000"])
def test_a_coordinator_that_is_not_host_and_port_is_refused(coordinator):
    from switchyard.service.engine.pipeline_group import coordinator_address

    with pytest.raises(ValueError, match="not host:port"):
        coordinator_address(coordinator)
    assert coordinator_address("[::1]:8476") == ("::1", 8476)
    assert coordinator_address("g-0.svc:8476") == ("g-0.svc", 8476)
