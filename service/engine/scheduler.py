"""Continuous batching: admits requests into engine slots, steps the engine, streams tokens.

One thread runs :meth:`Scheduler.run`; any thread may :meth:`submit` and :meth:`cancel`. Between two
engine steps the scheduler retires finished, cancelled and expired requests (freeing their slots and
KV blocks), admits queued ones, then launches one step.

With a token-budget engine (paged KV pool) a request is admitted, first come first served, when a
slot is free and the pool has blocks for its prompt; each step carries one token for every decoding
request plus the next chunk of the oldest prompt not yet computed, so no prompt waits behind a later
one and no decoding stream waits for a whole prompt. When the pool runs short for the decoding
requests' next tokens, the request admitted last is preempted: its blocks go back, and it returns
to the head of the queue to be recomputed (prompt and tokens so far) and continue where it stopped.
With a slot engine, queued prompts are prefilled whole into free slots between two steps.

Per-token timings go into preallocated arrays (no object per token) for tracing.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable

import numpy as np
from switchyard.service.engine.contract import DecodeEngine, PendingStep, StepResult, TokenBudgetEngine
from switchyard.service.engine.sampling import SamplingParams
from switchyard.service.engine.tokenizer import IncrementalDecoder, Tokenizer
from switchyard.service.errors import (
    DuplicateRequestError,
    FatalEngineError,
    InvalidRequestError,
    OutOfRangeError,
    QueueFullError,
    quoted,
)

__all__ = [
    "GenerationRequest", "InvalidRequestError", "OutOfRangeError", "QueueFullError", "RequestRecord",
    "Scheduler", "TokenEvent",
]

log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_REQUEST_ID_CHARS = 256


@dataclasses.dataclass
class TokenEvent:
    request_id: str
    index: int  # 0-based output position
    token_id: int | None  # None on a final event without a token
    text: str  # UTF-8-safe delta; held back while it could begin a stop string
    finish_reason: str | None  # None, "stop", "length", "cancelled", "deadline", "error"
    step: int  # engine step that made the token (-1: the prefill)
    batch_size: int
    time: float  # time.monotonic()


@dataclasses.dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    deadline: float | None = None  # time.monotonic() value
    on_event: Callable[[TokenEvent], None] | None = None  # called on the scheduler thread
    ignore_eos: bool = False  # generate exactly max_tokens unless a stop id or string is met
    reuse_prefix: bool = True  # may share cached KV blocks of an identical prompt prefix


@dataclasses.dataclass
class RequestRecord:
    """Everything measured about one request, handed to ``on_finish`` (tracing)."""

    request_id: str
    prompt_tokens: int
    token_ids: np.ndarray  # int32 [n]
    token_times: np.ndarray  # float64 [n], monotonic emit times
    token_steps: np.ndarray  # int64 [n]
    token_batch_sizes: np.ndarray  # int32 [n]
    t_submit: float
    t_admit: float  # left the queue, prefill started
    t_first_token: float
    t_end: float
    finish_reason: str
    model: str
    sampling: SamplingParams
    max_tokens: int
    # The prompt's prefill: the engine steps that carried a chunk of it, when each was launched, and
    # how many prompt tokens each carried (one entry for a whole-prompt prefill).
    chunk_steps: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    chunk_times: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.float64))
    chunk_tokens: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    preemptions: int = 0  # times the request lost its KV blocks and was recomputed

    @property
    def output_tokens(self) -> int:
        return int(self.token_ids.size)


class _Live:
    """A request from submission to its final event."""

    def __init__(self, req: GenerationRequest, tokenizer: Tokenizer, t_submit: float) -> None:
        self.req = req
        self.t_submit = t_submit
        self.t_admit = self.t_first = float("nan")
        self.slot: int | None = None
        self.generation = -1  # the engine's insert count of the slot, once admitted
        n = req.max_tokens
        self.ids = np.zeros(n, np.int32)
        self.times = np.zeros(n, np.float64)
        self.steps = np.zeros(n, np.int64)
        self.batches = np.zeros(n, np.int32)
        self.n = 0
        self.decoder: IncrementalDecoder = tokenizer.incremental()
        self.pending = ""  # text held back because it may begin a stop string
        self.stop_ids = set(req.stop_token_ids) | (set() if req.ignore_eos else set(tokenizer.eos_token_ids))
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


class Scheduler:
    def __init__(
        self,
        engine: DecodeEngine | TokenBudgetEngine,
        tokenizer: Tokenizer,
        *,
        max_queue: int = 64,
        on_finish: Callable[[RequestRecord], None] | None = None,
        model_name: str | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_queue = max_queue
        self.on_finish = on_finish
        self.model_name = model_name or engine.spec.name
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._queue: collections.deque[_Live] = collections.deque()
        self._live: dict[str, _Live] = {}
        self._slots: dict[int, _Live] = {}
        self._cancel: set[str] = set()
        self._in_flight: PendingStep | None = None  # the step launched last, not yet collected
        self.budget = isinstance(engine, TokenBudgetEngine)
        self._admitted: list[_Live] = []  # requests holding a slot, in admission order (token-budget engines)

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
        """KV blocks the requests hold (0 for an engine without a paged pool)."""
        return self.engine.held_blocks() if self.budget else 0  # type: ignore[union-attr]

    # ---- any thread ------------------------------------------------------------------------------
    def validate(self, req: GenerationRequest) -> None:
        if not isinstance(req.request_id, str) or not req.request_id:
            raise InvalidRequestError("request_id must be a non-empty string")
        if len(req.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError(f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
        self.engine.validate_prompt(req.prompt_ids)
        room = self.engine.max_seq_len - len(req.prompt_ids)
        if isinstance(req.max_tokens, bool) or not isinstance(req.max_tokens, int) or req.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {req.max_tokens!r}")
        if req.max_tokens > room:
            raise OutOfRangeError(
                f"max_tokens {req.max_tokens} does not fit: the prompt has {len(req.prompt_ids)} tokens and the "
                f"context is {self.engine.max_seq_len}, leaving room for {room}")
        if self.budget:
            self.engine.check_fits(len(req.prompt_ids), req.max_tokens)
        req.sampling.validate()
        if len(req.stop_strings) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(req.stop_strings)}")
        for s in req.stop_strings:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(
                    f"stop strings must be non-empty and at most {MAX_STOP_STRING_CHARS} characters, got {quoted(s)}")
        if len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids")
        vocab = self.engine.spec.vocab_size
        bad = [t for t in req.stop_token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"stop token ids must be in [0, {vocab}), got {bad[:5]}")

    def submit(self, req: GenerationRequest) -> None:
        """Validate and enqueue; raises InvalidRequestError / OutOfRangeError / QueueFullError."""
        self.validate(req)
        live = _Live(req, self.tokenizer, time.monotonic())
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
        if self.budget:
            worked |= self._admit_budget()
            self._in_flight = self._dispatch_budget() if self._slots else None
        else:
            worked |= self._admit()
            self._in_flight = self._dispatch() if self._slots else None
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
        admitted = False
        free = self.engine.free_slots()
        while free:
            with self._lock:
                if not self._queue:
                    break
                live = self._queue.popleft()
            slot = free.pop(0)
            live.t_admit = time.monotonic()
            try:
                prefix = self.engine.prefill(live.req.prompt_ids, live.req.sampling)
                self.engine.insert(prefix, slot)
            except Exception as err:  # engine failure: fail this request, keep serving
                log.exception("prefill failed for %s", live.req.request_id)
                self._finish(live, "error", time.monotonic(), token_id=None)
                free.insert(0, slot)
                if isinstance(err, FatalEngineError):
                    self._fail_all(err)
                continue
            live.slot = slot
            live.generation = self.engine.slot_generation(slot)
            self._slots[slot] = live
            now = time.monotonic()
            live.chunk_steps.append(-1)
            live.chunk_times.append(live.t_admit)
            live.chunk_tokens.append(len(live.req.prompt_ids))
            self._emit_token(live, prefix.first_token, step=-1, batch=len(self._slots), now=now)
            admitted = True
        return admitted

    def _admit_budget(self) -> bool:
        """Begin queued requests, in order, while a slot is free and the pool has their blocks
        (keeping a reserve for the decoding requests' growth)."""
        engine: TokenBudgetEngine = self.engine  # type: ignore[assignment]
        admitted = False
        free = engine.free_slots()
        reserve = max(1, engine.kv_tokens // engine.kv_block_size // 100)
        while free:
            with self._lock:
                if not self._queue:
                    break
                live = self._queue[0]
            prompt = live.engine_prompt()
            reuse = live.req.reuse_prefix
            if self._admitted and engine.blocks_to_begin(prompt, reuse) + reserve > self._available_blocks():
                break  # first come, first served: later requests wait behind this one
            slot = free[0]
            try:
                cached = engine.begin(slot, prompt, live.req.sampling, counter=live.n, reuse_prefix=reuse)
            except Exception as err:
                with self._lock:
                    self._queue.popleft()
                log.exception("admission failed for %s", live.req.request_id)
                self._finish(live, "error", time.monotonic(), token_id=None)
                if isinstance(err, FatalEngineError):
                    self._fail_all(err)
                continue
            if cached is None:
                break
            with self._lock:
                self._queue.popleft()
            free.pop(0)
            if math.isnan(live.t_admit):
                live.t_admit = time.monotonic()
                live.cached_tokens = cached
            live.slot = slot
            live.generation = engine.slot_generation(slot)
            self._slots[slot] = live
            self._admitted.append(live)
            admitted = True
        return admitted

    def _available_blocks(self) -> int:
        return self.engine.free_blocks()  # type: ignore[union-attr]

    def _dispatch_budget(self) -> PendingStep | None:
        """Room for the decoding requests' next tokens (preempting the latest admitted when short),
        then one step with the oldest unfinished prompt's next chunk."""
        engine: TokenBudgetEngine = self.engine  # type: ignore[assignment]
        while not engine.ensure_decode_blocks():
            self._preempt(self._admitted[-1])
        prefilling = set(engine.prefilling())
        owner = next((live for live in self._admitted if live.slot in prefilling), None)
        chunk = engine.next_chunk(owner.slot, self._queued_tokens()) if owner is not None else None
        if chunk is None and not engine.decoding():
            return None
        try:
            pending = engine.dispatch(chunk)
        except Exception as err:
            self._fail_active("engine step failed")
            if isinstance(err, FatalEngineError):
                self._fail_all(err)
            return None
        if owner is not None:
            owner.chunk_steps.append(pending.step)
            owner.chunk_times.append(time.monotonic())
            owner.chunk_tokens.append(chunk.length)
        return pending

    def _queued_tokens(self) -> int:
        """Tokens the engine is to compute for the requests waiting to begin (the queue is short:
        at most ``max_queue``)."""
        with self._lock:
            return sum(len(live.req.prompt_ids) + live.n for live in self._queue)

    def _preempt(self, live: _Live) -> None:
        """Take a request's slot and blocks back; it waits at the head of the queue to be recomputed."""
        log.info("preempting %s (KV pool full): it will be recomputed", live.req.request_id)
        self.engine.evict(live.slot)
        self._slots.pop(live.slot, None)
        self._admitted.remove(live)
        live.slot = None
        live.preemptions += 1
        with self._lock:
            self._queue.appendleft(live)

    def _dispatch(self) -> PendingStep | None:
        try:
            return self.engine.dispatch()
        except Exception as err:
            self._fail_active("engine step failed")
            if isinstance(err, FatalEngineError):
                self._fail_all(err)
            return None

    def _stream(self, pending: PendingStep) -> None:
        try:
            result: StepResult = self.engine.collect(pending)
        except Exception as err:
            self._fail_active("engine step failed")
            if isinstance(err, FatalEngineError):
                self._fail_all(err)
            return
        now = time.monotonic()
        batch = int(result.active.sum())
        for slot, live in list(self._slots.items()):
            if slot < result.batch and result.active[slot] and result.generations[slot] == live.generation:
                self._emit_token(live, int(result.tokens[slot]), step=result.step, batch=batch, now=now)
        chunk = getattr(result, "chunk", None)
        if chunk is not None and chunk.completes:
            live = self._slots.get(chunk.slot)
            if live is not None and live.generation == result.chunk_generation and not live.done:
                self._emit_token(live, int(result.chunk_token), step=result.step, batch=batch + 1, now=now)

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
        if token in live.stop_ids:
            self._finish(live, "stop", now, token_id=token, text=self._flush_text(live, final=True))
            return
        text, hit_stop = self._push_text(live, token)
        if hit_stop:
            self._finish(live, "stop", now, token_id=token, text=text)
        elif live.n >= live.req.max_tokens:  # validated to fit the context
            self._finish(live, "length", now, token_id=token, text=text + self._flush_text(live, final=True))
        else:
            self._send(live, TokenEvent(live.req.request_id, i, token, text, None, step, batch, now))

    def _push_text(self, live: _Live, token: int) -> tuple[str, bool]:
        """Append a token's text; returns (text safe to emit, whether a stop string was reached)."""
        live.pending += live.decoder.push(token)
        stops = live.req.stop_strings
        if not stops:
            out, live.pending = live.pending, ""
            return out, False
        cut = min((p for s in stops if (p := live.pending.find(s)) >= 0), default=-1)
        if cut >= 0:
            out, live.pending = live.pending[:cut], ""
            return out, True
        hold = max((k for s in stops for k in range(1, len(s)) if live.pending.endswith(s[:k])), default=0)
        out = live.pending[: len(live.pending) - hold]
        live.pending = live.pending[len(out):]
        return out, False

    def _flush_text(self, live: _Live, final: bool) -> str:
        out = live.pending + (live.decoder.flush() if final else "")
        live.pending = ""
        return out

    def _finish(self, live: _Live, reason: str, now: float, token_id: int | None, text: str = "") -> None:
        if live.done:
            return
        live.done = True
        if live.slot is not None:
            self.engine.evict(live.slot)
            self._slots.pop(live.slot, None)
            if live in self._admitted:
                self._admitted.remove(live)
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
        self._send(live, TokenEvent(live.req.request_id, index, token_id, text, reason, step, batch, now))

    def _send(self, live: _Live, event: TokenEvent) -> None:
        if live.req.on_event is None:
            return
        try:
            live.req.on_event(event)
        except Exception:
            log.exception("event callback failed for %s", live.req.request_id)
