"""Request text into token ids without holding up the server (service/api/tokenizing.py): prompts
too long for the context refused before or without listing their ids, the GIL free while the
tokenizer works, and a byte budget on the text waiting for the pool."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from helpers.serving_harness import tiny_tokenizer
from switchyard.service.api.tokenizing import PromptEncoder, TextBudgetExceeded, TextPool
from switchyard.service.engine.tokenizer import TooManyTokens, max_token_bytes
from switchyard.service.errors import OutOfRangeError

MEGABYTE = ("The quick brown fox jumps over the lazy dog. " * 23302)[: 1 << 20]


def test_a_prompt_too_long_for_the_context_is_refused_naming_its_size():
    tokenizer = tiny_tokenizer()
    encoder = PromptEncoder(tokenizer, max_prompt_tokens=255)
    assert encoder.encode("hello there") == tokenizer.encode("hello there")
    with pytest.raises(OutOfRangeError, match=r"prompt is 1048576 bytes of text: more tokens than"):
        encoder.encode(MEGABYTE)  # refused before tokenizing: more bytes than 255 tokens can stand for
    just_over = MEGABYTE[: 255 * tokenizer.max_token_bytes]
    with pytest.raises(OutOfRangeError, match=r"prompt has \d+ tokens; this deployment's context is 256 tokens"):
        encoder.encode(just_over)
    with pytest.raises(TooManyTokens) as counted:
        tokenizer.encode(just_over, max_tokens=255)
    assert counted.value.count == len(tokenizer.encode(just_over))


def test_the_byte_bound_holds_only_for_pipelines_that_keep_every_byte():
    vocab = {"model": {"vocab": {"a": 0, "ĠĠĠĠ": 1}}, "added_tokens": [{"content": "<|eot|>"}]}
    assert max_token_bytes({**vocab, "normalizer": None, "pre_tokenizer": {"type": "ByteLevel"}}) == 8
    split = {"type": "Sequence", "pretokenizers": [{"type": "Split", "behavior": "Isolated"}, {"type": "ByteLevel"}]}
    assert max_token_bytes({**vocab, "normalizer": None, "pre_tokenizer": split}) == 8
    assert max_token_bytes({**vocab, "normalizer": {"type": "NFKC"}, "pre_tokenizer": None}) is None
    removing = {"type": "Split", "behavior": "Removed"}
    assert max_token_bytes({**vocab, "normalizer": None, "pre_tokenizer": removing}) is None
    assert max_token_bytes({**vocab, "normalizer": None, "pre_tokenizer": {"type": "Whitespace"}}) is None


@pytest.mark.alone
def test_the_tokenizer_leaves_the_gil_to_other_threads_while_it_works():
    """A thread that wakes every millisecond keeps waking while a megabyte is tokenized (the library's
    plain encode would stop it for the whole encode)."""
    tokenizer = tiny_tokenizer()
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    start = time.perf_counter()
    with pytest.raises(TooManyTokens):
        tokenizer.encode(MEGABYTE, max_tokens=1000)
    took = time.perf_counter() - start
    done.set()
    ticker.join()
    assert max(gaps) < took / 3, (max(gaps), took)


def test_text_beyond_the_budget_waits_for_no_pool_and_is_refused():
    async def scenario() -> None:
        pool = TextPool(workers=1, budget_bytes=1000)
        release = threading.Event()
        first = asyncio.ensure_future(pool.run(800, release.wait, 10))
        await asyncio.sleep(0.05)
        assert pool.pending_bytes == 800
        with pytest.raises(TextBudgetExceeded, match="800 bytes of request text are waiting"):
            await pool.run(300, lambda: None)
        first.cancel()  # the caller leaves; the worker still holds the bytes until it is done
        await asyncio.sleep(0.05)
        assert pool.pending_bytes == 800
        release.set()
        for _ in range(100):
            if pool.pending_bytes == 0:
                break
            await asyncio.sleep(0.01)
        assert pool.pending_bytes == 0
        assert await pool.run(300, lambda: "ok") == "ok"
        pool.close()

    asyncio.run(scenario())
