"""The paged KV cache's books on the host: which slot each sequence decodes in, the blocks it holds
and their tables, what it has computed, and where it decodes next. Pure (NumPy, no JAX): the scheduler
owns one and plans every step from it; the engine's device pools follow the tables in its plans.

A sequence's life: :meth:`KVManager.begin` takes a free slot and the blocks of its prompt (cached
prefix blocks first, :mod:`~switchyard.service.engine.kv_blocks`); each launched step records what it
computed (:meth:`launched`): a chunk of the prompt, after whose last chunk the sequence decodes, or one
decode token; :meth:`ensure_decode_blocks` gives every decoding sequence the block of its next token
(False when the pool is short: the scheduler preempts one and asks again); :meth:`evict` gives the
slot and its blocks back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from switchyard.service.engine.kv_blocks import NULL_BLOCK, BlockPool, SequenceBlocks
from switchyard.service.engine.sampling import SamplingParams
from switchyard.service.errors import OutOfRangeError

if TYPE_CHECKING:
    from switchyard.service.engine.plan import StepPlan


@dataclasses.dataclass
class SlotSequence:
    """What one slot holds: a prompt (for a resumed sequence, the prompt and the tokens made before)
    and how far the launched steps have computed it."""

    tokens: list[int]
    sampling: SamplingParams
    counter: int  # sampling counter of the first token this prompt makes
    reuse_prefix: bool
    blocks: SequenceBlocks = dataclasses.field(default_factory=SequenceBlocks)
    computed: int = 0  # prompt positions whose K/V launched steps write
    position: int = 0  # where the next decode token goes, once decoding
    decoding: bool = False

    @property
    def left(self) -> int:
        """Prompt tokens not launched yet."""
        return len(self.tokens) - self.computed


class KVManager:
    """The KV pool's host-side books for ``max_slots`` sequences of up to ``max_seq_len`` positions,
    in a pool of ``kv_tokens`` positions (blocks of ``block_size``)."""

    def __init__(self, *, max_slots: int, max_seq_len: int, kv_tokens: int, block_size: int) -> None:
        if kv_tokens % block_size:
            raise ValueError(f"kv_tokens {kv_tokens} is not a whole number of {block_size}-token blocks")
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        self.block_size = block_size
        self.blocks_per_seq = -(-max_seq_len // block_size)
        self.pool = BlockPool(kv_tokens // block_size + 1, block_size)
        self._seqs: dict[int, SlotSequence] = {}
        self.generations = np.zeros(max_slots, np.int64)  # a slot's begin count: whose tokens a step made
        self._tables = np.full((max_slots, self.blocks_per_seq), NULL_BLOCK, np.int32)
        self._tables_changed = True

    # ---- queries ---------------------------------------------------------------------------------
    @property
    def kv_tokens(self) -> int:
        return self.pool.usable_blocks * self.block_size

    def free_slots(self) -> list[int]:
        return [s for s in range(self.max_slots) if s not in self._seqs]

    def sequence(self, slot: int) -> SlotSequence:
        return self._seqs[slot]

    def prefilling(self) -> list[int]:
        """Slots whose prompt is not all launched yet, in slot order."""
        return sorted(s for s, seq in self._seqs.items() if seq.left > 0)

    def decoding(self) -> np.ndarray:
        """Slots that decode a token at every step, ascending."""
        return np.array(sorted(s for s, seq in self._seqs.items() if seq.decoding), np.int64)

    def free_blocks(self) -> int:
        """Blocks that can be handed out now (free, or cached and held by no sequence)."""
        return self.pool.available()

    def held_blocks(self) -> int:
        """Blocks some sequence holds."""
        return self.pool.held()

    def blocks_to_begin(self, tokens: Sequence[int], reuse_prefix: bool = True) -> int:
        """Fresh blocks :meth:`begin` would take for this prompt (after cached prefix blocks)."""
        cached = len(self.pool.cached_prefix(tokens)[0]) if reuse_prefix else 0
        return self.pool.blocks_for(len(tokens)) - cached

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """OutOfRangeError when one such sequence alone could not fit the pool."""
        if self.pool.blocks_for(prompt_tokens + max_tokens) > self.pool.usable_blocks:
            raise OutOfRangeError(
                f"the request needs {prompt_tokens + max_tokens} tokens of KV cache; this deployment's pool "
                f"holds {self.kv_tokens}")

    def table(self, slot: int) -> np.ndarray:
        """The slot's block table [blocks_per_seq] (a view: copy it to keep it)."""
        return self._tables[slot]

    def row_tables(self, rows: np.ndarray) -> np.ndarray | None:
        """The block tables of the decode ``rows`` (slots, ascending), row by row [max_slots, M], when a
        table or the decoding set changed since the last call; None when nothing did."""
        if not self._tables_changed:
            return None
        self._tables_changed = False
        tables = np.full_like(self._tables, NULL_BLOCK)
        tables[: rows.size] = self._tables[rows]
        return tables

    def decode_blocks_needed(self) -> int:
        """Fresh blocks the decoding sequences need for their next token."""
        return sum(1 for seq in self._seqs.values()
                   if seq.decoding and seq.position >= len(seq.blocks.blocks) * self.block_size)

    # ---- changes ---------------------------------------------------------------------------------
    def begin(self, slot: int, tokens: Sequence[int], sampling: SamplingParams, *, counter: int = 0,
              reuse_prefix: bool = True) -> int | None:
        """Take the free ``slot`` for a prompt, with its blocks; returns the prompt tokens found in the
        prefix cache, or None (nothing taken) when the pool has too few blocks."""
        if slot in self._seqs or not 0 <= slot < self.max_slots:
            raise ValueError(f"slot {slot} is not free")
        seq = SlotSequence(list(tokens), sampling, counter, reuse_prefix)
        if reuse_prefix:
            self.pool.take_cached(seq.blocks, *self.pool.cached_prefix(tokens))
        if not self.pool.grow(seq.blocks, len(tokens)):
            self.pool.release(seq.blocks)
            return None
        seq.computed = len(seq.blocks.hashes) * self.block_size
        self._seqs[slot] = seq
        self.generations[slot] += 1
        self._set_table(slot)
        return seq.computed

    def ensure_decode_blocks(self) -> bool:
        """Give every decoding sequence the block its next token goes into; False when the pool is
        short (then nothing was taken: preempt a sequence and try again)."""
        if self.decode_blocks_needed() > self.pool.available():
            return False
        for slot, seq in self._seqs.items():
            if seq.decoding and seq.position >= len(seq.blocks.blocks) * self.block_size:
                self.pool.grow(seq.blocks, seq.position + 1)
                self._set_table(slot)
        return True

    def launched(self, plan: StepPlan) -> None:
        """``plan``'s step was launched: a token for each decode row, and its chunks' prompt tokens
        (whose full blocks then go to the prefix cache; after a prompt's last chunk it decodes)."""
        for slot in plan.rows:
            self._seqs[int(slot)].position += 1
        for chunk in plan.chunks:
            seq = self._seqs[chunk.slot]
            seq.computed += chunk.length
            if seq.reuse_prefix:
                self.pool.register(seq.blocks, seq.tokens, seq.computed)
            if seq.left == 0:
                seq.decoding = True
                seq.position = len(seq.tokens)
                self._tables_changed = True  # the decode rows change

    def evict(self, slot: int) -> None:
        """Free a slot and give back its blocks (cached prefix blocks stay in the prefix cache)."""
        seq = self._seqs.pop(slot, None)
        if seq is None:
            return
        self.pool.release(seq.blocks)
        self._tables[slot] = NULL_BLOCK
        self._tables_changed = True

    def _set_table(self, slot: int) -> None:
        blocks = self._seqs[slot].blocks.blocks
        self._tables[slot] = NULL_BLOCK
        self._tables[slot, : len(blocks)] = blocks
        self._tables_changed = True
