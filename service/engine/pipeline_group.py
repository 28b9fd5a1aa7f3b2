"""A pipeline group across processes: one process (pod) per stage, joined with ``jax.distributed``.

Every step of a pipeline is one SPMD program over all stages' devices, so every process must launch
the same programs in the same order. The first stage owns the scheduler, the tokenizer and the gRPC
front; before each program it launches it announces the call (operation and arguments, a small int32
vector) to the other stages over a command channel (TCP), and they run the same call. The later stages
run headless: they answer gRPC health, and follow.

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
from collections.abc import Sequence
from typing import Any, NoReturn

import jax
import numpy as np
from switchyard.service.engine.contract import PendingStep, Prefix, StepResult
from switchyard.service.engine.pipeline import PipelineEngine
from switchyard.service.engine.sampling import SamplingParams
from switchyard.service.engine.tensor_parallel import warm_up
from switchyard.service.errors import FatalEngineError, GroupFormationError
from switchyard.service.modelspec import ModelSpec, ServingLayout

log = logging.getLogger(__name__)

PREFILL, INSERT, TICK, STOP = 1, 2, 3, 4


class GroupBrokenError(FatalEngineError):
    """A stage of the pipeline group is gone; the group must be restarted as a unit."""


HEADER = 10  # op, a, b, c, d, temperature bits, top_k, top_p bits, seed, greedy

# How long a later stage waits for stage 0's coordinator port to accept a connection before it gives up.
# Long enough for a stage 0 started at the same time to import, check its model folder and open the
# port; short enough that a stage whose group cannot form exits in seconds (and is restarted) instead of
# waiting out the distributed runtime's initialization timeout, which ends in a C++ abort.
JOIN_TIMEOUT_S = 30.0
_PROBE_INTERVAL_S = 0.5


def join(layout: ServingLayout, heartbeat_timeout_s: int = 10, initialization_timeout_s: int = 300,
         coordinator_timeout_s: float = JOIN_TIMEOUT_S) -> None:
    """Connect this process to its pipeline group (no-op for a single-stage layout).

    The stages first meet over plain TCP on the coordinator's port (:func:`gather_stages`,
    :func:`meet_coordinator`), and only then start the distributed runtime, whose own failures to form
    end in a C++ abort: a stage 0 that cannot listen fails at once, a later stage gives up after
    ``coordinator_timeout_s`` without an answer, and a group that stays incomplete for
    ``initialization_timeout_s`` fails on every stage present; each with :class:`GroupFormationError`."""
    if layout.pp == 1:
        return
    if not layout.coordinator:
        raise ValueError("a pipeline layout (pp > 1) needs layout.coordinator (host:port of stage 0)")
    if layout.pipeline_stage == 0:
        gather_stages(layout, initialization_timeout_s)
    else:
        meet_coordinator(layout, coordinator_timeout_s, initialization_timeout_s)
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


def _f32_bits(x: float) -> int:
    return int(np.array([x], np.float32).view(np.int32)[0])


def _bits_f32(x: int) -> float:
    return float(np.array([x], np.int32).view(np.float32)[0])


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

    def send(self, op: int, *fields: int, tokens: np.ndarray | None = None) -> None:
        message = np.zeros(HEADER + (0 if tokens is None else len(tokens)), np.int32)
        message[0] = op
        message[1 : 1 + len(fields)] = fields
        if tokens is not None:
            message[HEADER:] = tokens
        frame = struct.pack("<I", len(message)) + message.tobytes()
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


def _sampling_fields(s: SamplingParams) -> tuple[int, int, int, int, int]:
    return _f32_bits(s.temperature), s.top_k, _f32_bits(s.top_p), s.seed, int(s.greedy)


def _sampling_from(message: np.ndarray) -> SamplingParams:
    return SamplingParams(temperature=_bits_f32(int(message[5])), top_k=int(message[6]),
                          top_p=_bits_f32(int(message[7])), seed=int(message[8]))


class LeaderEngine:
    """Stage 0's engine: a :class:`PipelineEngine` whose every SPMD call is first announced to the group.

    Implements :class:`~switchyard.service.engine.contract.DecodeEngine`: the calls that run programs
    on every stage (prefill, insert, dispatch, warmup) are announced, then run on the wrapped engine;
    the host-side ones (slots, bookkeeping) are the wrapped engine's, delegated.
    """

    def __init__(self, engine: PipelineEngine, channel: CommandChannel) -> None:
        self.engine = engine
        self._channel = channel
        self.broken: BaseException | None = None  # set once a group collective has failed

    def _announce(self, op: int, *fields: int, tokens: np.ndarray | None = None) -> None:
        if self.broken is not None:
            raise GroupBrokenError(f"the pipeline group is broken: {self.broken}")
        try:
            self._channel.send(op, *fields, tokens=tokens)
        except Exception as err:
            self.broken = err
            raise GroupBrokenError(f"a pipeline stage did not answer: {err}") from err

    def _run(self, call: Any, *args: Any) -> Any:
        """Stage 0's part of an announced call. The other stages run it too, so a failure here
        leaves them in an unknown state (or waiting in a collective): the group is broken."""
        try:
            return call(*args)
        except Exception as err:
            self.broken = err
            raise GroupBrokenError(f"stage 0 failed a call the whole group runs: {err!r}") from err

    # ---- host-side: the wrapped engine's ---------------------------------------------------------------
    @property
    def spec(self) -> ModelSpec:
        return self.engine.spec

    @property
    def max_slots(self) -> int:
        return self.engine.max_slots

    @property
    def max_seq_len(self) -> int:
        return self.engine.max_seq_len

    @property
    def kv_tokens(self) -> int:
        return self.engine.kv_tokens

    @property
    def kv_block_size(self) -> int:
        return self.engine.kv_block_size

    @property
    def step_tokens(self) -> int:
        return self.engine.step_tokens

    def validate_prompt(self, tokens: Sequence[int]) -> None:
        self.engine.validate_prompt(tokens)

    def free_slots(self) -> list[int]:
        return self.engine.free_slots()

    def room(self, slot: int) -> int:
        return self.engine.room(slot)

    def slot_generation(self, slot: int) -> int:
        return self.engine.slot_generation(slot)

    def evict(self, slot: int) -> None:
        """Host bookkeeping only: the freed slot's stale state is overwritten by the next insert."""
        self.engine.evict(slot)

    def compiled_count(self) -> int:
        return self.engine.compiled_count()

    # ---- programs of the whole group: announced, then run ----------------------------------------------
    def prefill(self, tokens: Sequence[int], sampling: SamplingParams | None = None,
                return_logits: bool = False) -> Prefix:
        sampling = sampling or SamplingParams()
        padded = self.engine.padded_prompt(tokens, sampling)  # bad requests are refused before any announce
        n, bucket = len(tokens), len(padded)
        self._announce(PREFILL, bucket, n, int(return_logits), 0, *_sampling_fields(sampling), tokens=padded)
        return self._run(self.engine.run_prefill, padded, n, sampling, return_logits)

    def insert(self, prefix: Prefix, slot: int) -> None:
        self.engine.check_free(slot)
        self._announce(INSERT, slot, prefix.first_token, prefix.length, prefix.bucket,
                       *_sampling_fields(prefix.sampling))
        self._run(self.engine.insert, prefix, slot)

    def dispatch(self, return_logits: bool = False) -> PendingStep:
        if return_logits:
            raise NotImplementedError("a pipeline tick does not return logits; use prefill logits to check")
        self._announce(TICK, self.engine.tick, int(self.engine.greedy_only()))
        return self._run(self.engine.dispatch)

    def collect(self, pending: PendingStep) -> StepResult:
        return self._run(self.engine.collect, pending)

    def generate(self, return_logits: bool = False) -> StepResult:
        return self.collect(self.dispatch(return_logits))

    def warmup(self) -> float:
        """Compile every program the group will run, on every stage (each call is announced)."""

        def ticks(greedy: bool) -> None:
            for t in range(self.engine.pp):  # one program per local micro-batch array
                self._announce(TICK, t, int(greedy))
                self.engine.run_tick(t, greedy).block_until_ready()

        return warm_up(self, self.engine, ticks)

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


def follow(engine: PipelineEngine, channel: CommandChannel) -> None:
    """A later stage's loop: run whatever stage 0 announces, until it says stop.

    Like stage 0 it keeps one tick in flight: it waits for tick n-1 only after launching tick n, so a
    failed program surfaces here while the devices stay busy."""
    prefix: Prefix | None = None
    in_flight: jax.Array | None = None
    while True:
        message = channel.receive()
        op = int(message[0])
        if op == STOP:
            if in_flight is not None:
                in_flight.block_until_ready()
            return
        if op == PREFILL:
            bucket, n, return_logits = int(message[1]), int(message[2]), bool(message[3])
            padded = message[HEADER : HEADER + bucket].astype(np.int32)
            prefix = engine.run_prefill(padded, n, _sampling_from(message), return_logits)
        elif op == INSERT:
            if prefix is None:
                raise RuntimeError("insert announced before any prefill")
            slot, first, length = int(message[1]), int(message[2]), int(message[3])
            prefix.first_token, prefix.length = first, length  # stage 0's values
            prefix.sampling = _sampling_from(message)
            engine.run_insert(prefix, slot)
        elif op == TICK:
            tokens = engine.run_tick(int(message[1]), bool(message[2]))
            if in_flight is not None:
                in_flight.block_until_ready()
            in_flight = tokens
        else:
            raise RuntimeError(f"unknown pipeline command {op}")
