"""The token-budget engine: a paged KV cache and steps that carry decode tokens and a prompt chunk.

Every step is ONE forward pass: a token for each decoding sequence, plus (when a prompt is waiting)
a chunk of up to ``step_tokens`` of its tokens, so the weights are read once for both and a long
prompt never holds the decoding streams back behind it. A prompt spreads over as many steps as its
chunks; the step that carries its last chunk samples its first output token, and from the next step
on it decodes. When no sequence is decoding, nothing waits behind a step: a prompt with at least
``IDLE_STEP_TOKENS`` left then goes in a chunk of that many (fewer, larger steps).

The KV cache is a pool of blocks of ``kv_block_size`` positions per layer, sharded by KV head; each
sequence's block table maps its positions to blocks. The host keeps the books
(:class:`~switchyard.service.engine.kv_blocks.BlockPool`: free blocks, reference counts, the prefix
cache) and uploads the block tables when they change; per-slot decode state (last token, position,
sampling parameters) lives on the devices and is donated to each step, as in the slot engine.

A step's changing inputs (decode rows, block tables, the chunk) and its tokens live in donated device
buffers of their own too (``_io``): small programs copy the host's new values in before a step and
the step's tokens out after it. A step program then sees the same addresses at every launch, so XLA
replays its command buffer as recorded; a new address anywhere makes it update the buffer's hundreds
of commands first, which took 2-6 ms of host time on H200 (benchmarks/NOTES.md). XLA's own temporary
buffer keeps its address under the allocator and update mode of ``xla_runtime``.

Under a burst (a backlog of prompt tokens of more than ``SURGE_BACKLOG_BUDGETS`` budgets) a step
carries up to twice the budget, so the burst drains faster.

Programs are compiled per shape: decode-only steps per batch bucket, steps with a chunk per chunk size
(``step_tokens``, a quarter of it, twice it, and ``idle_step_tokens``) and bucket of the context the
chunk attends to; each greedy-only or sampled.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from switchyard import kernels
from switchyard.kernels.selection import check_strategy
from switchyard.service.engine.checkpoint import load_params
from switchyard.service.engine.contract import PendingStep, StepResult
from switchyard.service.engine.kv_blocks import NULL_BLOCK, BlockPool, SequenceBlocks
from switchyard.service.engine.model import (
    AXIS,
    Chunk,
    ForwardConfig,
    ShardShape,
    budget_forward,
    param_specs,
)
from switchyard.service.engine.sampling import SamplingParams, sample_sharded
from switchyard.service.engine.tensor_parallel import (
    MIN_BATCH_BUCKET,
    SlotBook,
    doubling_buckets,
    make_mesh,
    new_cache,
    random_weights,
    slot_state,
)
from switchyard.service.engine.xla_runtime import free_device_memory, memory_fraction, step_compiler_options
from switchyard.service.errors import OutOfRangeError
from switchyard.service.modelspec import (
    DEFAULT_KV_MEMORY_FRACTION,
    DEFAULT_STEP_TOKENS,
    IDLE_STEP_TOKENS,
    KV_BLOCK_TOKENS,
    ModelSpec,
    ModelSpecError,
    ServingLayout,
    kv_tokens_for_memory,
)

POOL_SPEC = P(None, AXIS, None, None)  # [blocks, kv_heads, block_size, head_dim], sharded by KV head

# Compiles at warm-up hold host memory each, so the pool stays small even on a large host.
MAX_COMPILE_WORKERS = 8

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


def compile_workers() -> int:
    """Threads that compile step programs at warm-up: the CPUs this process may run on, at most
    :data:`MAX_COMPILE_WORKERS`."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_COMPILE_WORKERS, cpus))


@dataclasses.dataclass
class PlannedChunk:
    """A prompt chunk the next step carries: ``length`` tokens of ``slot``'s prompt from ``start``."""

    slot: int
    start: int
    length: int
    completes: bool  # the prompt's last chunk: the step samples the sequence's first token


@dataclasses.dataclass
class BudgetPendingStep(PendingStep):
    """A launched step, with the chunk it carried. Its program ran ``width`` decode rows, the first
    ``len(rows)`` of them the decoding slots ``rows`` (ascending); ``tokens`` [max_slots + 1] and
    ``logits`` are by row (the chunk's token last in ``tokens``), ``active`` and ``generations`` by
    slot, as the result's."""

    chunk: PlannedChunk | None = None
    chunk_generation: int = -1
    rows: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    width: int = 0


@dataclasses.dataclass
class BudgetStepResult(StepResult):
    """A step's tokens, by slot as every engine's; ``chunk_token`` is the first output token of the
    sequence whose prompt the step completed (-1 when it completed none). ``logits`` are by row: row i
    is slot ``rows[i]``, then padding rows, then (with a chunk) the chunk's last position."""

    chunk: PlannedChunk | None = None
    chunk_generation: int = -1
    chunk_token: int = -1
    rows: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))


# A step's chunk travels as one int32 array (one host-to-device copy, not one per field):
# [tokens (padded to idle_step_tokens, the largest chunk size), the sequence's block table, slot,
# start, length, completes, temperature, top_k, top_p, seed, counter], temperature and top_p as
# float32 bits. A step's program reads the first tokens, as many as its chunk size.
_CHUNK_FIELDS = 9


def _pack_chunk(chunk_tokens: int, table: np.ndarray, tokens: Sequence[int], slot: int, start: int, completes: bool,
                sampling: SamplingParams, counter: int) -> np.ndarray:
    m = table.shape[0]
    out = np.zeros(chunk_tokens + m + _CHUNK_FIELDS, np.int32)
    out[: len(tokens)] = tokens
    out[chunk_tokens: chunk_tokens + m] = table
    floats = np.array([sampling.temperature, sampling.top_p], np.float32).view(np.int32)
    out[chunk_tokens + m:] = (slot, start, len(tokens), completes, floats[0], sampling.top_k, floats[1], sampling.seed,
                              counter)
    return out


def _unpack_chunk(packed: jax.Array, table_len: int, chunk_tokens: int) -> tuple[jax.Array, ...]:
    """(tokens [chunk_tokens], table, slot, start, length, completes, (temperature, top_k, top_p, seed,
    counter))."""
    c = packed.shape[0] - table_len - _CHUNK_FIELDS
    f = c + table_len
    slot, start, length, completes, temp, top_k, top_p, seed, counter = (packed[f + i] for i in range(_CHUNK_FIELDS))
    as_float = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.float32)
    return (packed[:chunk_tokens], packed[c:f], slot, start, length, completes != 0,
            (as_float(temp), top_k, as_float(top_p), seed, counter))


def _write_io(io: dict[str, jax.Array], updates: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """``io`` with ``updates`` written over its entries in place (a donated ``io`` keeps its buffers)."""
    return {key: jax.lax.dynamic_update_slice(a, updates[key], (0,) * a.ndim) if key in updates else a
            for key, a in io.items()}


def _read_out(io: dict[str, jax.Array]) -> jax.Array:
    """A copy of a step's tokens, which outlives the next step's donation of ``io``."""
    return io["out"] + 0


@dataclasses.dataclass
class _Sequence:
    tokens: list[int]  # the prompt (for a resumed sequence: prompt and the tokens made before)
    sampling: SamplingParams
    counter: int  # sampling counter of the first token this prompt makes
    blocks: SequenceBlocks
    computed: int  # prompt positions whose K/V launched steps write
    reuse_prefix: bool


class PagedEngine(SlotBook):
    """One tensor-parallel group with a paged KV pool and token-budget steps (module docstring).

    A request's life: :meth:`begin` takes a free slot and the prompt's blocks (cached prefix blocks
    first); :meth:`next_chunk` says which prompt chunk the next step carries; :meth:`ensure_decode_blocks`
    makes room for the decoding sequences' next tokens; :meth:`dispatch` launches the step and
    :meth:`collect` waits for its tokens; :meth:`evict` gives the slot and its blocks back.
    """

    def __init__(
        self,
        spec: ModelSpec,
        params: dict,
        mesh: Mesh,
        *,
        batch_slots: int,
        max_seq_len: int,
        strategy: str = "xla",
        dtype: str | None = None,
        kv_tokens: int = 0,
        kv_memory_fraction: float = DEFAULT_KV_MEMORY_FRACTION,
        step_tokens: int = DEFAULT_STEP_TOKENS,
        block_size: int = KV_BLOCK_TOKENS,
        idle_step_tokens: int = IDLE_STEP_TOKENS,
    ) -> None:
        check_strategy(strategy)
        super().__init__(spec, batch_slots, max_seq_len)
        if step_tokens < 1:
            raise ValueError(f"step_tokens must be positive, got {step_tokens}")
        self.params = params
        self.mesh = mesh
        self.tp = mesh.shape[AXIS]
        self.strategy = strategy
        self.dtype = dtype or spec.dtype
        self.shape = ShardShape(spec, self.tp)
        self._cfg = ForwardConfig.make(self.shape, self.strategy, platform=mesh.devices.flat[0].platform)
        self._pspecs = param_specs(spec)
        self._block_size = block_size
        self._step_tokens = step_tokens
        self.blocks_per_seq = -(-max_seq_len // block_size)
        # The chunk of a step that no decoding sequence waits for (a whole number of blocks, at most a
        # sequence's table); equal to step_tokens when the context is too short for a larger one.
        self.idle_step_tokens = max(step_tokens, min(idle_step_tokens, self.blocks_per_seq * block_size))
        # Chunks start where the cached prefix (whole blocks) or the previous chunk ended: on a block
        # boundary when every chunk but a prompt's last is a whole number of blocks.
        self._chunks_block_aligned = step_tokens % block_size == 0 and self.idle_step_tokens % block_size == 0
        # The chunk of a step under a backlog of prompts (SURGE_BACKLOG_BUDGETS): twice the budget, at
        # most the idle chunk; equal to step_tokens where that leaves no room.
        self.surge_step_tokens = min(2 * step_tokens, self.idle_step_tokens)
        # A chunk of at most a quarter of the budget (a prompt's short last chunk, what follows a cached
        # prefix) runs in a program of that size: a 64-token remainder does not pay for 256 rows of
        # work. Each size is a program per context bucket to compile, hence few.
        small = step_tokens // 4
        self.chunk_sizes = [small, step_tokens] if small >= block_size else [step_tokens]
        if self.surge_step_tokens > step_tokens:
            self.chunk_sizes.append(self.surge_step_tokens)
        self.batch_buckets = doubling_buckets(batch_slots, min(MIN_BATCH_BUCKET, batch_slots))
        # Steps with a chunk run the decode rows of the narrower of the two largest batch buckets that
        # holds the decoding sequences, where the two differ by NARROW_CHUNK_MIN_ROWS or more. A chunk's
        # programs are per width and context bucket.
        wide, narrow = self.batch_buckets[-1], self.batch_buckets[-2:][0]
        self.chunk_batches = [narrow, wide] if wide - narrow >= NARROW_CHUNK_MIN_ROWS else [wide]
        self.kv_buckets = self._kv_buckets()
        if strategy != "xla" and self.tp > 1:
            kernels.init(list(mesh.devices.flat))
        free = self._free_memory()
        tokens = kv_tokens or self._tokens_for_memory(free, kv_memory_fraction)
        if kv_tokens:
            self._check_pool_fits(free, kv_tokens, block_size)
        if free is None:
            # Host devices: no device memory to fill, so no more than the sequences can use (a layout
            # planned for a GPU may ask for far more than the host has).
            tokens = min(tokens, self.max_slots * self.blocks_per_seq * block_size)
        if tokens % block_size:
            raise ModelSpecError(f"kv_tokens {tokens} is not a whole number of {block_size}-token blocks")
        if tokens < max_seq_len:
            raise ModelSpecError(f"the KV pool holds {tokens} tokens, fewer than one sequence of max_seq_len "
                             f"{max_seq_len}; lower max_seq_len or give the pool more memory")
        self.pool = BlockPool(tokens // block_size + 1, block_size)
        self._seqs: dict[int, _Sequence] = {}
        self._decoding = np.zeros(batch_slots, dtype=bool)
        self._tables = np.full((batch_slots, self.blocks_per_seq), NULL_BLOCK, np.int32)
        self._tables_dirty = True
        self._state = self._new_state()
        self._io = self._new_io()

    # ---- construction ----------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, path: str | Path, layout: ServingLayout, dtype: str | None = None,
                        devices: Sequence[jax.Device] | None = None, progress: bool = True) -> PagedEngine:
        spec = ModelSpec.from_file(path)
        dtype = dtype or spec.dtype
        mesh = make_mesh(layout.tp, devices)
        ShardShape(spec, layout.tp)
        params = load_params(path, spec, mesh, dtype, progress=progress)
        return cls(spec, params, mesh, dtype=dtype, **cls.layout_arguments(layout))

    @classmethod
    def from_random(cls, spec: ModelSpec, layout: ServingLayout, dtype: str = "bfloat16", seed: int = 0,
                    devices: Sequence[jax.Device] | None = None) -> PagedEngine:
        params, mesh = random_weights(spec, layout.tp, dtype, seed, devices)
        return cls(spec, params, mesh, dtype=dtype, **cls.layout_arguments(layout))

    @staticmethod
    def layout_arguments(layout: ServingLayout) -> dict[str, Any]:
        return {"batch_slots": layout.batch_slots, "max_seq_len": layout.max_seq_len, "strategy": layout.strategy,
                "kv_tokens": layout.kv_tokens, "kv_memory_fraction": layout.kv_memory_fraction,
                "step_tokens": layout.step_tokens}

    def _free_memory(self) -> int | None:
        """Bytes free for the KV pool on the devices' fullest GPU; None on host devices."""
        return free_device_memory(list(self.mesh.devices.flat), kernels.device_memory, memory_fraction())

    def _tokens_for_memory(self, free: int | None, fraction: float) -> int:
        """Tokens whose K/V fit in ``fraction`` of ``free`` bytes; on host devices (None), every slot's
        whole context."""
        if free is None:
            return self.max_slots * self.blocks_per_seq * self._block_size
        tokens = kv_tokens_for_memory(self.spec, self.tp, 1, int(free * fraction), self.dtype)
        return tokens // self._block_size * self._block_size

    def _check_pool_fits(self, free: int | None, tokens: int, block_size: int) -> None:
        """Raise ModelSpecError when a pool of ``tokens`` (and its null block) would not fit in
        ``free`` bytes; on host devices (None) there is nothing to check."""
        if free is None:
            return
        need = (tokens + block_size) * self.spec.kv_bytes_per_token_per_gpu(self.tp, 1, self.dtype)
        if need > free:
            gib = 2**30
            raise ModelSpecError(
                f"layout.kv_tokens {tokens} needs {need / gib:.2f} GiB of KV cache per GPU, but only "
                f"{free / gib:.2f} GiB is free after the weights; lower kv_tokens (0 sizes the pool from "
                f"kv_memory_fraction)")

    def _kv_buckets(self) -> list[int]:
        """Context lengths a chunk's attention is compiled for: doubling from the chunk size, each a
        whole number of blocks, up to the whole table."""
        bs, limit = self._block_size, self.blocks_per_seq * self._block_size
        out = []
        for b in doubling_buckets(limit, min(limit, -(-self._step_tokens // bs) * bs)):
            b = min(-(-b // bs) * bs, limit)
            if b not in out:
                out.append(b)
        return out

    def _new_state(self) -> dict[str, Any]:
        s = self.spec
        shape = (self.pool.num_blocks, s.num_kv_heads, self._block_size, s.head_dim)
        k, v = new_cache(shape, NamedSharding(self.mesh, POOL_SPEC), self.dtype, s.num_layers)
        return {"k": k, "v": v, **slot_state(self.mesh, self.max_slots)}

    def _new_io(self) -> dict[str, jax.Array]:
        """A step's inputs and tokens, replicated: ``rows`` [max_slots] (the decoding slots, then
        max_slots), their block ``tables`` [max_slots, M], the ``chunk`` (packed) and ``out``
        [max_slots + 1] (a token per row, then the chunk's)."""
        rep = NamedSharding(self.mesh, P())
        host = {**self._row_arrays(np.zeros(0, np.int64)), "chunk": self._empty_chunk(),
                "out": np.zeros(self.max_slots + 1, np.int32)}
        return {key: jax.device_put(value, rep) for key, value in host.items()}

    def _empty_chunk(self) -> np.ndarray:
        """A packed chunk that carries no token (nothing is written)."""
        return _pack_chunk(self.idle_step_tokens, np.full(self.blocks_per_seq, NULL_BLOCK, np.int32), [], 0, 0,
                           False, SamplingParams(), 0)

    @functools.cached_property
    def _state_shardings(self) -> dict[str, Any]:
        return jax.tree.map(lambda a: a.sharding, self._state)

    @functools.cached_property
    def _io_shardings(self) -> dict[str, Any]:
        return jax.tree.map(lambda a: a.sharding, self._io)

    @functools.cached_property
    def _write_io_fn(self):
        return jax.jit(_write_io, donate_argnums=(0,), out_shardings=self._io_shardings)

    @functools.cached_property
    def _read_out_fn(self):
        return jax.jit(_read_out)

    # ---- the contract's sizes --------------------------------------------------------------------
    @property
    def kv_tokens(self) -> int:
        return self.pool.usable_blocks * self._block_size

    @property
    def kv_block_size(self) -> int:
        return self._block_size

    @property
    def step_tokens(self) -> int:
        return self._step_tokens

    # ---- host-side books -------------------------------------------------------------------------
    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise OutOfRangeError when one sequence alone could not fit the pool."""
        need = self.pool.blocks_for(prompt_tokens + max_tokens)
        if need > self.pool.usable_blocks:
            raise OutOfRangeError(
                f"the request needs {prompt_tokens + max_tokens} tokens of KV cache; this deployment's pool "
                f"holds {self.kv_tokens}")

    def free_blocks(self) -> int:
        """Blocks that can be handed out now (free, or cached and unheld)."""
        return self.pool.available()

    def held_blocks(self) -> int:
        """Blocks some request holds."""
        return self.pool.held()

    def blocks_to_begin(self, tokens: Sequence[int], reuse_prefix: bool = True) -> int:
        """Fresh blocks :meth:`begin` would take for this prompt (after cached prefix blocks)."""
        cached = len(self.pool.cached_prefix(tokens)[0]) if reuse_prefix else 0
        return self.pool.blocks_for(len(tokens)) - cached

    def begin(self, slot: int, tokens: Sequence[int], sampling: SamplingParams, *, counter: int = 0,
              reuse_prefix: bool = True) -> int | None:
        """Take a free slot for a prompt, with its blocks; returns the prompt tokens found in the
        prefix cache, or None (nothing taken) when the pool has too few blocks."""
        self.check_free(slot)
        sampling.validate()
        self.validate_prompt(tokens)
        seq = _Sequence(list(tokens), sampling, counter, SequenceBlocks(), 0, reuse_prefix)
        if reuse_prefix:
            self.pool.take_cached(seq.blocks, *self.pool.cached_prefix(tokens))
        if not self.pool.grow(seq.blocks, len(tokens)):
            self.pool.release(seq.blocks)
            return None
        seq.computed = len(seq.blocks.hashes) * self._block_size
        self._seqs[slot] = seq
        self.active[slot] = True
        self.generation[slot] += 1
        self.greedy[slot] = sampling.greedy
        self.positions[slot] = 0
        self._set_table(slot)
        return seq.computed

    def prefilling(self) -> list[int]:
        """Slots whose prompt is not all launched yet."""
        return [slot for slot, seq in self._seqs.items() if seq.computed < len(seq.tokens)]

    def decoding(self) -> list[int]:
        return [int(s) for s in np.flatnonzero(self._decoding)]

    def next_chunk(self, slot: int, queued_tokens: int = 0) -> PlannedChunk:
        """The next chunk of ``slot``'s prompt: ``idle_step_tokens`` when no sequence is decoding and
        at least that many are left; else up to ``step_tokens`` tokens, or up to ``surge_step_tokens``
        while the prompt tokens not yet computed (of the sequences begun here, and ``queued_tokens``
        more waiting to begin) exceed :data:`SURGE_BACKLOG_BUDGETS` budgets."""
        seq = self._seqs[slot]
        left = len(seq.tokens) - seq.computed
        if left >= self.idle_step_tokens and not self._decoding.any():
            length = self.idle_step_tokens
        else:
            budget = self._step_tokens
            if self.surge_step_tokens > budget and queued_tokens + sum(
                    len(s.tokens) - s.computed for s in self._seqs.values()) > SURGE_BACKLOG_BUDGETS * budget:
                budget = self.surge_step_tokens
            length = min(budget, left)
        return PlannedChunk(slot, seq.computed, length, seq.computed + length == len(seq.tokens))

    def decode_blocks_needed(self) -> int:
        """Fresh blocks the decoding sequences need for their next token."""
        return sum(1 for s in self.decoding()
                   if int(self.positions[s]) >= len(self._seqs[s].blocks.blocks) * self._block_size)

    def ensure_decode_blocks(self) -> bool:
        """Give every decoding sequence the block its next token goes into; False when the pool is
        short (then nothing was taken: preempt a sequence and try again)."""
        if self.decode_blocks_needed() > self.pool.available():
            return False
        for s in self.decoding():
            seq = self._seqs[s]
            if int(self.positions[s]) >= len(seq.blocks.blocks) * self._block_size:
                self.pool.grow(seq.blocks, int(self.positions[s]) + 1)
                self._set_table(s)
        return True

    def held_tokens(self, slot: int) -> int:
        return len(self._seqs[slot].blocks.blocks) * self._block_size

    def evict(self, slot: int) -> None:
        """Free a slot and give back its blocks (cached prefix blocks stay in the prefix cache)."""
        seq = self._seqs.pop(slot, None)
        if seq is not None:
            self.pool.release(seq.blocks)
        self.active[slot] = False
        self._decoding[slot] = False
        self._tables[slot] = NULL_BLOCK
        self._tables_dirty = True

    def _set_table(self, slot: int) -> None:
        blocks = self._seqs[slot].blocks.blocks
        self._tables[slot] = NULL_BLOCK
        self._tables[slot, : len(blocks)] = blocks
        self._tables_dirty = True

    def _stage(self, slots: np.ndarray, chunk: np.ndarray | None) -> None:
        """Write the next step's inputs into ``_io``: the decode rows (the decoding ``slots``,
        ascending) and their block tables when the decoding set or a table changed, and the packed
        ``chunk`` when the step carries one. Each array is a fresh copy: the books keep changing theirs."""
        updates = {}
        if self._tables_dirty:
            updates.update(self._row_arrays(slots))
            self._tables_dirty = False
        if chunk is not None:
            updates["chunk"] = chunk
        if updates:
            self._io = self._write_io_fn(self._io, updates)

    def _row_arrays(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        """``rows`` and ``tables`` of ``_io`` for the decoding ``slots`` (ascending)."""
        rows = np.full(self.max_slots, self.max_slots, np.int32)
        rows[: slots.size] = slots
        tables = np.full_like(self._tables, NULL_BLOCK)
        tables[: slots.size] = self._tables[slots]
        return {"rows": rows, "tables": tables}

    # ---- compiled steps --------------------------------------------------------------------------
    def _step_fn(self, batch: int, chunk_tokens: int, kv_len: int, greedy_only: bool, return_logits: bool = False):
        return self._compiled(("step", batch, chunk_tokens, kv_len, greedy_only, return_logits),
                              lambda: self._build_step(batch, chunk_tokens, kv_len, greedy_only, return_logits))

    def _chunk_programs(self) -> list[tuple[int, int, int]]:
        """(batch, chunk size, context bucket) of every step with a chunk: a chunk of up to step_tokens
        may end anywhere, beside either batch width; a surge chunk longer than step_tokens ends past
        step_tokens; an idle-step chunk is whole, so it ends at idle_step_tokens or later, and nothing
        decodes beside it (the narrower width)."""
        shapes = [(b, size, kv) for b in self.chunk_batches for size in self.chunk_sizes for kv in self.kv_buckets
                  if size <= self._step_tokens or kv > self._step_tokens]
        if self.idle_step_tokens not in self.chunk_sizes:
            shapes += [(self.chunk_batches[0], self.idle_step_tokens, kv) for kv in self.kv_buckets
                       if kv >= self.idle_step_tokens]
        return shapes

    def chunk_size_for(self, length: int) -> int:
        """The compiled chunk size a chunk of ``length`` tokens runs in."""
        return next((c for c in self.chunk_sizes if c >= length), self.idle_step_tokens)

    def _compiler_options(self, chunk_tokens: int) -> dict[str, str] | None:
        return step_compiler_options(chunk_tokens, self._step_tokens, self.mesh.devices.flat[0].platform, os.environ)

    def _build_step(self, batch: int, chunk_tokens: int, kv_len: int, greedy_only: bool, return_logits: bool):
        """A step over decode rows [0, batch) and, when kv_len > 0, one chunk attending to kv_len positions."""
        cfg, vocab = self._cfg, self.spec.vocab_size
        pools = [POOL_SPEC] * self.spec.num_layers
        with_chunk = kv_len > 0
        last = self.max_seq_len - 1

        def shard_fn(params, k, v, tokens, positions, tables, write, temp, top_k, top_p, seeds, counters,
                     c_tokens, c_start, c_len, c_table):
            chunk = Chunk(c_tokens, c_start, c_len, c_table, kv_len, self._chunks_block_aligned) if with_chunk else None
            logits, k, v = budget_forward(params, k, v, tokens, positions, tables, write, chunk, cfg)
            def sample(rows: slice) -> jax.Array:
                return sample_sharded(logits[rows], vocab, AXIS, greedy_only=greedy_only, temperature=temp[rows],
                                      top_k=top_k[rows], top_p=top_p[rows], seeds=seeds[rows],
                                      counters=counters[rows])

            # The chunk's row is sampled on its own: sampling batch + 1 rows in one call fails on GPU
            # (an XLA runtime error at 257 rows with top-k / top-p) where batch rows do not.
            n = tokens.shape[0]
            tok = jnp.concatenate([sample(slice(0, n)), sample(slice(n, n + 1))]) if with_chunk else sample(slice(None))
            full = jax.lax.all_gather(logits, AXIS, axis=1, tiled=True) if return_logits else jnp.zeros(())
            return tok, full, k, v

        rep = P()
        mapped = jax.shard_map(
            shard_fn, mesh=self.mesh,
            in_specs=(self._pspecs, pools, pools) + (rep,) * 13,
            out_specs=(rep, rep, pools, pools), check_vma=False)

        slots_count = self.max_slots

        def step(params, state, io):
            # Row i decodes slot rows[i]; padding rows (rows[i] == slots_count) read the last slot's
            # state, write nothing and are dropped from the updates.
            tables = io["tables"]
            slots = io["rows"][:batch]
            write = slots < slots_count
            take = jnp.minimum(slots, slots_count - 1)
            samp = [state[key][take] for key in ("temperature", "top_k", "top_p", "seeds", "counters")]
            c_tokens, c_table, c_slot, c_start, c_len, c_completes, c_sampling = _unpack_chunk(
                io["chunk"], tables.shape[1], chunk_tokens)
            if with_chunk:
                samp = [jnp.concatenate([a, jnp.asarray(c)[None].astype(a.dtype)]) for a, c in zip(samp, c_sampling,
                                                                                                  strict=True)]
            positions = state["positions"][take]
            tok, logits, k, v = mapped(params, state["k"], state["v"], state["tokens"][take], positions,
                                       tables[:batch], write, *samp, c_tokens, c_start, c_len, c_table)
            new = dict(state, k=k, v=v)
            step_tok = tok[:batch]
            new["tokens"] = state["tokens"].at[slots].set(step_tok, mode="drop")
            new["positions"] = state["positions"].at[slots].set(jnp.minimum(positions + 1, last), mode="drop")
            new["counters"] = state["counters"].at[slots].add(1, mode="drop")
            chunk_tok = jnp.int32(-1)
            if with_chunk:
                chunk_tok = tok[batch]
                temp, top_k, top_p, seed, counter = c_sampling
                for key, value in (("tokens", chunk_tok), ("positions", c_start + c_len), ("counters", counter + 1),
                                   ("temperature", temp), ("top_k", top_k), ("top_p", top_p), ("seeds", seed)):
                    old = new[key][c_slot]
                    new[key] = new[key].at[c_slot].set(jnp.where(c_completes, jnp.asarray(value, old.dtype), old))
            out = io["out"].at[:batch].set(step_tok).at[slots_count].set(chunk_tok)
            return new, dict(io, out=out), logits if return_logits else None

        return jax.jit(step, donate_argnums=(1, 2), out_shardings=(self._state_shardings, self._io_shardings, None),
                       compiler_options=self._compiler_options(chunk_tokens))

    # ---- the step --------------------------------------------------------------------------------
    def dispatch(self, chunk: PlannedChunk | None = None, return_logits: bool = False) -> BudgetPendingStep:
        """Launch one step: a token for every decoding slot, and ``chunk`` when given. The decoding
        slots' blocks must be in place (:meth:`ensure_decode_blocks`). The decoding slots run as the
        first rows of the narrowest width that holds them all, whatever their slot numbers. With
        ``return_logits`` the result carries the logits by row [width (+ 1 for the chunk's last
        position), padded_vocab]."""
        decoding = np.flatnonzero(self._decoding)
        if decoding.size == 0 and chunk is None:
            raise RuntimeError("dispatch() with nothing to do")
        widths = self.chunk_batches if chunk is not None else self.batch_buckets
        width = next(b for b in widths if b >= decoding.size)
        kv_len = chunk_tokens = 0
        packed = None
        if chunk is None:
            greedy = bool(self.greedy[decoding].all()) if decoding.size else True
        else:
            seq = self._seqs[chunk.slot]
            end = chunk.start + chunk.length
            kv_len = next(b for b in self.kv_buckets if b >= end)
            chunk_tokens = self.chunk_size_for(chunk.length)
            packed = _pack_chunk(self.idle_step_tokens, self._tables[chunk.slot], seq.tokens[chunk.start:end],
                                 chunk.slot, chunk.start, chunk.completes, seq.sampling, seq.counter)
            greedy = bool(self.greedy[decoding].all()) and seq.sampling.greedy
        self._stage(decoding, packed)
        fn = self._step_fn(width, chunk_tokens, kv_len, greedy, return_logits)
        self._state, self._io, logits = fn(self.params, self._state, self._io)
        tok = self._read_out_fn(self._io)
        tok.copy_to_host_async()
        self.positions[decoding] += 1
        self.step_count += 1
        top = int(decoding[-1]) + 1 if decoding.size else 0
        pending = BudgetPendingStep(step=self.step_count, batch=top, tokens=tok, active=self._decoding[:top].copy(),
                                    generations=self.generation[:top].copy(),
                                    logits=logits, chunk=chunk, rows=decoding, width=width)
        if chunk is not None:
            seq = self._seqs[chunk.slot]
            seq.computed = chunk.start + chunk.length
            if seq.reuse_prefix:
                self.pool.register(seq.blocks, seq.tokens, seq.computed)
            pending.chunk_generation = int(self.generation[chunk.slot])
            if chunk.completes:
                self._decoding[chunk.slot] = True
                self._tables_dirty = True
                self.positions[chunk.slot] = len(seq.tokens)
        return pending

    def collect(self, pending: PendingStep) -> BudgetStepResult:
        assert isinstance(pending, BudgetPendingStep)
        out = np.asarray(pending.tokens)
        chunk_token = int(out[self.max_slots]) if pending.chunk is not None and pending.chunk.completes else -1
        tokens = np.zeros(pending.batch, np.int32)
        tokens[pending.rows] = out[: pending.rows.size]
        return BudgetStepResult(step=pending.step, batch=pending.batch, tokens=tokens, active=pending.active,
                                generations=pending.generations, logits=pending.logits, chunk=pending.chunk,
                                chunk_generation=pending.chunk_generation, chunk_token=chunk_token, rows=pending.rows)

    def warmup(self) -> float:
        """Compile and run every step program once (no slot is in use, so nothing is written).

        Tracing holds the GIL, so programs are traced one after another here, while XLA compiles
        them in a thread pool as they come (it releases the GIL): on a 16-core H200 host the load
        benchmark's 86 programs take 108-119 s, where 42 took 218 s one after another (benchmarks/NOTES.md)."""
        import time

        if self.active.any():
            raise RuntimeError("warm up before beginning requests")
        t0 = time.perf_counter()
        # The staging program once per set of inputs a step may change, so serving compiles none.
        rows, chunk = self._row_arrays(np.flatnonzero(self._decoding)), {"chunk": self._empty_chunk()}
        for updates in (chunk, {**rows, **chunk}, rows):
            self._io = self._write_io_fn(self._io, updates)
        self._tables_dirty = False
        programs = []
        for greedy in (True, False):
            programs += [self._step_fn(batch, 0, 0, greedy) for batch in self.batch_buckets]
            programs += [self._step_fn(batch, chunk_tokens, kv_len, greedy)
                         for batch, chunk_tokens, kv_len in self._chunk_programs()]
        with ThreadPoolExecutor(compile_workers()) as pool:
            compiling = [pool.submit(fn.lower(self.params, self._state, self._io).compile) for fn in programs]
            for done in compiling:
                done.result()
        for fn in programs:
            self._state, self._io, _ = fn(self.params, self._state, self._io)
        self._read_out_fn(self._io)
        jax.block_until_ready((self._state, self._io))
        return time.perf_counter() - t0
