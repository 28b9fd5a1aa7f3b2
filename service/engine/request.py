"""What the scheduler takes and gives back: token ids only (text is the server's, ``service/api/text.py``).

A :class:`GenerationRequest` asks for up to ``max_tokens`` tokens after a prompt; generation stops at
a stop token id (the model's end-of-sequence ids too, unless ``ignore_eos``), but never before
``min_tokens``. Each token made comes back as a :class:`TokenEvent` on the scheduler's thread, the
last one with its ``finish_reason``; when the request ends, a :class:`RequestRecord` of every
token's timing goes to the scheduler's ``on_finish`` (traces), just before the final event.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
from switchyard.service.engine.sampling import SamplingParams

FINISH_REASONS = ("stop", "length", "cancelled", "deadline", "error")


@dataclasses.dataclass
class TokenEvent:
    request_id: str
    index: int  # 0-based output position
    token_id: int | None  # None on a final event without a token
    finish_reason: str | None  # None, or one of FINISH_REASONS
    step: int  # engine step that made the token
    batch_size: int
    time: float  # time.monotonic()


@dataclasses.dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    deadline: float | None = None  # time.monotonic() value
    on_event: Callable[[TokenEvent], None] | None = None  # called on the scheduler thread
    ignore_eos: bool = False  # the model's end-of-sequence ids do not stop it (stop_token_ids still do)
    min_tokens: int = 0  # no stop token id ends it before this many tokens
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
    # how many prompt tokens each carried.
    chunk_steps: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    chunk_times: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.float64))
    chunk_tokens: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int32))
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    preemptions: int = 0  # times the request lost its KV blocks and was recomputed

    @property
    def output_tokens(self) -> int:
        return int(self.token_ids.size)

    def cut(self, tokens: int, finish_reason: str) -> RequestRecord:
        """The record of the first ``tokens`` tokens, ended with ``finish_reason`` (the server stopped
        the request at a stop string: the tokens made after it never reached the client)."""
        n = min(tokens, self.output_tokens)
        return dataclasses.replace(self, token_ids=self.token_ids[:n], token_times=self.token_times[:n],
                                   token_steps=self.token_steps[:n], token_batch_sizes=self.token_batch_sizes[:n],
                                   finish_reason=finish_reason)
