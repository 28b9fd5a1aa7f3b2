"""The paged KV cache's bookkeeping: which blocks of the pool each sequence holds, and the prefix cache.

Pure host-side logic (no JAX). The pool has ``num_blocks`` blocks of ``block_size`` positions; block 0
is the null block, never handed out: block tables point unused entries at it. A sequence's block list
maps its positions in order (position p is in its ``p // block_size``-th block).

Prefix reuse: a full block of prompt tokens is registered under a hash of its tokens and of every
token before it, once the step that writes it has been launched. A later sequence whose prompt
starts with the same tokens takes those blocks instead of computing them again (its reference
count rises; nothing is copied). A block no sequence holds stays cached with its hash and is
evicted least recently used when a fresh block is needed.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

NULL_BLOCK = 0


def chain_hashes(tokens: Sequence[int], block_size: int, full_blocks: int) -> list[bytes]:
    """The hash of each of the first ``full_blocks`` blocks of ``tokens``, each covering its block's
    tokens and (through the previous hash) every token before them."""
    out: list[bytes] = []
    prev = b""
    arr = np.asarray(tokens[: full_blocks * block_size], dtype=np.int64)
    for i in range(full_blocks):
        prev = hashlib.blake2b(prev + arr[i * block_size:(i + 1) * block_size].tobytes(), digest_size=16).digest()
        out.append(prev)
    return out


@dataclasses.dataclass
class SequenceBlocks:
    """The blocks one sequence holds, in position order, and how many of them are registered."""

    blocks: list[int] = dataclasses.field(default_factory=list)
    hashes: list[bytes] = dataclasses.field(default_factory=list)  # of its registered (full prompt) blocks


class BlockPool:
    """Blocks of the KV pool: free, held (with reference counts) or cached by prefix hash."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: collections.deque[int] = collections.deque(range(1, num_blocks))
        self._refs = np.zeros(num_blocks, np.int32)
        self._hash_of: dict[int, bytes] = {}  # registered blocks
        self._by_hash: dict[bytes, int] = {}
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, unheld; LRU first

    # ---- queries ---------------------------------------------------------------------------------
    @property
    def usable_blocks(self) -> int:
        """Blocks that sequences can hold (all but the null block)."""
        return self.num_blocks - 1

    def available(self) -> int:
        """Blocks that can be handed out now: free, or cached and held by no sequence."""
        return len(self._free) + len(self._evictable)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def cached_prefix(self, tokens: Sequence[int]) -> tuple[list[int], list[bytes]]:
        """The cached blocks that hold a prefix of ``tokens`` and their hashes, in order. At least the
        last token is left out, so that the prompt's last position is computed (its logits give the
        first output token)."""
        full = (len(tokens) - 1) // self.block_size
        blocks: list[int] = []
        hashes: list[bytes] = []
        for h in chain_hashes(tokens, self.block_size, full):
            block = self._by_hash.get(h)
            if block is None:
                break
            blocks.append(block)
            hashes.append(h)
        return blocks, hashes

    def held(self) -> int:
        """Blocks some sequence holds."""
        return int((self._refs[1:] > 0).sum())

    # ---- changes ---------------------------------------------------------------------------------
    def take_cached(self, seq: SequenceBlocks, blocks: list[int], hashes: list[bytes]) -> None:
        """Let ``seq`` hold cached prefix blocks (from :meth:`cached_prefix`)."""
        for block, h in zip(blocks, hashes, strict=True):
            self._hold(block)
            seq.blocks.append(block)
            seq.hashes.append(h)

    def grow(self, seq: SequenceBlocks, tokens: int) -> bool:
        """Give ``seq`` fresh blocks until it covers ``tokens`` positions; False (nothing taken) when
        the pool has too few."""
        need = self.blocks_for(tokens) - len(seq.blocks)
        if need <= 0:
            return True
        if need > self.available():
            return False
        for _ in range(need):
            seq.blocks.append(self._fresh())
        return True

    def register(self, seq: SequenceBlocks, tokens: Sequence[int], computed: int) -> None:
        """Register ``seq``'s full blocks within its first ``computed`` positions of ``tokens`` (whose
        K/V the launched steps write) for reuse by later sequences."""
        full = min(computed, len(tokens)) // self.block_size
        if full <= len(seq.hashes):
            return
        hashes = chain_hashes(tokens, self.block_size, full)
        for i in range(len(seq.hashes), full):
            h, block = hashes[i], seq.blocks[i]
            seq.hashes.append(h)
            if h in self._by_hash or block in self._hash_of:
                continue  # the same prefix computed twice at once: keep the first copy
            self._by_hash[h] = block
            self._hash_of[block] = h

    def release(self, seq: SequenceBlocks) -> None:
        """Give back every block ``seq`` holds. Registered blocks stay cached until evicted."""
        for block in seq.blocks:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        seq.blocks.clear()
        seq.hashes.clear()

    def clear_cache(self) -> None:
        """Forget every cached prefix (blocks held by sequences stay registered until released)."""
        for block in list(self._evictable):
            self._forget(block)
            self._free.append(block)
        self._evictable.clear()

    # ---- internals -------------------------------------------------------------------------------
    def _hold(self, block: int) -> None:
        if self._refs[block] == 0:
            self._evictable.pop(block, None)
        self._refs[block] += 1

    def _fresh(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
        self._refs[block] = 1
        return block

    def _forget(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None and self._by_hash.get(h) == block:
            del self._by_hash[h]
