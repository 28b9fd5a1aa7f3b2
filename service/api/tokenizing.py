"""Request text into token ids without holding up the streams the server is delivering.

A megabyte of text takes most of a second to tokenize, and the server's process delivers every
token of every stream, so:

- sizes are checked before any work: a text with more bytes than the context's tokens could stand
  for (:attr:`Tokenizer.max_token_bytes`) is refused at once;
- the conversion runs in a small pool of worker threads at a lower CPU priority than the server and
  the engine, and the tokenizer works there without holding the GIL (:meth:`Tokenizer.encode`);
- tokens are counted before they become a list, so a prompt far too long costs no list of its ids;
- the request bytes waiting for (or in) that pool have a budget: beyond it a request is refused
  with RESOURCE_EXHAUSTED rather than queued behind megabytes of others.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any

from switchyard.service.engine.tokenizer import TooManyTokens
from switchyard.service.errors import OutOfRangeError, QueueFullError

WORKERS = 2
BUDGET_BYTES = 8 << 20  # request bytes in the pool or waiting for it
WORKER_NICENESS = 10  # below the event loop's thread and the engine's process


class TextBudgetExceeded(QueueFullError):
    """Too much text is waiting to be tokenized (RESOURCE_EXHAUSTED)."""


def _lower_priority() -> None:
    """Each worker thread yields the CPU to the loop and the engine (Linux sets niceness per thread)."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICENESS)


class PromptEncoder:
    """The tokenizer as request conversion sees it: prompts bounded by the context, on the pool's
    threads. ``max_prompt_tokens``: the most tokens a prompt may have (the context less one)."""

    def __init__(self, tokenizer: Any, max_prompt_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """A prompt's ids; OutOfRangeError, before or without listing them, when it cannot fit.
        ``special`` false: no BOS added (a chat template's text has its own)."""
        limit = self.max_prompt_tokens
        per_token = self.tokenizer.max_token_bytes
        if per_token is not None and len(text) > limit * per_token:  # characters: no more than bytes
            size = len(text.encode("utf-8", "surrogatepass"))
            if size > limit * per_token:
                raise OutOfRangeError(
                    f"prompt is {size} bytes of text: more tokens than this deployment's context allows "
                    f"(at most {limit}; one token stands for at most {per_token} bytes)")
        try:
            if special:  # keyword only when needed: test tokenizers take (text, max_tokens)
                return self.tokenizer.encode(text, max_tokens=limit)
            return self.tokenizer.encode(text, max_tokens=limit, special=False)
        except TooManyTokens as err:
            raise OutOfRangeError(
                f"prompt has {err.count} tokens; this deployment's context is {limit + 1} tokens, so a prompt "
                f"may have at most {limit}") from None

    def encode_any(self, text: str) -> list[int]:
        """Ids of any text the request size allows (Tokenize): no context bound."""
        return self.tokenizer.encode(text)


class TextPool:
    """Runs request conversions (which tokenize) in a bounded pool under a byte budget."""

    def __init__(self, workers: int = WORKERS, budget_bytes: int = BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="switchyard-text", initializer=_lower_priority)
        self._pending = 0  # bytes reserved; only the event loop's thread changes it

    @property
    def pending_bytes(self) -> int:
        return self._pending

    async def run(self, size: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a worker, ``size`` request bytes held against the budget meanwhile."""
        if self._pending and self._pending + size > self.budget_bytes:
            raise TextBudgetExceeded(
                f"{self._pending} bytes of request text are waiting to be tokenized; this server takes at "
                f"most {self.budget_bytes} at once: retry later")
        self._pending += size
        work = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        work.add_done_callback(lambda done: self._release(size, done))
        # Shielded: a caller that leaves does not stop the worker, and the bytes stay reserved until
        # the worker is done with them.
        return await asyncio.shield(work)

    def _release(self, size: int, done: asyncio.Future[Any]) -> None:
        self._pending -= size
        if not done.cancelled():
            done.exception()  # retrieved: a caller that left is not told of it

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
