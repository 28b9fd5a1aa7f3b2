"""An engine without a model or JAX, for testing the scheduler, the KV books and the server fast.

It launches plans as the real engine does and checks them as it goes: each plan's shape must hold its
rows and chunk, and its "KV pool" (a token id per position of each block) is written and read
through the plans' block tables, so a wrong table, a block shared that should not be, or a position
read before it was written fails loudly. A token is a hash of every token before it (read back
through the tables) and, when sampled, of the request's seed and counter: the tokens depend on the
sequence alone, never on the batch, the chunking, preemption or prefix reuse, as greedy tokens must.
``step_seconds`` makes each step take that long on its "device" (one step after another), so that
requests queue and streams pace as they do on a real one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from switchyard.kernels import kv_cache
from switchyard.service.engine.compile_cache import WarmUp
from switchyard.service.engine.engine import EngineConfig, PendingStep
from switchyard.service.engine.kv_blocks import NULL_BLOCK
from switchyard.service.engine.plan import StepPlan, StepTokens
from switchyard.service.modelspec import ModelSpec, preset

UNWRITTEN = -1


class FakeKVError(AssertionError):
    """A plan read or wrote the KV pool where its books say it must not."""


@dataclasses.dataclass
class _SlotState:
    token: int = 0
    position: int = 0
    seed: int = 0
    counter: int = 0
    greedy: bool = True


class FakeEngine:
    """The engine contract of ``engine.Engine`` over a host-side fake pool (module docstring)."""

    def __init__(self, spec: ModelSpec | None = None, config: EngineConfig | None = None, *,
                 kv_tokens: int = 0, step_seconds: float = 0.0) -> None:
        config = config or EngineConfig()
        self.spec = spec or preset("tiny")
        self.config = config
        self.policy = config.step_policy()
        self.max_slots = config.batch_slots
        self.max_seq_len = config.max_seq_len
        self.kv_block_size = config.block_size
        self.step_tokens = config.step_tokens
        self.weights_label = self.spec.weights_label  # the formats it stands for (it holds no weights)
        self.kv_cache_label = kv_cache.label(config.kv_cache_dtype, config.dtype or self.spec.dtype)
        every_context = self.max_slots * self.policy.blocks_per_seq * config.block_size
        self.kv_tokens = kv_tokens or config.kv_tokens or every_context
        self.num_blocks = self.kv_tokens // self.kv_block_size + 1
        self.pool = np.full((self.num_blocks, self.kv_block_size), UNWRITTEN, np.int64)
        self._slots = [_SlotState() for _ in range(self.max_slots)]
        self._rows = np.zeros(0, np.int64)
        self._tables = np.full((self.max_slots, self.policy.blocks_per_seq), NULL_BLOCK, np.int32)
        self.step_count = 0
        self.plans: list[StepPlan] = []  # every plan launched, for tests to inspect
        self._shapes = frozenset(self.policy.shapes())
        self.step_seconds = step_seconds
        self._device_free_at = 0.0  # when the last launched step is done
        self._ready_at: dict[int, float] = {}

    # ---- the contract ----------------------------------------------------------------------------
    def warmup(self, store: Any = None, on_program: Callable[[int, int], None] | None = None) -> WarmUp:
        shapes = len(self._shapes)
        for done in range(1, shapes + 1):
            if on_program is not None:
                on_program(done, shapes)
        return WarmUp(0.0, shapes)

    def compiled_count(self) -> int:
        return 0

    def launch(self, plan: StepPlan) -> PendingStep:
        self._check_shape(plan)
        self.plans.append(plan)
        if plan.tables is not None:
            self._rows, self._tables = plan.rows.copy(), plan.tables.copy()
        elif not np.array_equal(plan.rows, self._rows):
            raise FakeKVError(f"the decode rows changed ({self._rows} -> {plan.rows}) without new tables")
        out = np.zeros(self.max_slots + self.policy.packed_chunks, np.int32)
        for i, slot in enumerate(plan.rows):
            state = self._slots[int(slot)]
            table = self._tables[i]
            self._write(table, state.position, [state.token])
            token = self._next(table, state.position + 1, state)
            out[i] = token
            state.token, state.position, state.counter = token, min(state.position + 1, self.max_seq_len - 1), \
                state.counter + 1
        for chunk in plan.chunks:
            self._write(chunk.table, chunk.start, chunk.tokens)
        for j, chunk in enumerate(plan.chunks):  # every chunk's K/V is written before any is read
            out[self.max_slots + j] = -1
            if chunk.completes:
                state = self._slots[chunk.slot]
                state.seed, state.counter, state.greedy = chunk.sampling.seed, chunk.counter, chunk.sampling.greedy
                token = self._next(chunk.table, chunk.end, state)
                out[self.max_slots + j] = token
                state.token, state.position, state.counter = token, chunk.end, state.counter + 1
        self.step_count += 1
        self._device_free_at = max(self._device_free_at, time.monotonic()) + self.step_seconds
        self._ready_at[self.step_count] = self._device_free_at
        return PendingStep(self.step_count, out, int(plan.rows.size), len(plan.chunks))

    def collect(self, pending: PendingStep) -> StepTokens:
        wait = self._ready_at.pop(pending.step, 0.0) - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        out = np.asarray(pending.tokens)
        return StepTokens(pending.step, out[: pending.rows].copy(),
                          out[self.max_slots: self.max_slots + pending.chunks].copy())

    # ---- the fake device -------------------------------------------------------------------------
    def _check_shape(self, plan: StepPlan) -> None:
        shape = plan.shape
        if plan.rows.size > shape.width:
            raise FakeKVError(f"{plan.rows.size} decode rows in a program of width {shape.width}")
        if list(plan.rows) != sorted(set(int(r) for r in plan.rows)):
            raise FakeKVError(f"decode rows {plan.rows} are not ascending distinct slots")
        if bool(plan.chunks) != shape.with_chunk:
            raise FakeKVError(f"a plan {'with' if plan.chunks else 'without'} chunks runs program {shape}")
        if len(plan.chunks) > shape.chunks:
            raise FakeKVError(f"{len(plan.chunks)} chunks in a program of {shape.chunks}")
        if len({c.slot for c in plan.chunks}) != len(plan.chunks) or {c.slot for c in plan.chunks} & set(plan.rows):
            raise FakeKVError("a slot has two rows in one step (chunks of one slot, or a chunk beside its decode row)")
        for chunk in plan.chunks:
            if chunk.length > shape.chunk_tokens or chunk.end > shape.kv_len:
                raise FakeKVError(f"a chunk of {chunk.length} tokens ending at {chunk.end} in program {shape}")
        if shape not in self._shapes:
            raise FakeKVError(f"program {shape} is not one the policy compiles")

    def _where(self, table: np.ndarray, position: int) -> tuple[int, int]:
        index = position // self.kv_block_size
        if index >= table.size or table[index] == NULL_BLOCK:
            raise FakeKVError(f"position {position} has no block in table {table[: index + 1]}")
        return int(table[index]), position % self.kv_block_size

    def _write(self, table: np.ndarray, start: int, tokens) -> None:
        for offset, token in enumerate(tokens):
            block, at = self._where(table, start + offset)
            self.pool[block, at] = int(token)

    def _next(self, table: np.ndarray, length: int, state: _SlotState) -> int:
        """The token after the sequence's first ``length`` positions, read back through its table."""
        seq = np.empty(length, np.int64)
        for p in range(length):
            block, at = self._where(table, p)
            seq[p] = self.pool[block, at]
        if (seq == UNWRITTEN).any():
            raise FakeKVError(f"position {int(np.argmax(seq == UNWRITTEN))} is read before it was written")
        digest = hashlib.blake2b(seq.tobytes(), digest_size=8)
        if not state.greedy:
            digest.update(np.array([state.seed, state.counter], np.int64).tobytes())
        return int.from_bytes(digest.digest(), "little") % self.spec.vocab_size
