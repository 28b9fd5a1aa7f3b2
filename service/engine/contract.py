"""The engine contract: what the scheduler, the warm-up and the server call on a decode engine, and
the data they exchange.

:class:`~switchyard.service.engine.tensor_parallel.Engine` (one tensor-parallel group),
:class:`~switchyard.service.engine.pipeline.PipelineEngine` (stages in one program) and
:class:`~switchyard.service.engine.pipeline_group.LeaderEngine` (stage 0 of a group of processes)
implement it; the scheduler is typed against :class:`DecodeEngine` alone. A request's life:
``prefill`` its prompt (no slot needed), ``insert`` the prefix into a free slot, then every step makes
a token for each occupied slot (``dispatch`` launches it, ``collect`` waits for its tokens; ``generate``
does both), until ``evict`` frees the slot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np
from switchyard.service.engine.sampling import SamplingParams
from switchyard.service.modelspec import ModelSpec


@dataclasses.dataclass
class Prefix:
    """A prefilled prompt, ready to be inserted into a slot."""

    first_token: int
    length: int
    bucket: int
    sampling: SamplingParams
    k: jax.Array  # [layers, kv_heads, bucket, head_dim]
    v: jax.Array
    logits: jax.Array | None = None  # [padded_vocab] at the prompt's last position, when asked for


@dataclasses.dataclass
class StepResult:
    """One generate step: a token for each slot in ``[0, batch)``; only active slots' tokens count.

    ``generations[s]`` is the slot's insert count when the step was launched: a token belongs to the
    request that occupied the slot then, even if the slot has been reused since.
    """

    step: int
    batch: int
    tokens: np.ndarray  # int32 [batch]
    active: np.ndarray  # bool [batch]
    generations: np.ndarray  # int64 [batch]
    logits: jax.Array | None = None  # [batch, padded_vocab] when asked for


@dataclasses.dataclass
class PendingStep:
    """A launched step whose tokens are still on the device."""

    step: int
    batch: int
    tokens: jax.Array
    active: np.ndarray
    generations: np.ndarray
    logits: jax.Array | None


@runtime_checkable
class EngineBase(Protocol):
    """What every engine offers the scheduler, the warm-up and the server."""

    @property
    def spec(self) -> ModelSpec:
        """The model served."""
        ...

    @property
    def max_slots(self) -> int:
        """Slots: requests generating at once."""
        ...

    @property
    def max_seq_len(self) -> int:
        """Context per slot: prompt and generated tokens."""
        ...

    @property
    def kv_tokens(self) -> int:
        """Tokens the KV cache holds, over all sequences."""
        ...

    @property
    def kv_block_size(self) -> int:
        """Positions per KV block (the unit the cache is handed out in)."""
        ...

    @property
    def step_tokens(self) -> int:
        """Prompt tokens one step carries beside the decode tokens; 0: prompts are prefilled whole."""
        ...

    def validate_prompt(self, tokens: Sequence[int]) -> None:
        """Raise InvalidRequestError / OutOfRangeError for a prompt this engine cannot take."""
        ...

    def free_slots(self) -> list[int]:
        """The slots no request occupies, in ascending order."""
        ...

    def slot_generation(self, slot: int) -> int:
        """The slot's insert count: a step's tokens belong to the request of the count they carry."""
        ...

    def collect(self, pending: PendingStep) -> StepResult:
        """Wait for a dispatched step's tokens."""
        ...

    def evict(self, slot: int) -> None:
        """Free a slot."""
        ...

    def warmup(self) -> float:
        """Compile every program serving runs, before any request; returns seconds."""
        ...

    def compiled_count(self) -> int:
        """Compiled executables so far (flat after warm-up while serving)."""
        ...


@runtime_checkable
class DecodeEngine(EngineBase, Protocol):
    """A decode engine with a fixed number of slots, whose prompts are prefilled whole and then
    inserted into a slot."""

    def room(self, slot: int) -> int:
        """How many more tokens the slot can generate before its context is full."""
        ...

    def prefill(self, tokens: Sequence[int], sampling: SamplingParams | None = None,
                return_logits: bool = False) -> Prefix:
        """Run a prompt (no slot needed yet) and sample its first output token."""
        ...

    def insert(self, prefix: Prefix, slot: int) -> None:
        """Place a prefilled prompt into a free slot; it joins the batch at the next step."""
        ...

    def dispatch(self, return_logits: bool = False) -> PendingStep:
        """Launch one decode step for the occupied slots without waiting for it."""
        ...

    def generate(self, return_logits: bool = False) -> StepResult:
        """One decode step, waited for."""
        ...


@runtime_checkable
class TokenBudgetEngine(EngineBase, Protocol):
    """An engine with a paged KV pool whose steps carry prompt chunks beside the decode tokens
    (:class:`~switchyard.service.engine.paged.PagedEngine`). It has no ``prefill`` / ``insert``: a
    prompt enters with ``begin`` and is computed chunk by chunk by the steps themselves."""

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise OutOfRangeError when one such sequence alone could not fit the KV pool."""
        ...

    def free_blocks(self) -> int:
        """KV blocks that can be handed out now."""
        ...

    def held_blocks(self) -> int:
        """KV blocks some request holds."""
        ...

    def blocks_to_begin(self, tokens: Sequence[int], reuse_prefix: bool = True) -> int:
        """Fresh KV blocks ``begin`` would take for this prompt."""
        ...

    def begin(self, slot: int, tokens: Sequence[int], sampling: SamplingParams, *, counter: int = 0,
              reuse_prefix: bool = True) -> int | None:
        """Take a free slot and the prompt's blocks; returns its tokens found in the prefix cache, or
        None when the pool has too few blocks (nothing taken)."""
        ...

    def prefilling(self) -> list[int]:
        """Slots whose prompt is not all launched yet."""
        ...

    def decoding(self) -> list[int]:
        """Slots that make a token at every step."""
        ...

    def next_chunk(self, slot: int, queued_tokens: int = 0) -> Any:
        """The chunk of the slot's prompt the next step would carry, given ``queued_tokens`` prompt
        tokens waiting to begin."""
        ...

    def ensure_decode_blocks(self) -> bool:
        """Blocks for every decoding slot's next token; False (nothing taken) when the pool is short."""
        ...

    def dispatch(self, chunk: Any = None, return_logits: bool = False) -> PendingStep:
        """Launch one step: a token for every decoding slot, and the chunk when given."""
        ...
