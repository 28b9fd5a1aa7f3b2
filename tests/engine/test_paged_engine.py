"""The token-budget engine under the scheduler: greedy tokens identical to whole-prompt prefill into
contiguous slots, whatever the chunking, paging, preemption and prefix sharing; blocks all given back;
no prompt starved."""

from __future__ import annotations

import time

import jax
import numpy as np
import pytest
from helpers.engine_fixtures import tiny_engine, tiny_paged_engine, varied_checkpoint
from switchyard.service.engine import paged
from switchyard.service.engine.kv_blocks import BlockPool, SequenceBlocks
from switchyard.service.engine.sampling import SamplingParams
from switchyard.service.engine.scheduler import GenerationRequest, RequestRecord, Scheduler
from switchyard.service.engine.tokenizer import Tokenizer

BLOCK = 16  # positions per block in these engines; chunks are 16 tokens too
# Around block and chunk boundaries: one token, one short of a block, exactly one, one past, and
# prompts several budgets long.
PROMPT_LENGTHS = (1, 15, 16, 17, 32, 33, 50, 70)
OUT = 12


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_dir, tmp_path_factory):
    return varied_checkpoint(tmp_path_factory.mktemp("varied"), tiny_checkpoint_dir)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return Tokenizer.from_dir(checkpoint)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1234)
    return [[int(t) for t in rng.integers(3, 512, n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(checkpoint, prompts):
    """Greedy tokens of each prompt alone: prefilled whole into a contiguous slot, then decoded."""
    engine = tiny_engine(checkpoint, tp=1, slots=1, max_seq_len=128)
    out = []
    for prompt in prompts:
        prefix = engine.prefill(prompt)
        engine.insert(prefix, 0)
        tokens = [prefix.first_token] + [int(engine.generate().tokens[0]) for _ in range(OUT - 1)]
        engine.evict(0)
        out.append(tokens)
    return out


def serve_all(engine, tokenizer, requests: list[GenerationRequest], *, cancel: dict[str, int] | None = None,
              limit: int = 5000) -> tuple[dict[str, list[int]], dict[str, RequestRecord]]:
    """Submit every request at once and step until all finish; ``cancel`` maps an id to the number of
    its tokens after which it is cancelled."""
    records: dict[str, RequestRecord] = {}
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    sched = Scheduler(engine, tokenizer, max_queue=len(requests) + 1,
                      on_finish=lambda rec: records.__setitem__(rec.request_id, rec))
    for r in requests:
        def on_event(e, rid=r.request_id):
            if e.token_id is not None:
                tokens[rid].append(e.token_id)
            if cancel and rid in cancel and len(tokens[rid]) == cancel[rid] and e.finish_reason is None:
                sched.cancel(rid)
        r.on_event = on_event
        sched.submit(r)
    for _ in range(limit):
        if not sched.step() and sched.in_flight == 0:
            break
    assert sched.in_flight == 0, "requests left unfinished"
    return tokens, records


def greedy_requests(prompts, **kw) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", list(p), OUT, ignore_eos=True, **kw) for i, p in enumerate(prompts)]


def assert_pool_empty(engine) -> None:
    assert engine.pool.held() == 0, "blocks still held after every request finished"
    assert engine.free_blocks() == engine.pool.usable_blocks
    assert engine.free_slots() == list(range(engine.max_slots))


# Chunks of whole blocks (written into the pool a block at a time), and of a block and a half (chunks
# that start inside a block, written a position at a time).
@pytest.mark.parametrize(("tp", "step"), [(1, BLOCK), (2, BLOCK), (4, BLOCK), (1, BLOCK + BLOCK // 2)])
def test_chunked_paged_greedy_tokens_match_whole_prompt_prefill(checkpoint, tokenizer, prompts, reference, tp, step):
    engine = tiny_paged_engine(checkpoint, tp=tp, slots=4, max_seq_len=128, step_tokens=step, block_size=BLOCK)
    assert engine._chunks_block_aligned == (step % BLOCK == 0)
    tokens, records = serve_all(engine, tokenizer, greedy_requests(prompts))
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"] == reference[i], f"prompt of {len(prompt)} tokens"
        rec = records[f"r{i}"]
        assert rec.chunk_tokens.sum() == len(prompt) and (rec.chunk_tokens <= step).all()
        assert len(rec.chunk_steps) == -(-len(prompt) // step)
        assert rec.token_steps[0] == rec.chunk_steps[-1], "the first token comes from the last chunk's step"
    assert_pool_empty(engine)


def test_steps_with_no_sequence_decoding_carry_larger_chunks_and_keep_greedy_tokens(checkpoint, tokenizer, prompts,
                                                                                     reference):
    idle = 2 * BLOCK
    engine = tiny_paged_engine(checkpoint, slots=4, max_seq_len=128, step_tokens=BLOCK, block_size=BLOCK,
                               idle_step_tokens=idle)
    longest = prompts[-1]  # 70 tokens alone: two idle-step chunks of 32, then the last 6
    tokens, records = serve_all(engine, tokenizer, greedy_requests([longest]))
    assert tokens["r0"] == reference[-1]
    assert list(records["r0"].chunk_tokens) == [idle, idle, len(longest) - 2 * idle]
    # Longest first, so that the first steps have no sequence decoding; the rest come in beside them.
    engine.pool.clear_cache()  # (the 70-token prompt's blocks would be found there)
    tokens, records = serve_all(engine, tokenizer, greedy_requests(prompts[::-1]))
    for i, expected in enumerate(reference[::-1]):
        assert tokens[f"r{i}"] == expected, f"prompt of {len(prompts[::-1][i])} tokens"
    idle_steps = {int(step) for rec in records.values()
                  for step, n in zip(rec.chunk_steps, rec.chunk_tokens, strict=True) if n > BLOCK}
    assert idle_steps, "no step carried an idle-step chunk"
    for rid, rec in records.items():
        owner = {int(s) for s in rec.chunk_steps}
        decoded_at = {int(s) for s in rec.token_steps} - owner
        assert not decoded_at & idle_steps, f"{rid} decoded in a step whose chunk was larger than step_tokens"
    assert_pool_empty(engine)


def test_preemption_recomputes_and_keeps_greedy_tokens(checkpoint, tokenizer, prompts, reference):
    # Prompts of 16, 17, 32 and 33 tokens take 8 blocks to begin and 10 to finish: a pool of 6
    # admits three of them, whose growth then runs it dry.
    engine = tiny_paged_engine(checkpoint, slots=4, max_seq_len=96, kv_tokens=6 * BLOCK, step_tokens=BLOCK,
                               block_size=BLOCK)
    chosen = [i for i, p in enumerate(prompts) if len(p) in (16, 17, 32, 33)]
    tokens, records = serve_all(engine, tokenizer, greedy_requests([prompts[i] for i in chosen]))
    for j, i in enumerate(chosen):
        assert tokens[f"r{j}"] == reference[i]
    assert sum(r.preemptions for r in records.values()) > 0, "the pool was meant to run short"
    assert_pool_empty(engine)


def test_shared_prefix_blocks_are_reused_and_tokens_unchanged(checkpoint, tokenizer, reference, prompts):
    engine = tiny_paged_engine(checkpoint, slots=4, max_seq_len=128, step_tokens=BLOCK, block_size=BLOCK)
    base = prompts[-1]  # 70 tokens: 4 full blocks, and the 5th partly
    first_tokens, first = serve_all(engine, tokenizer, greedy_requests([base]))
    assert first["r0"].cached_tokens == 0 and first_tokens["r0"] == reference[-1]
    again, records = serve_all(engine, tokenizer, greedy_requests([base]))
    assert records["r0"].cached_tokens == 4 * BLOCK and again["r0"] == reference[-1]
    assert records["r0"].chunk_tokens.sum() == len(base) - 4 * BLOCK
    # Opting out computes the whole prompt again.
    _, opted_out = serve_all(engine, tokenizer, greedy_requests([base], reuse_prefix=False))
    assert opted_out["r0"].cached_tokens == 0
    # A prompt on exactly a block boundary keeps its last block computed (its logits give the first token).
    exact = base[: 4 * BLOCK]
    _, rec = serve_all(engine, tokenizer, greedy_requests([exact]))
    assert rec["r0"].cached_tokens == 3 * BLOCK
    assert_pool_empty(engine)


def test_blocks_all_free_after_cancels_and_deadlines(checkpoint, tokenizer, prompts):
    engine = tiny_paged_engine(checkpoint, slots=4, max_seq_len=128, kv_tokens=16 * BLOCK, step_tokens=BLOCK,
                               block_size=BLOCK)
    requests = [GenerationRequest(f"r{i}", list(p), 40 if len(p) < 80 else 20, ignore_eos=True)
                for i, p in enumerate(prompts)]
    requests[1].deadline = time.monotonic() - 1  # expired before it starts
    requests[5].deadline = time.monotonic() + 0.05
    cancel = {"r0": 1, "r3": 5, "r6": 2}
    _, records = serve_all(engine, tokenizer, requests, cancel=cancel)
    assert records["r1"].finish_reason == "deadline"
    assert {rid: records[rid].finish_reason for rid in cancel} == dict.fromkeys(cancel, "cancelled")
    assert_pool_empty(engine)


def test_a_long_prompt_is_not_starved_by_a_stream_of_short_ones(checkpoint, tokenizer):
    engine = tiny_paged_engine(checkpoint, slots=2, max_seq_len=128, step_tokens=BLOCK, block_size=BLOCK)
    first_token: dict[str, float] = {}
    sched = Scheduler(engine, tokenizer, max_queue=64)

    def submit(rid: str, length: int) -> None:
        def on_event(e):
            first_token.setdefault(rid, e.time)
        sched.submit(GenerationRequest(rid, [5] * length, 4, ignore_eos=True, on_event=on_event))

    submit("short-0", 3)
    submit("long", 100)
    for i in range(1, 40):  # a new short request every step
        submit(f"short-{i}", 3)
        sched.step()
    for _ in range(500):
        if not sched.step() and sched.in_flight == 0:
            break
    later = [t for rid, t in first_token.items() if rid.startswith("short-") and rid != "short-0"]
    assert first_token["long"] < min(later), "a request submitted after the long prompt went first"


def test_block_pool_books():
    pool = BlockPool(num_blocks=5, block_size=4)
    a, b = SequenceBlocks(), SequenceBlocks()
    assert pool.grow(a, 9) and a.blocks == [1, 2, 3] and pool.available() == 1
    assert not pool.grow(b, 8) and b.blocks == [], "nothing is taken when the pool is short"
    pool.register(a, list(range(9)), computed=9)  # two full blocks
    pool.release(a)
    assert pool.available() == 4 and pool.held() == 0
    blocks, hashes = pool.cached_prefix([*range(9), 99])
    assert blocks == [1, 2]
    assert pool.cached_prefix([0, 1, 2, 3, 5, 5, 6, 7, 8])[0] == [1], "the second block's hash covers its prefix"
    pool.take_cached(b, blocks, hashes)
    assert pool.grow(b, 12) and len(b.blocks) == 3 and pool.held() == 3
    c = SequenceBlocks()
    assert pool.grow(c, 4) and pool.available() == 0
    pool.release(b)
    pool.release(c)
    assert pool.available() == 4
    # Fresh blocks evict the least recently used cached block first; its hash goes with it.
    d = SequenceBlocks()
    assert pool.grow(d, 16) and pool.cached_prefix([*range(9), 99])[0] == []


def _buffer_addresses(tree) -> tuple[int, ...]:
    return tuple(shard.data.unsafe_buffer_pointer() for leaf in jax.tree.leaves(tree)
                 for shard in leaf.addressable_shards)


@pytest.mark.parametrize("tp", [1, 2])
def test_serving_after_warm_up_compiles_nothing_and_relaunches_on_the_same_buffers(checkpoint, tokenizer, prompts,
                                                                                   reference, tp):
    """Steady-state serving runs the programs warm-up compiled, and a step's inputs and outputs keep
    their device addresses from launch to launch, so a command buffer recorded once replays as it is
    (a new address makes XLA update it first)."""
    engine = tiny_paged_engine(checkpoint, tp=tp, slots=4, max_seq_len=128, step_tokens=BLOCK, block_size=BLOCK)
    engine.warmup()
    compiled = engine.compiled_count()
    small_programs = (engine._write_io_fn._cache_size(), engine._read_out_fn._cache_size())
    seen: set[tuple[int, ...]] = set()
    step_fn = engine._step_fn

    def recording_step_fn(*shape):
        fn = step_fn(*shape)

        def launch(params, state, io):
            seen.add(_buffer_addresses((params, state, io)))
            out = fn(params, state, io)
            seen.add(_buffer_addresses((params, out[0], out[1])))
            return out

        return launch

    engine._step_fn = recording_step_fn
    tokens, _ = serve_all(engine, tokenizer, greedy_requests(prompts))
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == reference
    assert engine.compiled_count() == compiled, "steady-state serving compiled a new step"
    assert (engine._write_io_fn._cache_size(), engine._read_out_fn._cache_size()) == small_programs, \
        "steady-state serving compiled a new staging or read-out program"
    assert len(seen) == 1, f"step programs saw {len(seen)} different sets of buffers"


def test_chunk_steps_run_the_narrower_batch_width_that_holds_the_decoding_sequences(checkpoint, tokenizer, prompts,
                                                                                    reference, monkeypatch):
    # Widths 32 and 64 apart by the threshold; 2 and 4 within it, as 16 and 32 would be.
    assert tiny_paged_engine(checkpoint, slots=4, max_seq_len=128, step_tokens=BLOCK,
                             block_size=BLOCK).chunk_batches == [4]
    monkeypatch.setattr(paged, "NARROW_CHUNK_MIN_ROWS", 2)  # a 4-slot engine that runs both widths
    engine = tiny_paged_engine(checkpoint, slots=4, max_seq_len=128, step_tokens=BLOCK, block_size=BLOCK)
    assert engine.batch_buckets == [2, 4] and engine.chunk_batches == [2, 4]
    engine.warmup()
    compiled = engine.compiled_count()
    seen: list[tuple[int, int, int]] = []  # (width, decoding sequences, highest decoding slot) of each chunk step
    dispatch = engine.dispatch

    def recording_dispatch(chunk=None, return_logits=False):
        decoding = engine.decoding()
        pending = dispatch(chunk, return_logits)
        if chunk is not None:
            seen.append((pending.width, len(decoding), max(decoding, default=-1)))
        return pending

    engine.dispatch = recording_dispatch
    tokens, _ = serve_all(engine, tokenizer, greedy_requests(prompts))
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == reference
    assert all(width == (2 if count <= 2 else 4) for width, count, _ in seen), seen
    assert {width for width, _, _ in seen} == {2, 4}, "both widths ran"
    assert any(width == 2 and top >= 2 for width, _, top in seen), "no step ran high slots in the narrow width"
    assert engine.compiled_count() == compiled, "a chunk step compiled a new program after warm-up"
    assert_pool_empty(engine)


def test_decoding_slots_run_as_the_first_rows_whatever_their_numbers(checkpoint, prompts, reference):
    """Sequences in two high slots of 8 decode in the narrowest width (2 rows), their tokens reported
    by slot and equal to each prompt alone."""
    engine = tiny_paged_engine(checkpoint, slots=8, max_seq_len=128, step_tokens=BLOCK, block_size=BLOCK)
    assert engine.batch_buckets[0] == 2
    picks = {7: 3, 5: 6}  # slot: prompt
    made: dict[int, list[int]] = {slot: [] for slot in picks}
    widths = []

    def step(chunk=None) -> None:
        assert engine.ensure_decode_blocks()
        pending = engine.dispatch(chunk)
        if chunk is None:
            widths.append(pending.width)
        result = engine.collect(pending)
        assert result.batch <= 8 and set(np.flatnonzero(result.active)) <= set(picks)
        for slot in np.flatnonzero(result.active):
            made[int(slot)].append(int(result.tokens[slot]))
        if chunk is not None and chunk.completes:
            made[chunk.slot].append(result.chunk_token)

    for slot, i in picks.items():  # slot 7 decodes beside slot 5's chunks
        assert engine.begin(slot, prompts[i], SamplingParams()) == 0
        while slot in engine.prefilling():
            step(engine.next_chunk(slot))
    while min(len(t) for t in made.values()) < OUT:
        step()
    assert set(widths) == {2}
    for slot, i in picks.items():
        assert made[slot][:OUT] == reference[i], f"slot {slot}"
    for slot in picks:
        engine.evict(slot)
    assert_pool_empty(engine)


def test_short_chunks_run_in_smaller_programs_and_keep_greedy_tokens(checkpoint, tokenizer, prompts, reference):
    engine = tiny_paged_engine(checkpoint, slots=4, max_seq_len=128, step_tokens=4 * BLOCK, block_size=BLOCK)
    # The surge chunk (twice the budget) is also the idle chunk here: the context holds no larger one.
    assert engine.chunk_sizes == [BLOCK, 4 * BLOCK, 8 * BLOCK]
    assert [engine.chunk_size_for(n) for n in (1, BLOCK, BLOCK + 1, 4 * BLOCK)] == [BLOCK, BLOCK, 4 * BLOCK, 4 * BLOCK]
    assert engine.chunk_size_for(4 * BLOCK + 1) == engine.idle_step_tokens == 8 * BLOCK
    engine.warmup()
    compiled = engine.compiled_count()
    tokens, _ = serve_all(engine, tokenizer, greedy_requests(prompts))
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == reference
    # Again, from the prefix cache: each prompt's remainder after its cached blocks is a short chunk.
    tokens, records = serve_all(engine, tokenizer, greedy_requests(prompts))
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == reference
    assert any(rec.cached_tokens for rec in records.values())
    assert engine.compiled_count() == compiled, "a short chunk compiled a new step after warm-up"
    assert_pool_empty(engine)


def test_a_backlog_of_more_than_the_surge_budgets_doubles_the_chunk(checkpoint):
    engine = tiny_paged_engine(checkpoint, slots=4, max_seq_len=128, step_tokens=BLOCK, block_size=BLOCK)
    assert engine.surge_step_tokens == 2 * BLOCK < engine.idle_step_tokens
    assert engine.chunk_sizes == [BLOCK, 2 * BLOCK]
    threshold = paged.SURGE_BACKLOG_BUDGETS * BLOCK
    engine.begin(0, list(range(3, 73)), SamplingParams())
    engine.begin(1, list(range(3, 53)), SamplingParams())
    begun = 70 + 50  # prompt tokens begun and not yet computed
    assert engine.next_chunk(0).length == BLOCK
    assert engine.next_chunk(0, queued_tokens=threshold - begun).length == BLOCK
    assert engine.next_chunk(0, queued_tokens=threshold - begun + 1).length == 2 * BLOCK
    assert engine.next_chunk(1, queued_tokens=10 * threshold).length == 2 * BLOCK
    for slot in (0, 1):
        engine.evict(slot)
    assert_pool_empty(engine)


def test_surge_chunks_keep_greedy_tokens(checkpoint, tokenizer, prompts, reference, monkeypatch):
    # Every step with a chunk surges (a backlog of more than 0 budgets), beside decoding sequences.
    monkeypatch.setattr(paged, "SURGE_BACKLOG_BUDGETS", 0)
    engine = tiny_paged_engine(checkpoint, slots=4, max_seq_len=128, step_tokens=BLOCK, block_size=BLOCK)
    tokens, records = serve_all(engine, tokenizer, greedy_requests(prompts))
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == reference
    assert max(max(rec.chunk_tokens) for rec in records.values()) == 2 * BLOCK
    assert_pool_empty(engine)


def test_the_scheduler_counts_queued_prompts_in_the_backlog(checkpoint, tokenizer, prompts, reference, monkeypatch):
    # One slot: only the queue's prompts can take the backlog past the longest prompt's own budgets.
    longest = prompts[-1]
    monkeypatch.setattr(paged, "SURGE_BACKLOG_BUDGETS", -(-len(longest) // BLOCK))
    engine = tiny_paged_engine(checkpoint, slots=1, max_seq_len=128, step_tokens=BLOCK, block_size=BLOCK)
    alone, records = serve_all(engine, tokenizer, greedy_requests([longest]))
    assert max(records["r0"].chunk_tokens) == BLOCK
    engine.pool.clear_cache()
    tokens, records = serve_all(engine, tokenizer, greedy_requests([longest, *prompts[:-1]]))
    assert max(records["r0"].chunk_tokens) == 2 * BLOCK
    assert tokens["r0"] == alone["r0"] == reference[-1]
    assert [tokens[f"r{i + 1}"] for i in range(len(prompts) - 1)] == reference[:-1]
    assert_pool_empty(engine)
