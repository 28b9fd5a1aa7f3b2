"""How much each step carries, and in which compiled shapes. Pure (no JAX): the scheduler owns one and
plans every step with it; the engine compiles the shapes it lists.

Every step is one forward pass: a token for each decoding sequence, plus (while a prompt waits) a
chunk of up to ``step_tokens`` of one prompt, so the weights are read once for both and a long prompt
never holds the decoding streams behind it. Short prompts (or what is left of them, after a cached
prefix or earlier chunks) share a step: when the next prompt's remainder fits the small chunk size
(a quarter of the budget), the step carries the whole remainders of up to four waiting prompts that
fit it too, each in a chunk of that size, so a burst of short prompts takes a quarter of the steps.
When nothing decodes, nothing waits behind a step: a prompt with at least ``idle_step_tokens`` left
goes in a chunk of that many. Under a burst (more than ``SURGE_BACKLOG_BUDGETS`` budgets of prompt
tokens not yet computed) a step carries up to twice the budget, so the burst drains faster.

Programs are compiled per shape: decode-only steps per batch width, each greedy-only or sampled; steps
with a chunk per chunk size and per bucket of the context the chunk attends to, sampled only (a greedy
row takes the same argmax in a sampled program). A chunk program's first launch costs about 0.4 s on
an H100, mostly cuDNN's attention calls (two per layer) being set up, so a greedy twin of each would
double that start-up cost; with the sampler's candidates found by groups (``sampling.py``) sampling
is a small part of a chunk step (benchmarks/NOTES.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from switchyard.service.modelspec import DEFAULT_STEP_TOKENS, IDLE_STEP_TOKENS, KV_BLOCK_TOKENS

if TYPE_CHECKING:
    from switchyard.service.engine.kv_manager import KVManager
    from switchyard.service.engine.plan import StepPlan

# A step for one sequence runs as two rows: XLA on GPU compiles some [1, K] x [K, N] products as a
# broadcast-multiply plus reduce that writes a K x N temporary (see benchmarks/NOTES.md).
MIN_BATCH_WIDTH = 2
# Beside a chunk, a narrower batch width pays only when it drops at least this many rows: on H200, 32
# idle rows of 64 cost 1.2 ms of a 10.5 ms step, 16 of 32 nothing measurable (benchmarks/NOTES.md);
# each width is one more set of chunk programs to compile.
NARROW_CHUNK_MIN_ROWS = 32
# While the prompt tokens not yet computed (begun or waiting to begin) exceed this many budgets, a step
# carries up to twice the budget. Such a backlog is a burst whose prompts queue for far longer than a
# step lasts; the larger chunk drains it faster (the decode rows and the weights' reads are shared by
# more prompt tokens) at the cost of a longer gap, in the few steps of a burst, for the decoding
# streams. At 40 budgets the load mix's inter-token p99 stays where it was (benchmarks/NOTES.md).
SURGE_BACKLOG_BUDGETS = 40
# A context bucket within this factor of the whole table is not compiled: the table's bucket serves its
# chunks, at most this much longer attention for them, one program fewer per chunk size and width
# (a 4352-token context would compile 4096 beside 4352: 14 of 86 programs, each loaded and run at
# every start).
KV_BUCKET_MERGE = 1.25


def doubling_buckets(limit: int, start: int) -> list[int]:
    """``start``, doubled while below ``limit``, then ``limit``: the sizes programs are compiled for."""
    out, b = [], start
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit)
    return out


@dataclasses.dataclass(frozen=True, order=True)
class StepShape:
    """One compiled step program: ``width`` decode rows, and ``chunks`` chunks of ``chunk_tokens``
    each attending to at most ``kv_len`` positions of its sequence (``kv_len`` 0: no chunk);
    ``greedy``: every row samples greedily."""

    width: int
    chunk_tokens: int = 0
    kv_len: int = 0
    greedy: bool = True
    chunks: int = 1

    @property
    def with_chunk(self) -> bool:
        return self.kv_len > 0

    @property
    def products(self) -> tuple[int, int, int]:
        """What sets the shapes of the step's weight products (its token rows): shapes that differ only
        in context bucket or sampling multiply the same matrices by the same rows."""
        return self.width, self.chunk_tokens, self.chunks


def products_first(shapes: Sequence[StepShape]) -> list[StepShape]:
    """``shapes`` reordered: the first of each set of equal :attr:`StepShape.products`, then the rest, each
    part in the given order. XLA autotunes each product once per process and keeps the result, but two
    programs compiled side by side both autotune a product neither has finished: compiling one program
    per product set first lets the others find every product tuned (benchmarks/NOTES.md)."""
    first: dict[tuple[int, int, int], StepShape] = {}
    for shape in shapes:
        first.setdefault(shape.products, shape)
    leaders = set(first.values())
    return [*first.values(), *(s for s in shapes if s not in leaders)]


class StepPolicy:
    """The budget, chunk sizes, batch widths and context buckets of one engine's steps (module
    docstring). ``min_width``: the narrowest decode width compiled."""

    def __init__(self, *, max_slots: int, max_seq_len: int, block_size: int = KV_BLOCK_TOKENS,
                 step_tokens: int = DEFAULT_STEP_TOKENS, idle_step_tokens: int = IDLE_STEP_TOKENS,
                 min_width: int = MIN_BATCH_WIDTH) -> None:
        if step_tokens < 1:
            raise ValueError(f"step_tokens must be positive, got {step_tokens}")
        if min_width < 1:
            raise ValueError(f"min_width must be at least 1, got {min_width}")
        self.max_slots = max_slots
        self.block_size = block_size
        self.step_tokens = step_tokens
        self.blocks_per_seq = -(-max_seq_len // block_size)
        table_tokens = self.blocks_per_seq * block_size
        # The chunk of a step that no decoding sequence waits for (a whole number of blocks, at most a
        # sequence's table); equal to step_tokens when the context is too short for a larger one.
        self.idle_step_tokens = max(step_tokens, min(idle_step_tokens, table_tokens))
        # Chunks start where the cached prefix (whole blocks) or the previous chunk ended: on a block
        # boundary when every chunk but a prompt's last is a whole number of blocks.
        self.chunks_block_aligned = step_tokens % block_size == 0 and self.idle_step_tokens % block_size == 0
        # The chunk of a step under a backlog of prompts: twice the budget, at most the idle chunk.
        self.surge_step_tokens = min(2 * step_tokens, self.idle_step_tokens)
        # A chunk of at most a quarter of the budget (a prompt's short last chunk, what follows a cached
        # prefix) runs in a program of that size: a 64-token remainder does not pay for 256 rows of
        # work. Each size is a program per context bucket to compile, hence few.
        small = step_tokens // 4
        self.chunk_sizes = [small, step_tokens] if small >= block_size else [step_tokens]
        # Chunks of that size a step may carry side by side (module docstring): 1 without the small size.
        self.packed_chunks = step_tokens // small if small >= block_size else 1
        if self.surge_step_tokens > step_tokens:
            self.chunk_sizes.append(self.surge_step_tokens)
        self.batch_widths = doubling_buckets(max_slots, min(min_width, max_slots))
        # Steps with a chunk run the decode rows of the narrower of the two widest widths that holds
        # the decoding sequences, where the two differ by NARROW_CHUNK_MIN_ROWS or more.
        wide, narrow = self.batch_widths[-1], self.batch_widths[-2:][0]
        self.chunk_widths = [narrow, wide] if wide - narrow >= NARROW_CHUNK_MIN_ROWS else [wide]
        self.kv_buckets = self._kv_buckets(table_tokens)

    def _kv_buckets(self, limit: int) -> list[int]:
        """Context lengths a chunk's attention is compiled for: doubling from the chunk size, each a
        whole number of blocks, up to the whole table (a doubling within :data:`KV_BUCKET_MERGE` of it
        left out)."""
        bs = self.block_size
        out: list[int] = []
        for b in doubling_buckets(limit, min(limit, -(-self.step_tokens // bs) * bs)):
            b = min(-(-b // bs) * bs, limit)
            if b not in out:
                out.append(b)
        if len(out) >= 3 and out[-1] <= KV_BUCKET_MERGE * out[-2]:
            del out[-2]
        return out

    # ---- planning one step -----------------------------------------------------------------------
    def chunk_length(self, left: int, decoding: bool, backlog: int) -> int:
        """Tokens of a prompt with ``left`` tokens still to compute that the next step carries:
        ``idle_step_tokens`` when nothing decodes and at least that many are left; else up to the
        budget, or up to ``surge_step_tokens`` while ``backlog`` (prompt tokens not yet computed, of
        every request begun or waiting) exceeds :data:`SURGE_BACKLOG_BUDGETS` budgets."""
        if left >= self.idle_step_tokens and not decoding:
            return self.idle_step_tokens
        budget = self.step_tokens
        if self.surge_step_tokens > budget and backlog > SURGE_BACKLOG_BUDGETS * budget:
            budget = self.surge_step_tokens
        return min(budget, left)

    def shape(self, decoding: int, chunk_end: int | None, chunk_length: int, greedy: bool,
              chunks: int = 1) -> StepShape:
        """The program of a step with ``decoding`` decode rows and, when ``chunk_end`` is given, a
        chunk of ``chunk_length`` tokens ending at position ``chunk_end`` of its sequence, or
        ``chunks`` > 1 small chunks the last of which ends there."""
        if chunk_end is None:
            return StepShape(next(w for w in self.batch_widths if w >= decoding), greedy=greedy)
        width = next(w for w in self.chunk_widths if w >= decoding)
        kv_len = next(b for b in self.kv_buckets if b >= chunk_end)
        if chunks > 1:
            return StepShape(width, self.chunk_sizes[0], kv_len, greedy=False, chunks=self.packed_chunks)
        return StepShape(width, self.chunk_size_for(chunk_length), kv_len, greedy=False)

    def plan(self, kv: KVManager, chunk_slots: Sequence[int], backlog: int = 0) -> StepPlan | None:
        """The next step over ``kv``'s books: a token for every decoding sequence (their blocks must
        be in place: ``kv.ensure_decode_blocks``), and the next chunk of the first of ``chunk_slots``
        (the sequences with prompt tokens left, oldest first), beside the whole remainders of later
        ones when all fit the small chunk size (module docstring); ``backlog``: the prompt tokens not
        yet computed, for :meth:`chunk_length`. None when there is nothing to do."""
        from switchyard.service.engine.plan import ChunkPlan, StepPlan

        rows = kv.decoding()
        if not chunk_slots and rows.size == 0:
            return None
        greedy = all(kv.sequence(int(s)).sampling.greedy for s in rows)
        chunks: list[ChunkPlan] = []
        for slot in chunk_slots:
            if len(chunks) == self.packed_chunks:
                break
            seq = kv.sequence(slot)
            if chunks and seq.left > self.chunk_sizes[0]:
                continue  # only whole short remainders join the first chunk
            length = self.chunk_length(seq.left, rows.size > 0, backlog) if not chunks else seq.left
            tokens = np.asarray(seq.tokens[seq.computed: seq.computed + length], np.int32)
            chunks.append(ChunkPlan(slot, tokens, seq.computed, kv.table(slot).copy(), length == seq.left,
                                    seq.sampling, seq.counter))
            if length > self.chunk_sizes[0]:
                break  # a chunk larger than the small size goes alone
        # The program's context bucket holds the furthest chunk end.
        end = max(c.end for c in chunks) if chunks else None
        shape = self.shape(rows.size, end, chunks[0].length if chunks else 0, greedy, len(chunks))
        return StepPlan(shape, rows, kv.row_tables(rows), tuple(chunks))

    def chunk_size_for(self, length: int) -> int:
        """The compiled chunk size a chunk of ``length`` tokens runs in."""
        return next((c for c in self.chunk_sizes if c >= length), self.idle_step_tokens)

    # ---- every program ---------------------------------------------------------------------------
    def shapes(self) -> list[StepShape]:
        """Every step program serving can run: decode-only steps at each width; a chunk of up to
        step_tokens, which may end anywhere, beside either chunk width; a surge chunk longer than
        step_tokens, which ends past step_tokens; an idle-step chunk, which is whole and so ends at
        idle_step_tokens or later, with nothing decoding beside it (the narrower width); small chunks
        side by side, beside either chunk width, ending anywhere. Decode-only steps greedy and
        sampled; those with chunks sampled (module docstring)."""
        chunked = [(w, size, kv) for w in self.chunk_widths for size in self.chunk_sizes for kv in self.kv_buckets
                   if size <= self.step_tokens or kv > self.step_tokens]
        if self.idle_step_tokens not in self.chunk_sizes:
            chunked += [(self.chunk_widths[0], self.idle_step_tokens, kv) for kv in self.kv_buckets
                        if kv >= self.idle_step_tokens]
        packed = [StepShape(w, self.chunk_sizes[0], kv, False, self.packed_chunks) for w in self.chunk_widths
                  for kv in self.kv_buckets] if self.packed_chunks > 1 else []
        return ([StepShape(w, greedy=greedy) for greedy in (True, False) for w in self.batch_widths]
                + [StepShape(w, c, kv, greedy=False) for w, c, kv in chunked] + packed)
