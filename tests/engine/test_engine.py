"""The engine under the scheduler, with real numerics: greedy tokens equal to each prompt alone in one
chunk, whatever the chunking, the tensor-parallel and pipeline layout, preemption and prefix sharing;
the programs of steady-state serving all compiled at warm-up and relaunched on the same buffers."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers.engine_fixtures import generate, tiny_engine, varied_checkpoint
from switchyard.service.engine import step_policy
from switchyard.service.engine.request import GenerationRequest, RequestRecord
from switchyard.service.engine.scheduler import Scheduler

BLOCK = 16  # positions per block in these engines; chunks are 16 tokens too
# Around block and chunk boundaries: one token, one short of a block, exactly one, one past, and
# prompts several budgets long.
PROMPT_LENGTHS = (1, 15, 16, 17, 32, 33, 50, 70)
OUT = 12


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint_dir, tmp_path_factory):
    return varied_checkpoint(tmp_path_factory.mktemp("varied"), tiny_checkpoint_dir)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1234)
    return [[int(t) for t in rng.integers(3, 512, n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(checkpoint, prompts):
    """Greedy tokens of each prompt alone, its whole prompt in one chunk."""
    engine = tiny_engine(checkpoint, slots=1, max_seq_len=128, step_tokens=128)
    return [generate(engine, [prompt], OUT)[0] for prompt in prompts]


def serve_all(engine, requests: list[GenerationRequest], *, cancel: dict[str, int] | None = None,
              limit: int = 5000) -> tuple[dict[str, list[int]], dict[str, RequestRecord], Scheduler]:
    """Submit every request at once and step until all finish; ``cancel`` maps an id to the number of
    its tokens after which it is cancelled."""
    records: dict[str, RequestRecord] = {}
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    sched = Scheduler(engine, max_queue=len(requests) + 1,
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
    assert sched.kv.held_blocks() == 0, "blocks still held after every request finished"
    assert sched.kv.free_slots() == list(range(engine.max_slots))
    return tokens, records, sched


def greedy_requests(prompts, **kw) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", list(p), OUT, ignore_eos=True, **kw) for i, p in enumerate(prompts)]


# Chunks of whole blocks (written into the pool a block at a time), and of a block and a half (chunks
# that start inside a block, written a position at a time); a tensor-parallel group wider than the KV
# heads, and tensor-parallel pipeline stages (each alone is a case of these: tests/engine/test_engine_hf.py
# compares both with transformers).
@pytest.mark.parametrize(("tp", "pp", "step"), [(1, 1, BLOCK), (1, 1, BLOCK + BLOCK // 2), (4, 1, BLOCK),
                                                 (2, 2, BLOCK)])
def test_chunked_greedy_tokens_match_each_prompt_alone(checkpoint, prompts, reference, tp, pp, step):
    engine = tiny_engine(checkpoint, tp=tp, pp=pp, slots=4, max_seq_len=128, step_tokens=step, block_size=BLOCK)
    assert engine.policy.chunks_block_aligned == (step % BLOCK == 0)
    tokens, records, _ = serve_all(engine, greedy_requests(prompts))
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"] == reference[i], f"prompt of {len(prompt)} tokens"
        rec = records[f"r{i}"]
        assert rec.chunk_tokens.sum() == len(prompt) and (rec.chunk_tokens <= step).all()
        assert len(rec.chunk_steps) == -(-len(prompt) // step)
        assert rec.token_steps[0] == rec.chunk_steps[-1], "the first token comes from the last chunk's step"


def test_preemption_recomputes_and_keeps_greedy_tokens(checkpoint, prompts, reference):
    # Prompts of 16, 17, 32 and 33 tokens take 8 blocks to begin and 10 to finish: a pool of 6
    # admits three of them, whose growth then runs it dry.
    engine = tiny_engine(checkpoint, slots=4, max_seq_len=96, kv_tokens=6 * BLOCK, step_tokens=BLOCK, block_size=BLOCK)
    chosen = [i for i, p in enumerate(prompts) if len(p) in (16, 17, 32, 33)]
    tokens, records, _ = serve_all(engine, greedy_requests([prompts[i] for i in chosen]))
    for j, i in enumerate(chosen):
        assert tokens[f"r{j}"] == reference[i]
    assert sum(r.preemptions for r in records.values()) > 0, "the pool was meant to run short"


def test_shared_prefix_blocks_are_reused_and_tokens_unchanged(checkpoint, reference, prompts):
    engine = tiny_engine(checkpoint, slots=4, max_seq_len=128, step_tokens=BLOCK, block_size=BLOCK)
    base = prompts[-1]  # 70 tokens: 4 full blocks, and the 5th partly
    tokens, first, sched = serve_all(engine, greedy_requests([base]))
    assert first["r0"].cached_tokens == 0 and tokens["r0"] == reference[-1]
    # The prefix cache is the scheduler's books: a second request on the same scheduler finds it.
    again: list[int] = []
    records: dict[str, RequestRecord] = {}
    sched.on_finish = lambda rec: records.__setitem__(rec.request_id, rec)
    def keep(e) -> None:
        if e.request_id == "again":
            again.append(e.token_id)

    for rid, prompt, reuse in (("again", base, True), ("opted-out", base, False), ("exact", base[: 4 * BLOCK], True)):
        sched.submit(GenerationRequest(rid, list(prompt), OUT, ignore_eos=True, reuse_prefix=reuse, on_event=keep))
        while sched.step() or sched.in_flight:
            pass
    assert records["again"].cached_tokens == 4 * BLOCK and again == reference[-1]
    assert records["again"].chunk_tokens.sum() == len(base) - 4 * BLOCK
    assert records["opted-out"].cached_tokens == 0
    # A prompt on exactly a block boundary keeps its last block computed (its logits give the first token).
    assert records["exact"].cached_tokens == 3 * BLOCK
    assert sched.kv.held_blocks() == 0


def _buffer_addresses(tree) -> tuple[int, ...]:
    return tuple(shard.data.unsafe_buffer_pointer() for leaf in jax.tree.leaves(tree)
                 for shard in leaf.addressable_shards)


@pytest.mark.parametrize("tp", [1, 2])
def test_serving_after_warm_up_compiles_nothing_and_relaunches_on_the_same_buffers(checkpoint, prompts, reference,
                                                                                   tp, monkeypatch):
    """Steady-state serving runs the programs warm-up compiled (short chunks, both batch widths and
    cached-prefix remainders included), and a step's inputs and outputs keep their device addresses
    from launch to launch, so a command buffer recorded once replays as it is (a new address makes
    XLA update it first)."""
    monkeypatch.setattr(step_policy, "NARROW_CHUNK_MIN_ROWS", 2)  # a 4-slot engine that runs both widths
    engine = tiny_engine(checkpoint, tp=tp, slots=4, max_seq_len=128, step_tokens=4 * BLOCK, block_size=BLOCK)
    assert engine.policy.chunk_widths == [2, 4]
    assert engine.policy.chunk_sizes == [BLOCK, 4 * BLOCK, 8 * BLOCK]
    engine.warmup()
    compiled = engine.compiled_count()
    small_programs = (engine._write_io_fn._cache_size(), engine._read_out_fn._cache_size())
    seen: set[tuple[int, ...]] = set()
    shapes = []
    program = engine._program

    def recording_program(kind, shape):
        fn = program(kind, shape)
        shapes.append(shape)

        def launch(params, state, io):
            seen.add(_buffer_addresses((params, state, io)))
            out = fn(params, state, io)
            seen.add(_buffer_addresses((params, *out)))
            return out

        return launch

    monkeypatch.setattr(engine, "_program", recording_program)
    for _ in range(2):  # the second time from the prefix cache: each remainder is a short chunk
        tokens, _, _ = serve_all(engine, greedy_requests(prompts))
        assert [tokens[f"r{i}"] for i in range(len(prompts))] == reference
    assert {s.width for s in shapes if s.with_chunk} == {2, 4}
    assert {s.chunk_tokens for s in shapes} >= {BLOCK, 4 * BLOCK}
    assert engine.compiled_count() == compiled, "steady-state serving compiled a new step"
    assert (engine._write_io_fn._cache_size(), engine._read_out_fn._cache_size()) == small_programs, \
        "steady-state serving compiled a new staging or read-out program"
    assert len(seen) == 1, f"step programs saw {len(seen)} different sets of buffers"


def test_surge_chunks_keep_greedy_tokens(checkpoint, prompts, reference, monkeypatch):
    # Every step with a chunk surges (a backlog of more than 0 budgets), beside decoding sequences.
    monkeypatch.setattr(step_policy, "SURGE_BACKLOG_BUDGETS", 0)
    engine = tiny_engine(checkpoint, slots=4, max_seq_len=128, step_tokens=BLOCK, block_size=BLOCK)
    tokens, records, _ = serve_all(engine, greedy_requests(prompts))
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == reference
    assert max(max(rec.chunk_tokens) for rec in records.values()) == 2 * BLOCK


def test_idle_steps_carry_larger_chunks_and_keep_greedy_tokens(checkpoint, prompts, reference):
    engine = tiny_engine(checkpoint, slots=4, max_seq_len=128, step_tokens=BLOCK, block_size=BLOCK,
                         idle_step_tokens=2 * BLOCK)
    tokens, records, _ = serve_all(engine, greedy_requests(prompts[::-1]))  # longest first: nothing decodes yet
    for i, expected in enumerate(reference[::-1]):
        assert tokens[f"r{i}"] == expected
    assert list(records["r0"].chunk_tokens[:2]) == [2 * BLOCK, 2 * BLOCK]


def test_the_logits_program_changes_nothing(checkpoint, prompts, reference):
    """Asking for a step's logits, then launching it, gives the tokens of launching it alone."""
    from helpers.engine_fixtures import greedy_and_logits

    engine = tiny_engine(checkpoint, slots=2, max_seq_len=128, step_tokens=BLOCK, block_size=BLOCK)
    tokens, logits = greedy_and_logits(engine, prompts[5], OUT)
    assert tokens == reference[5]
    assert [int(np.argmax(row)) for row in logits] == tokens
