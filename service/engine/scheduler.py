"""Continuous batching: admits requests, plans every engine step, streams the tokens back.

One thread runs :meth:`Scheduler.run`; any thread may :meth:`submit` and :meth:`cancel`. Between two
engine steps the scheduler retires finished, cancelled and expired requests (freeing their slots and
KV blocks), admits queued ones, then plans and launches one step, and only then streams the previous
step's tokens: the device works on step n+1 while the host handles step n.

It owns the KV manager (``kv_manager.py``: slots, blocks, tables, the prefix cache) and the step
policy (``step_policy.py``: how much a step carries, in which compiled shape); the engine only
launches the plans (``plan.py``). A request is admitted, first come first served, when a slot is free
and the pool has blocks for its prompt; each step carries one token for every decoding request plus
the next chunk of the oldest prompt not yet computed (beside the whole remainders of later short
ones, as the step policy packs them), so no prompt waits behind a later one and no decoding stream
waits for a whole prompt. When the pool runs short for the decoding requests' next tokens, the
request admitted last is preempted: its blocks go back, and it returns to the head of the queue to be
recomputed (prompt and tokens so far) and continue where it stopped.

Tokens are ids here: text (detokenizing, stop strings) is the server's (``service/api/text.py``).
Per-token timings go into preallocated arrays (no object per token) for tracing.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from switchyard.service.engine.kv_manager import KVManager
from switchyard.service.engine.request import GenerationRequest, RequestRecord, TokenEvent
from switchyard.service.engine.step_policy import StepPolicy
from switchyard.service.errors import (
    DuplicateRequestError,
    FatalEngineError,
    InvalidRequestError,
    OutOfRangeError,
    QueueFullError,
    quoted,
)

__all__ = ["GenerationRequest", "RequestRecord", "Scheduler", "TokenEvent"]

log = logging.getLogger(__name__)

MAX_STOP_TOKEN_IDS = 64
MAX_REQUEST_ID_CHARS = 256


class _Live:
    """A request from submission to its final event."""

    def __init__(self, req: GenerationRequest, eos_token_ids: Sequence[int], t_submit: float) -> None:
        self.req = req
        self.t_submit = t_submit
        self.t_admit = self.t_first = float("nan")
        self.slot: int | None = None
        self.epoch = 0  # admissions so far: a step's token is this request's if planned in its epoch
        n = req.max_tokens
        self.ids = np.zeros(n, np.int32)
        self.times = np.zeros(n, np.float64)
        self.steps = np.zeros(n, np.int64)
        self.batches = np.zeros(n, np.int32)
        self.n = 0
        self.stop_ids = set(req.stop_token_ids) | (set() if req.ignore_eos else set(eos_token_ids))
        self.done = False
        self.chunk_steps: list[int] = []
        self.chunk_times: list[float] = []
        self.chunk_tokens: list[int] = []
        self.cached_tokens = 0
        self.preemptions = 0

    def engine_prompt(self) -> list[int]:
        """What the engine computes before the next token: the prompt, and after a preemption the
        tokens made so far."""
        return list(self.req.prompt_ids) + [int(t) for t in self.ids[: self.n]]


class _Launched:
    """A launched step and whose tokens it makes: the decode rows' requests (each in the epoch it was
    planned in) and, per chunk of the plan, the request whose prompt it completes (None: it completes
    none)."""

    def __init__(self, pending: Any, rows: list[tuple[_Live, int]],
                 completing: list[tuple[_Live, int] | None]) -> None:
        self.pending = pending
        self.rows = rows
        self.completing = completing


class Scheduler:
    def __init__(
        self,
        engine: Any,
        *,
        eos_token_ids: Sequence[int] | None = None,
        max_queue: int = 64,
        on_finish: Callable[[RequestRecord], None] | None = None,
        model_name: str | None = None,
        policy: StepPolicy | None = None,
    ) -> None:
        self.engine = engine
        # The model's end-of-sequence ids stop a request (unless it ignores them); None: the checkpoint's.
        self.eos_token_ids = tuple(engine.spec.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.max_queue = max_queue
        self.on_finish = on_finish
        self.model_name = model_name or engine.spec.name
        self.policy = policy or engine.policy
        self.kv = KVManager(max_slots=engine.max_slots, max_seq_len=engine.max_seq_len, kv_tokens=engine.kv_tokens,
                            block_size=engine.kv_block_size)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: collections.deque[_Live] = collections.deque()
        self._live: dict[str, _Live] = {}
        self._slots: dict[int, _Live] = {}
        self._cancel: set[str] = set()
        self._in_flight: _Launched | None = None  # the step launched last, not yet collected
        self._admitted: list[_Live] = []  # requests holding a slot, in admission order

    # ---- properties ------------------------------------------------------------------------------
    @property
    def active_slots(self) -> int:
        return len(self._slots)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def max_slots(self) -> int:
        return self.engine.max_slots

    @property
    def max_seq_len(self) -> int:
        return self.engine.max_seq_len

    @property
    def in_flight(self) -> int:
        return len(self._live)

    @property
    def kv_blocks_held(self) -> int:
        """KV blocks the requests hold."""
        return self.kv.held_blocks()

    # ---- any thread ------------------------------------------------------------------------------
    def validate(self, req: GenerationRequest) -> None:
        """Raise InvalidRequestError / OutOfRangeError for a request this deployment cannot run."""
        if not isinstance(req.request_id, str) or not req.request_id:
            raise InvalidRequestError("request_id must be a non-empty string")
        if len(req.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError(f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
        prompt, max_seq, vocab = req.prompt_ids, self.engine.max_seq_len, self.engine.spec.vocab_size
        if len(prompt) == 0:
            raise InvalidRequestError("prompt is empty: give at least one token")
        if len(prompt) >= max_seq:
            raise OutOfRangeError(f"prompt has {len(prompt)} tokens; this deployment's context is {max_seq} tokens, "
                                  f"so a prompt may have at most {max_seq - 1}")
        bad = [t for t in prompt if not 0 <= int(t) < vocab]
        if bad:
            more = "..." if len(bad) > 5 else ""
            raise InvalidRequestError(f"token ids must be in [0, {vocab}); got {bad[:5]}{more}")
        room = max_seq - len(prompt)
        if isinstance(req.max_tokens, bool) or not isinstance(req.max_tokens, int) or req.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {req.max_tokens!r}")
        if req.max_tokens > room:
            raise OutOfRangeError(
                f"max_tokens {req.max_tokens} does not fit: the prompt has {len(prompt)} tokens and the "
                f"context is {max_seq}, leaving room for {room}")
        if isinstance(req.min_tokens, bool) or not isinstance(req.min_tokens, int) or \
                not 0 <= req.min_tokens <= req.max_tokens:
            raise InvalidRequestError(f"min_tokens must be an integer from 0 to max_tokens ({req.max_tokens}), "
                                      f"got {req.min_tokens!r}")
        self.kv.check_fits(len(prompt), req.max_tokens)
        req.sampling.validate()
        if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
        bad = [t for t in req.stop_token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"stop token ids must be in [0, {vocab}), got {bad[:5]}")

    def submit(self, req: GenerationRequest) -> None:
        """Validate and enqueue; raises InvalidRequestError / OutOfRangeError / QueueFullError."""
        self.validate(req)
        live = _Live(req, self.eos_token_ids, time.monotonic())
        with self._lock:
            if req.request_id in self._live:
                raise DuplicateRequestError(f"request id {quoted(req.request_id)} is already in flight")
            if len(self._queue) >= self.max_queue:
                raise QueueFullError(
                    f"the admission queue is full ({self.max_queue} waiting, {len(self._slots)} generating); "
                    "retry later")
            self._queue.append(live)
            self._live[req.request_id] = live
            self._wake.notify()

    def cancel(self, request_id: str) -> None:
        """Stop a request; its slot is freed at the next step. Unknown or finished ids are ignored."""
        with self._lock:
            if request_id in self._live:
                self._cancel.add(request_id)
                self._wake.notify()

    # ---- the scheduler thread --------------------------------------------------------------------
    def run(self, stop: threading.Event, after_step: Callable[[], None] | None = None) -> None:
        """Step until ``stop``; ``after_step`` runs after every step (an engine in its own process
        sends the step's events on from there, in one message)."""
        while not stop.is_set():
            worked = self.step()
            if after_step is not None:
                after_step()
            if not worked:
                with self._lock:
                    if not self._queue and not self._slots and not self._cancel:
                        self._wake.wait(timeout=0.05)

    def step(self) -> bool:
        """Retire, admit, launch the next engine step, then stream the previous step's tokens.

        Launching step n+1 before handling step n's tokens keeps the device busy while the host
        streams; a request that finishes at step n gets one extra token at n+1, which is dropped.
        """
        worked = self._retire()
        previous = self._in_flight
        worked |= self._admit()
        self._in_flight = self._launch() if self._slots else None
        if previous is not None:
            self._stream(previous)
            worked = True
        return worked or self._in_flight is not None

    def _retire(self) -> bool:
        now = time.monotonic()
        with self._lock:
            cancelled, self._cancel = self._cancel, set()
            doomed = [(live, "cancelled") for rid in cancelled if (live := self._live.get(rid))]
            doomed += [(live, "deadline") for live in self._live.values()
                       if live.req.deadline is not None and live.req.deadline <= now and live.req.request_id
                       not in cancelled]
            for live, _ in doomed:
                if live.slot is None and live in self._queue:
                    self._queue.remove(live)
        for live, reason in doomed:
            self._finish(live, reason, now, token_id=None)
        return bool(doomed)

    def _admit(self) -> bool:
        """Begin queued requests, in order, while a slot is free and the pool has their blocks
        (keeping a reserve for the decoding requests' growth)."""
        kv = self.kv
        admitted = False
        free = kv.free_slots()
        reserve = max(1, kv.pool.usable_blocks // 100)
        while free:
            with self._lock:
                if not self._queue:
                    break
                live = self._queue[0]
            prompt = live.engine_prompt()
            reuse = live.req.reuse_prefix
            if self._admitted and kv.blocks_to_begin(prompt, reuse) + reserve > kv.free_blocks():
                break  # first come, first served: later requests wait behind this one
            slot = free[0]
            cached = kv.begin(slot, prompt, live.req.sampling, counter=live.n, reuse_prefix=reuse)
            if cached is None:
                break
            with self._lock:
                self._queue.popleft()
            free.pop(0)
            if math.isnan(live.t_admit):
                live.t_admit = time.monotonic()
                live.cached_tokens = cached
            live.slot = slot
            live.epoch += 1
            self._slots[slot] = live
            self._admitted.append(live)
            admitted = True
        return admitted

    def _launch(self) -> _Launched | None:
        """Room for the decoding requests' next tokens (preempting the latest admitted when short),
        then one step with them and the unfinished prompts' next chunks, oldest first."""
        kv = self.kv
        while not kv.ensure_decode_blocks():
            self._preempt(self._admitted[-1])
        prompting = [live.slot for live in self._admitted if kv.sequence(live.slot).left > 0]
        plan = self.policy.plan(kv, prompting, self._backlog())
        if plan is None:
            return None
        rows = [(live, live.epoch) for live in (self._slots[int(s)] for s in plan.rows)]
        try:
            pending = self.engine.launch(plan)
        except Exception as err:
            self._fail_active("engine step failed")
            if isinstance(err, FatalEngineError):
                self._fail_all(err)
            return None
        kv.launched(plan)
        completing: list[tuple[_Live, int] | None] = []
        now = time.monotonic()
        for chunk in plan.chunks:
            owner = self._slots[chunk.slot]
            owner.chunk_steps.append(pending.step)
            owner.chunk_times.append(now)
            owner.chunk_tokens.append(chunk.length)
            completing.append((owner, owner.epoch) if chunk.completes else None)
        return _Launched(pending, rows, completing)

    def _backlog(self) -> int:
        """Prompt tokens not yet computed, of the requests begun and of those waiting to begin (the
        queue is short: at most ``max_queue``)."""
        begun = sum(self.kv.sequence(live.slot).left for live in self._admitted)
        with self._lock:
            return begun + sum(len(live.req.prompt_ids) + live.n for live in self._queue)

    def _preempt(self, live: _Live) -> None:
        """Take a request's slot and blocks back; it waits at the head of the queue to be recomputed."""
        log.info("preempting %s (KV pool full): it will be recomputed", live.req.request_id)
        self._release_slot(live)
        live.preemptions += 1
        with self._lock:
            self._queue.appendleft(live)

    def _release_slot(self, live: _Live) -> None:
        self.kv.evict(live.slot)
        self._slots.pop(live.slot, None)
        if live in self._admitted:
            self._admitted.remove(live)
        live.slot = None

    def _stream(self, launched: _Launched) -> None:
        try:
            result = self.engine.collect(launched.pending)
        except Exception as err:
            self._fail_active("engine step failed")
            if isinstance(err, FatalEngineError):
                self._fail_all(err)
            return
        now = time.monotonic()
        batch = len(launched.rows)
        for (live, epoch), token in zip(launched.rows, result.tokens, strict=True):
            if live.epoch == epoch and not live.done:
                self._emit_token(live, int(token), step=result.step, batch=batch, now=now)
        batch += sum(c is not None for c in launched.completing)
        for completing, token in zip(launched.completing, result.chunk_tokens, strict=True):
            if completing is not None and completing[0].epoch == completing[1] and not completing[0].done:
                self._emit_token(completing[0], int(token), step=result.step, batch=batch, now=now)

    def _fail_all(self, err: FatalEngineError) -> None:
        """The engine is gone for good: fail everything queued too, then stop the loop (the server
        reports NOT_SERVING and exits, so the pod, or the pipeline group, restarts)."""
        now = time.monotonic()
        with self._lock:
            queued, self._queue = list(self._queue), collections.deque()
        for live in queued:
            self._finish(live, "error", now, token_id=None)
        raise err

    def _fail_active(self, what: str) -> None:
        log.exception("%s; failing the %d active requests", what, len(self._slots))
        now = time.monotonic()
        for live in list(self._slots.values()):
            self._finish(live, "error", now, token_id=None)

    # ---- per token -------------------------------------------------------------------------------
    def _emit_token(self, live: _Live, token: int, step: int, batch: int, now: float) -> None:
        i = live.n
        if i == 0:
            live.t_first = now
        live.ids[i], live.times[i], live.steps[i], live.batches[i] = token, now, step, batch
        live.n += 1
        if token in live.stop_ids and live.n > live.req.min_tokens:
            self._finish(live, "stop", now, token_id=token)
        elif live.n >= live.req.max_tokens:  # validated to fit the context
            self._finish(live, "length", now, token_id=token)
        else:
            self._send(live, TokenEvent(live.req.request_id, i, token, None, step, batch, now))

    def _finish(self, live: _Live, reason: str, now: float, token_id: int | None) -> None:
        if live.done:
            return
        live.done = True
        if live.slot is not None:
            self._release_slot(live)
        with self._lock:
            self._live.pop(live.req.request_id, None)
            self._cancel.discard(live.req.request_id)
        index = live.n - 1 if token_id is not None else live.n
        step = int(live.steps[live.n - 1]) if token_id is not None and live.n else -1
        batch = int(live.batches[live.n - 1]) if token_id is not None and live.n else len(self._slots)
        # The record goes out before the final event, so a client that sees its stream end can already
        # find the request's trace.
        if self.on_finish is not None:
            n = live.n
            record = RequestRecord(
                request_id=live.req.request_id, prompt_tokens=len(live.req.prompt_ids),
                token_ids=live.ids[:n].copy(), token_times=live.times[:n].copy(), token_steps=live.steps[:n].copy(),
                token_batch_sizes=live.batches[:n].copy(), t_submit=live.t_submit, t_admit=live.t_admit,
                t_first_token=live.t_first, t_end=now, finish_reason=reason, model=self.model_name,
                sampling=live.req.sampling, max_tokens=live.req.max_tokens,
                chunk_steps=np.asarray(live.chunk_steps, np.int64),
                chunk_times=np.asarray(live.chunk_times, np.float64),
                chunk_tokens=np.asarray(live.chunk_tokens, np.int32), cached_tokens=live.cached_tokens,
                preemptions=live.preemptions)
            try:
                self.on_finish(record)
            except Exception:
                log.exception("on_finish hook failed for %s", live.req.request_id)
        self._send(live, TokenEvent(live.req.request_id, index, token_id, reason, step, batch, now))

    def _send(self, live: _Live, event: TokenEvent) -> None:
        if live.req.on_event is None:
            return
        try:
            live.req.on_event(event)
        except Exception:
            log.exception("event callback failed for %s", live.req.request_id)
