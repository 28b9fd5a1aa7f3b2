"""The host-side parts of a step, without JAX: the block pool and the KV manager's books, the step
policy's sizes and shapes, and a plan as the words a pipeline's stage 0 sends."""

from __future__ import annotations

import numpy as np
import pytest
from switchyard.service.engine import step_policy
from switchyard.service.engine.kv_blocks import NULL_BLOCK, BlockPool, SequenceBlocks
from switchyard.service.engine.kv_manager import KVManager
from switchyard.service.engine.plan import decode_plan, encode_plan
from switchyard.service.engine.sampling import SamplingParams
from switchyard.service.engine.step_policy import StepPolicy, StepShape

BLOCK = 16


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


def test_kv_manager_books_a_sequence_from_its_prompt_to_its_eviction():
    kv = KVManager(max_slots=3, max_seq_len=64, kv_tokens=8 * BLOCK, block_size=BLOCK)
    assert kv.kv_tokens == 8 * BLOCK and kv.free_slots() == [0, 1, 2]
    assert kv.begin(1, list(range(40)), SamplingParams()) == 0
    assert kv.free_slots() == [0, 2] and kv.held_blocks() == 3 and kv.prefilling() == [1]
    assert list(kv.table(1)[:4]) == [1, 2, 3, NULL_BLOCK]
    tables = kv.row_tables(kv.decoding())
    assert tables is not None and (tables == NULL_BLOCK).all(), "nothing decodes yet"
    assert kv.row_tables(kv.decoding()) is None, "unchanged since the last plan"
    policy = StepPolicy(max_slots=3, max_seq_len=64, block_size=BLOCK, step_tokens=BLOCK)
    for _ in range(3):  # 16 + 16 + 8: the last chunk completes the prompt
        plan = policy.plan(kv, [1])
        kv.launched(plan)
    assert list(kv.decoding()) == [1] and kv.sequence(1).position == 40 and kv.prefilling() == []
    # Decoding fills the third block; the 49th position needs a fourth.
    for _ in range(8):
        assert kv.ensure_decode_blocks()
        kv.launched(policy.plan(kv, []))
    assert kv.sequence(1).position == 48 and kv.decode_blocks_needed() == 1
    assert kv.ensure_decode_blocks() and kv.held_blocks() == 4
    tables = kv.row_tables(kv.decoding())
    assert list(tables[0]) == [1, 2, 3, 4] and (tables[1:] == NULL_BLOCK).all()
    kv.evict(1)
    assert kv.held_blocks() == 0 and kv.free_slots() == [0, 1, 2] and kv.decoding().size == 0
    # Its two full prompt blocks stay in the prefix cache for a prompt that starts the same.
    assert kv.begin(0, list(range(40)), SamplingParams()) == 2 * BLOCK


def test_kv_manager_refuses_what_the_pool_cannot_hold():
    kv = KVManager(max_slots=2, max_seq_len=64, kv_tokens=4 * BLOCK, block_size=BLOCK)
    assert kv.begin(0, list(range(3 * BLOCK)), SamplingParams(), reuse_prefix=False) == 0
    assert kv.begin(1, list(range(100, 100 + 2 * BLOCK)), SamplingParams()) is None
    assert kv.held_blocks() == 3 and kv.free_slots() == [1], "nothing is taken when the pool is short"
    with pytest.raises(ValueError, match="slot 0 is not free"):
        kv.begin(0, [1], SamplingParams())


def test_policy_sizes_and_the_shapes_it_compiles(monkeypatch):
    policy = StepPolicy(max_slots=4, max_seq_len=128, block_size=BLOCK, step_tokens=4 * BLOCK)
    # The surge chunk (twice the budget) is also the idle chunk here: the context holds no larger one.
    assert policy.chunk_sizes == [BLOCK, 4 * BLOCK, 8 * BLOCK] and policy.idle_step_tokens == 8 * BLOCK
    assert [policy.chunk_size_for(n) for n in (1, BLOCK, BLOCK + 1, 4 * BLOCK)] == [BLOCK, BLOCK, 4 * BLOCK, 4 * BLOCK]
    assert policy.chunk_size_for(4 * BLOCK + 1) == 8 * BLOCK
    assert policy.batch_widths == [2, 4] and policy.chunk_widths == [4]
    assert policy.kv_buckets == [64, 128]
    assert policy.shape(3, None, 0, True) == StepShape(4, greedy=True)
    assert policy.shape(1, 70, 6, False) == StepShape(4, BLOCK, 128, False)
    # A chunk runs in a sampled program even when every row is greedy (greedy rows take the argmax).
    assert policy.shape(1, 70, 6, True) == StepShape(4, BLOCK, 128, False)
    shapes = policy.shapes()
    assert len(shapes) == len(set(shapes)) and StepShape(2) in shapes and StepShape(4, 8 * BLOCK, 128, False) in shapes
    assert not any(s.with_chunk and s.greedy for s in shapes)
    assert {s for s in shapes if not s.with_chunk} == {StepShape(w, greedy=g) for w in (2, 4) for g in (True, False)}
    # A doubling just short of the table is left to the table's bucket: 4096 beside 4352 is not compiled.
    serving = StepPolicy(max_slots=64, max_seq_len=4352, block_size=64, step_tokens=256)
    assert serving.kv_buckets == [256, 512, 1024, 2048, 4352]
    assert serving.shape(4, 4000, 256, True).kv_len == 4352 and serving.shape(4, 2000, 256, True).kv_len == 2048
    assert len(serving.shapes()) == 52  # 12 decode-only, 30 with a chunk, 10 with four small chunks
    assert StepPolicy(max_slots=4, max_seq_len=6144, block_size=64, step_tokens=256).kv_buckets[-2:] == [4096, 6144]
    monkeypatch.setattr(step_policy, "NARROW_CHUNK_MIN_ROWS", 2)
    assert StepPolicy(max_slots=4, max_seq_len=128, block_size=BLOCK).chunk_widths == [2, 4]


def test_one_program_per_set_of_equal_products_comes_first():
    shapes = StepPolicy(max_slots=64, max_seq_len=4352, block_size=64, step_tokens=256).shapes()
    ordered = step_policy.products_first(shapes)
    assert sorted(ordered) == sorted(shapes)
    sets = {s.products for s in shapes}
    leaders, rest = ordered[:len(sets)], ordered[len(sets):]
    # Each set's first program in the policy's order leads it; the rest keep the policy's order.
    assert [s.products for s in leaders] == list(dict.fromkeys(s.products for s in shapes))
    assert all(leader == next(s for s in shapes if s.products == leader.products) for leader in leaders)
    assert rest == [s for s in shapes if s not in leaders]
    # 52 programs, 15 sets of products: 6 decode widths (greedy and sampled alike); each chunk width and
    # size, whatever the context bucket (2 x 3); four small chunks at either width; the idle chunk.
    assert len(sets) == 15 and StepShape(8, greedy=False).products == StepShape(8).products
    assert StepShape(64, 256, 512, False).products == StepShape(64, 256, 4352, False).products


def test_short_remainders_share_a_step_and_a_longer_chunk_goes_alone():
    kv = KVManager(max_slots=8, max_seq_len=128, kv_tokens=32 * BLOCK, block_size=BLOCK)
    policy = StepPolicy(max_slots=8, max_seq_len=128, block_size=BLOCK, step_tokens=4 * BLOCK)
    assert policy.packed_chunks == 4 and policy.chunk_sizes[0] == BLOCK
    lengths = {0: 5, 1: 3 * BLOCK, 2: BLOCK, 3: 1, 4: 7, 5: 2, 6: 3}
    for slot, n in lengths.items():
        kv.begin(slot, [100 + slot] * n, SamplingParams(), reuse_prefix=False)
    # The oldest fits the small size: the whole remainders of the next that fit go beside it (slot 1's
    # does not), four at most, the context bucket the furthest end's.
    plan = policy.plan(kv, list(lengths))
    assert sorted(c.slot for c in plan.chunks) == [0, 2, 3, 4] and all(c.completes for c in plan.chunks)
    assert policy.chunk_widths == [8] and policy.kv_buckets == [4 * BLOCK, 8 * BLOCK]
    assert plan.shape == StepShape(8, BLOCK, 4 * BLOCK, False, 4)
    assert sum(c.length for c in plan.chunks) == 5 + BLOCK + 1 + 7
    kv.launched(plan)
    assert sorted(kv.decoding().tolist()) == [0, 2, 3, 4] and kv.prefilling() == [1, 5, 6]
    # A chunk larger than the small size goes alone, though short ones wait behind it.
    assert kv.ensure_decode_blocks()
    plan = policy.plan(kv, [1, 5, 6])
    assert [c.slot for c in plan.chunks] == [1] and plan.shape.chunks == 1 and plan.chunks[0].length == 3 * BLOCK
    kv.launched(plan)
    assert kv.ensure_decode_blocks()
    plan = policy.plan(kv, [5, 6])
    assert [c.slot for c in plan.chunks] == [5, 6] and plan.shape.chunks == 4
    # One short remainder alone runs in the single small chunk's program.
    kv.launched(plan)
    kv.begin(7, [1, 2, 3], SamplingParams(), reuse_prefix=False)
    assert kv.ensure_decode_blocks()
    assert policy.plan(kv, [7]).shape.chunks == 1
    assert [s for s in policy.shapes() if s.chunks > 1] == [StepShape(8, BLOCK, kv, False, 4) for kv in (64, 128)]


def test_a_backlog_of_more_than_the_surge_budgets_doubles_the_budget():
    policy = StepPolicy(max_slots=4, max_seq_len=128, block_size=BLOCK, step_tokens=BLOCK)
    threshold = step_policy.SURGE_BACKLOG_BUDGETS * BLOCK
    assert policy.surge_step_tokens == 2 * BLOCK < policy.idle_step_tokens
    assert policy.chunk_length(70, True, threshold) == BLOCK
    assert policy.chunk_length(70, True, threshold + 1) == 2 * BLOCK
    assert policy.chunk_length(5, True, 10 * threshold) == 5
    assert policy.chunk_length(policy.idle_step_tokens, False, 0) == policy.idle_step_tokens


def test_a_plan_travels_as_words_and_comes_back_whole():
    kv = KVManager(max_slots=3, max_seq_len=64, kv_tokens=8 * BLOCK, block_size=BLOCK)
    policy = StepPolicy(max_slots=3, max_seq_len=64, block_size=BLOCK, step_tokens=BLOCK)
    kv.begin(0, list(range(5)), SamplingParams())
    kv.launched(policy.plan(kv, [0]))  # slot 0 decodes from now on
    kv.begin(2, list(range(50, 90)), SamplingParams(temperature=0.7, top_k=40, top_p=0.9, seed=123), counter=3)
    plan = policy.plan(kv, [2])
    assert plan.tables is not None and len(plan.chunks) == 1 and plan.rows.tolist() == [0]
    back = decode_plan(encode_plan(plan))
    assert back.shape == plan.shape and back.rows.tolist() == [0] and np.array_equal(back.tables, plan.tables)
    (chunk,), (sent,) = back.chunks, plan.chunks
    assert (chunk.slot, chunk.start, chunk.completes, chunk.counter) == (2, 0, False, 3)
    as_f32 = lambda s: (np.float32(s.temperature), s.top_k, np.float32(s.top_p), s.seed)  # noqa: E731 (the device's)
    assert as_f32(chunk.sampling) == as_f32(sent.sampling)
    assert np.array_equal(chunk.tokens, sent.tokens) and np.array_equal(chunk.table, sent.table)
    kv.launched(plan)
    decode = policy.plan(kv, [])
    assert decode_plan(encode_plan(decode)).tables is None and decode_plan(encode_plan(decode)).chunks == ()
    with pytest.raises(ValueError, match="left over"):
        decode_plan(np.concatenate([encode_plan(plan), [7]]).astype(np.int32))


def test_a_plan_of_several_chunks_travels_as_words_and_comes_back_whole():
    kv = KVManager(max_slots=6, max_seq_len=128, kv_tokens=24 * BLOCK, block_size=BLOCK)
    policy = StepPolicy(max_slots=6, max_seq_len=128, block_size=BLOCK, step_tokens=4 * BLOCK)
    kv.begin(0, list(range(40)), SamplingParams())
    kv.launched(policy.plan(kv, [0]))  # slot 0 decodes from now on
    samplings = [SamplingParams(), SamplingParams(temperature=0.5, top_k=7, top_p=0.75, seed=9), SamplingParams()]
    for slot, (n, sampling) in enumerate(zip((3, BLOCK, 1), samplings, strict=True), start=2):
        kv.begin(slot, list(range(100 * slot, 100 * slot + n)), sampling, counter=slot)
    assert kv.ensure_decode_blocks()
    plan = policy.plan(kv, [2, 3, 4])
    assert len(plan.chunks) == 3 and plan.shape.chunks == 4 and plan.rows.tolist() == [0]
    back = decode_plan(encode_plan(plan))
    assert back.shape == plan.shape and back.rows.tolist() == [0] and np.array_equal(back.tables, plan.tables)
    as_f32 = lambda s: (np.float32(s.temperature), s.top_k, np.float32(s.top_p), s.seed)  # noqa: E731 (the device's)
    for got, sent in zip(back.chunks, plan.chunks, strict=True):
        fields = lambda c: (c.slot, c.start, c.completes, c.counter)  # noqa: E731
        assert fields(got) == fields(sent)
        assert as_f32(got.sampling) == as_f32(sent.sampling)
        assert np.array_equal(got.tokens, sent.tokens) and np.array_equal(got.table, sent.table)
