"""The step contract: what the scheduler asks of one engine step, as data, and what comes back.

A :class:`StepPlan` names the compiled program (:class:`~switchyard.service.engine.step_policy.StepShape`),
the decode rows (the decoding slots, ascending: row i decodes slot ``rows[i]``, at the position that
slot's state on the device holds, with the token it made last), their block tables when they changed,
and the prompt chunks the step carries, none or several, each of another sequence (its tokens, where
they go, its block table, and the sampling of the token its last chunk makes). The engine launches a
plan and, later, hands back a token per decode row and one per chunk that completed its prompt
(:class:`StepTokens`); it keeps no books of its own.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from switchyard.service.engine.sampling import SamplingParams
from switchyard.service.engine.step_policy import StepShape


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """``tokens`` of ``slot``'s prompt at positions ``start..start + len(tokens) - 1``; ``completes``:
    its last chunk, after which the step samples the sequence's first token with ``sampling`` and the
    slot decodes from the prompt's end (sampling counter ``counter``)."""

    slot: int
    tokens: np.ndarray  # int32 [length]
    start: int
    table: np.ndarray  # int32 [blocks_per_seq]
    completes: bool
    sampling: SamplingParams
    counter: int

    @property
    def length(self) -> int:
        return int(self.tokens.size)

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclasses.dataclass(frozen=True)
class StepPlan:
    shape: StepShape
    rows: np.ndarray  # int64 [n <= shape.width]: the decoding slots, ascending
    tables: np.ndarray | None  # int32 [max_slots, M]: row i's block table (None: as in the last plan)
    chunks: tuple[ChunkPlan, ...] = ()  # at most shape.chunks, of distinct slots


@dataclasses.dataclass(frozen=True)
class StepTokens:
    """A step's tokens: one per decode row (``tokens[i]`` is slot ``plan.rows[i]``'s), and one per
    chunk of the plan (``chunk_tokens[j]``: the first output token of chunk j's prompt when the chunk
    completed it, else -1)."""

    step: int
    tokens: np.ndarray  # int32 [len(plan.rows)]
    chunk_tokens: np.ndarray  # int32 [len(plan.chunks)]


# ---- a plan as int32 words (what stage 0 sends the other stages of a pipeline group) --------------
# [width, chunk_tokens, kv_len, greedy, chunk slots, rows n, tables given, chunks given, rows (n),
#  tables (if given: slots, M, slots * M words), per chunk: (slot, start, length, completes,
#  temperature bits, top_k, top_p bits, seed, counter, tokens (length), M, table (M))]
_HEADER = 8
_CHUNK_HEADER = 9


def _f32_bits(x: float) -> int:
    return int(np.array([x], np.float32).view(np.int32)[0])


def _bits_f32(x: int) -> float:
    return float(np.array([x], np.int32).view(np.float32)[0])


def encode_plan(plan: StepPlan) -> np.ndarray:
    """``plan`` as an int32 vector (:func:`decode_plan` reads it back exactly)."""
    shape = plan.shape
    words = [shape.width, shape.chunk_tokens, shape.kv_len, int(shape.greedy), shape.chunks, plan.rows.size,
             int(plan.tables is not None), len(plan.chunks)]
    parts = [np.array(words, np.int32), plan.rows.astype(np.int32)]
    if plan.tables is not None:
        parts += [np.array(plan.tables.shape, np.int32), plan.tables.astype(np.int32).ravel()]
    for chunk in plan.chunks:
        s = chunk.sampling
        parts += [np.array([chunk.slot, chunk.start, chunk.length, int(chunk.completes), _f32_bits(s.temperature),
                            s.top_k, _f32_bits(s.top_p), s.seed, chunk.counter], np.int32),
                  chunk.tokens.astype(np.int32), np.array([chunk.table.size], np.int32), chunk.table.astype(np.int32)]
    return np.concatenate(parts)


def decode_plan(words: np.ndarray) -> StepPlan:
    """The plan :func:`encode_plan` wrote."""
    width, chunk_tokens, kv_len, greedy, chunk_slots, n, has_tables, n_chunks = (int(w) for w in words[:_HEADER])
    at = _HEADER
    rows = words[at: at + n].astype(np.int64)
    at += n
    tables = None
    if has_tables:
        slots, m = (int(w) for w in words[at: at + 2])
        tables = words[at + 2: at + 2 + slots * m].reshape(slots, m).copy()
        at += 2 + slots * m
    chunks = []
    for _ in range(n_chunks):
        fields = (int(w) for w in words[at: at + _CHUNK_HEADER])
        slot, start, length, completes, temp, top_k, top_p, seed, counter = fields
        at += _CHUNK_HEADER
        tokens = words[at: at + length].copy()
        at += length
        m = int(words[at])
        table = words[at + 1: at + 1 + m].copy()
        at += 1 + m
        sampling = SamplingParams(temperature=_bits_f32(temp), top_k=top_k, top_p=_bits_f32(top_p), seed=seed)
        chunks.append(ChunkPlan(slot, tokens, start, table, bool(completes), sampling, counter))
    if at != words.size:
        raise ValueError(f"a plan of {words.size} words has {words.size - at} left over")
    return StepPlan(StepShape(width, chunk_tokens, kv_len, bool(greedy), chunk_slots), rows, tables, tuple(chunks))
