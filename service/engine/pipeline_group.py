"""A pipeline group across processes: one process (pod) per stage, joined with ``jax.distributed``.

Every step of a pipeline is one SPMD program over all stages' devices, so every process must launch
the same programs in the same order. The first stage owns the scheduler, the tokenizer and the gRPC
front; before it launches a step it sends the step's plan (``plan.py``, as int32 words) to the other
stages over a command channel (TCP), and they launch the same plan on their engines. The later
stages run headless: they answer gRPC health, and follow.

If any stage dies, the others' next collective or command fails (or the distributed runtime's
heartbeat notices it): the group stops as a unit and its processes exit non-zero, so the whole group
is restarted together; there is no half-running group.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

import jax
import numpy as np
from switchyard.service.engine.compile_cache import ProgramStore, WarmUp
from switchyard.service.engine.engine import Engine, PendingStep
from switchyard.service.engine.plan import StepPlan, StepTokens, decode_plan, encode_plan
from switchyard.service.errors import FatalEngineError, GroupFormationError
from switchyard.service.modelspec import GROUP_FORMATION_TIMEOUT_S, ServingLayout

log = logging.getLogger(__name__)

STEP, WARMUP, STOP = 1, 2, 3


class GroupBrokenError(FatalEngineError):
    """A stage of the pipeline group is gone; the group must be restarted as a unit."""


_PROBE_INTERVAL_S = 0.5


def join(layout: ServingLayout, heartbeat_timeout_s: int = 10,
         initialization_timeout_s: int = GROUP_FORMATION_TIMEOUT_S) -> None:
    """Connect this process to its pipeline group (no-op for a single-stage layout).

    The stages first meet over plain TCP on the coordinator's port (:func:`gather_stages`,
    :func:`meet_coordinator`), and only then start the distributed runtime, whose own failures to form
    end in a C++ abort: a stage 0 that cannot listen fails at once, a later stage gives up after
    ``layout.join_timeout_s`` without an answer, and a group that stays incomplete for
    ``initialization_timeout_s`` fails on every stage present; each with :class:`GroupFormationError`."""
    if layout.pp == 1:
        return
    if not layout.coordinator:
        raise ValueError("a pipeline layout (pp > 1) needs layout.coordinator (host:port of stage 0)")
    if layout.pipeline_stage == 0:
        gather_stages(layout, initialization_timeout_s)
    else:
        meet_coordinator(layout, layout.join_timeout_s, initialization_timeout_s)
    if jax.config.jax_platforms in (None, "", "cpu") and not _has_gpu_plugin():
        # Cross-process collectives on CPU (tests, CI) go through gloo.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(layout.coordinator, num_processes=layout.pp, process_id=layout.pipeline_stage,
                               heartbeat_timeout_seconds=heartbeat_timeout_s,
                               initialization_timeout=initialization_timeout_s)


def coordinator_address(coordinator: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as (host, port); ValueError if it is not one."""
    host, colon, port = coordinator.rpartition(":")
    host = host.strip("[]")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"layout.coordinator {coordinator!r} is not host:port")
    return host, int(port)


def wait_for_coordinator(layout: ServingLayout, timeout_s: float) -> socket.socket:
    """A connection to the coordinator's port, once it accepts one; GroupFormationError after
    ``timeout_s`` of refusals, unresolvable names (a pod not created yet has no DNS record) or silence."""
    host, port = coordinator_address(layout.coordinator)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic())))
        except OSError as err:
            reason = err.strerror or str(err) or type(err).__name__
        left = deadline - time.monotonic()
        if left <= 0:
            raise GroupFormationError(
                f"pipeline stage {layout.pipeline_stage} of {layout.pp}: the group's coordinator "
                f"{layout.coordinator} (stage 0) did not answer within {timeout_s:g} s ({reason})")
        time.sleep(min(_PROBE_INTERVAL_S, left))


_HELLO = struct.Struct("<4sI")  # magic, stage
_MAGIC, _GO = b"SYPG", b"GO"


def meet_coordinator(layout: ServingLayout, connect_timeout_s: float, formation_timeout_s: float) -> None:
    """A later stage: say which stage this is to stage 0, and return when stage 0 says the whole
    group is present. GroupFormationError when stage 0 does not answer, goes away, or the group stays
    incomplete for ``formation_timeout_s``."""
    where = f"pipeline stage {layout.pipeline_stage} of {layout.pp}"
    with wait_for_coordinator(layout, connect_timeout_s) as conn:
        try:
            conn.settimeout(formation_timeout_s)
            conn.sendall(_HELLO.pack(_MAGIC, layout.pipeline_stage))
            reply = _recv_exactly(conn, len(_GO))
        except TimeoutError:
            raise GroupFormationError(f"{where}: the group at {layout.coordinator} did not form within "
                                      f"{formation_timeout_s:g} s") from None
        except OSError:
            reply = b""  # reset by stage 0: as good as closed
        if reply != _GO:
            raise GroupFormationError(f"{where}: the group's coordinator {layout.coordinator} closed the "
                                      f"connection before the group formed")


def gather_stages(layout: ServingLayout, timeout_s: float) -> None:
    """Stage 0: listen on the coordinator's port until every later stage has said hello, then tell
    them all to go on and free the port for the distributed runtime's coordinator. GroupFormationError
    at once when the port cannot be had, and after ``timeout_s`` when a stage has not come."""
    _, port = coordinator_address(layout.coordinator)
    where = f"pipeline stage 0 of {layout.pp}"
    try:
        if socket.has_dualstack_ipv6():
            listener = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        else:
            listener = socket.create_server(("", port))
    except OSError as err:
        raise GroupFormationError(f"{where}: cannot listen on the coordinator port {port} "
                                  f"({err.strerror or type(err).__name__})") from None
    joined: dict[int, socket.socket] = {}
    deadline = time.monotonic() + timeout_s
    try:
        with listener:
            while len(joined) < layout.pp - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [s for s in range(1, layout.pp) if s not in joined]
                    raise GroupFormationError(
                        f"{where}: stage{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did "
                        f"not join at {layout.coordinator} within {timeout_s:g} s")
                listener.settimeout(min(left, 1.0))
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                stage = _read_hello(conn, layout.pp)
                if stage is None:
                    conn.close()
                    continue
                if stage in joined:  # a restarted stage: its earlier connection is stale
                    joined[stage].close()
                joined[stage] = conn
            for conn in joined.values():
                conn.sendall(_GO)
            for conn in joined.values():
                # Wait for the stage to close first, so that the port is left without connections
                # in TIME_WAIT on this side when the runtime's coordinator binds it.
                conn.settimeout(5.0)
                with contextlib.suppress(OSError):
                    conn.recv(1)
    finally:
        for conn in joined.values():
            conn.close()


def _read_hello(conn: socket.socket, pp: int) -> int | None:
    """The stage a new connection says it is; None for anything that is not a later stage's hello."""
    conn.settimeout(2.0)
    try:
        magic, stage = _HELLO.unpack(_recv_exactly(conn, _HELLO.size))
    except (OSError, struct.error):
        return None
    return stage if magic == _MAGIC and 0 < stage < pp else None


def _recv_exactly(conn: socket.socket, n: int) -> bytes:
    """Up to ``n`` bytes: fewer only when the peer closed the connection."""
    data = b""
    while len(data) < n:
        part = conn.recv(n - len(data))
        if not part:
            break
        data += part
    return data


def _has_gpu_plugin() -> bool:
    try:
        import jax_plugins.xla_cuda13

        return True
    except ImportError:
        try:
            import jax_plugins.xla_cuda12  # noqa: F401

            return True
        except ImportError:
            return False


class CommandChannel:
    """Stage 0's announcements to the other stages: length-prefixed int32 frames over TCP.

    A host channel, not a device collective, so that announcing tick n+1 never waits for tick n to
    finish on the devices: the stages' hosts run ahead exactly as one engine's host does, and the
    devices meet only inside the programs' own collectives. Stage 0 listens on an ephemeral port and
    tells the others with one broadcast collective at set-up; they connect to the coordinator's host
    (stage 0's pod). A closed connection is a lost stage.
    """

    def __init__(self, sockets: list[socket.socket]) -> None:
        self._sockets = sockets

    @classmethod
    def open(cls, layout: ServingLayout, timeout_s: float = 300.0) -> CommandChannel:
        """Stage 0 accepts every other stage; a later stage connects to stage 0. Every process of the
        group calls this once, at the same point of its program order."""
        from jax.experimental import multihost_utils

        if layout.pipeline_stage == 0:
            server = socket.create_server(("", 0))
            port = server.getsockname()[1]
            multihost_utils.broadcast_one_to_all(np.array([port], np.int32), is_source=True)
            server.settimeout(timeout_s)
            peers = []
            try:
                for _ in range(layout.pp - 1):
                    conn, _ = server.accept()
                    conn.settimeout(None)
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    peers.append(conn)
            except TimeoutError as err:
                raise GroupBrokenError(f"only {len(peers)} of {layout.pp - 1} later stages connected "
                                       f"within {timeout_s:.0f} s") from err
            finally:
                server.close()
            return cls(peers)
        port = int(multihost_utils.broadcast_one_to_all(np.zeros(1, np.int32), is_source=False)[0])
        host = layout.coordinator.rsplit(":", 1)[0].strip("[]")
        conn = socket.create_connection((host, port), timeout=timeout_s)
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls([conn])

    def send(self, op: int, words: np.ndarray | None = None) -> None:
        """An operation for every other stage, with its int32 ``words``."""
        message = np.concatenate([np.array([op], np.int32), np.zeros(0, np.int32) if words is None else words])
        frame = struct.pack("<I", len(message)) + message.astype(np.int32).tobytes()
        for conn in self._sockets:
            conn.sendall(frame)

    def receive(self) -> np.ndarray:
        (count,) = struct.unpack("<I", self._read(4))
        return np.frombuffer(self._read(4 * count), np.int32)

    def _read(self, n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            chunk = self._sockets[0].recv(n - len(data))
            if not chunk:
                raise GroupBrokenError("stage 0 closed the command channel without releasing this stage")
            data += chunk
        return bytes(data)

    def close(self) -> None:
        for conn in self._sockets:
            conn.close()


class LeaderEngine:
    """Stage 0's engine: an :class:`~switchyard.service.engine.engine.Engine` over every stage's
    devices whose every launch (and warm-up) is first sent to the group, which launches the same.
    Its sizes and its policy are the wrapped engine's."""

    def __init__(self, engine: Engine, channel: CommandChannel) -> None:
        self.engine = engine
        self._channel = channel
        self.broken: BaseException | None = None  # set once a group collective has failed
        for name in ("spec", "config", "policy", "max_slots", "max_seq_len", "kv_tokens", "kv_block_size",
                     "step_tokens", "weights_label", "kv_cache_label"):
            setattr(self, name, getattr(engine, name))

    def _announce(self, op: int, words: np.ndarray | None = None) -> None:
        if self.broken is not None:
            raise GroupBrokenError(f"the pipeline group is broken: {self.broken}")
        try:
            self._channel.send(op, words)
        except Exception as err:
            self.broken = err
            raise GroupBrokenError(f"a pipeline stage did not answer: {err}") from err

    def _run(self, call: Any, *args: Any) -> Any:
        """Stage 0's part of a call the whole group runs: a failure here leaves the other stages in an
        unknown state (or waiting in a collective), so the group is broken."""
        try:
            return call(*args)
        except Exception as err:
            self.broken = err
            raise GroupBrokenError(f"stage 0 failed a call the whole group runs: {err!r}") from err

    def launch(self, plan: StepPlan) -> PendingStep:
        self._announce(STEP, encode_plan(plan))
        return self._run(self.engine.launch, plan)

    def collect(self, pending: PendingStep) -> StepTokens:
        return self._run(self.engine.collect, pending)

    def warmup(self, store: ProgramStore | None = None,
               on_program: Callable[[int, int], None] | None = None) -> WarmUp:
        """Compile every program the group will run, on every stage. Stages compile their own programs
        (every stage runs each one; an executable loaded on one process alone would leave the others
        tracing), so ``store`` is not used; XLA's layer of the compile cache serves every stage."""
        self._announce(WARMUP)
        return self._run(self.engine.warmup, None, on_program)

    def compiled_count(self) -> int:
        return self.engine.compiled_count()

    def stop(self) -> None:
        """Release the followers (they exit their loop)."""
        if self.broken is None:
            self._channel.send(STOP)


def exit_now(code: int) -> NoReturn:
    """End this stage's process at once. A normal exit would first wait in the distributed runtime's
    shutdown barrier for every other stage, which a broken group may never reach; gone at once, this
    process stops heartbeating and the runtime stops the others within its heartbeat timeout."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def follow(engine: Engine, channel: CommandChannel) -> None:
    """A later stage's loop: launch every plan stage 0 sends, until it says stop.

    Like stage 0 it keeps one step in flight: it waits for step n-1 only after launching step n, so a
    failed program surfaces here while the devices stay busy."""
    in_flight: PendingStep | None = None
    while True:
        message = channel.receive()
        op = int(message[0])
        if op == STOP:
            if in_flight is not None:
                jax.block_until_ready(in_flight.tokens)
            return
        if op == WARMUP:
            engine.warmup()
        elif op == STEP:
            pending = engine.launch(decode_plan(message[1:]))
            if in_flight is not None:
                jax.block_until_ready(in_flight.tokens)
            in_flight = pending
        else:
            raise RuntimeError(f"unknown pipeline command {op}")
