"""benchmarks/drive.py: seated sequences sit at the asked context with the model's own K/V, and the
decode loop times one step per sequence per iteration through the public step contract."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import scripts
from helpers.engine_fixtures import greedy_and_logits, tiny_checkpoint, tiny_engine
from switchyard.service.engine.step_policy import StepPolicy

drive = scripts.load("drive")


def test_seat_lengths_leave_room_for_the_steps_of_the_prompts_after_each():
    policy = StepPolicy(max_slots=4, max_seq_len=128, block_size=16, step_tokens=16, idle_step_tokens=64)
    # the second prompt beside the first decoding: 100 tokens in 16-token chunks, 7 steps; the first
    # alone: its 93 tokens as a 64-token idle chunk, then 16 and 13
    assert drive.chunk_count(policy, 100, decoding=True) == 7
    assert drive.chunk_count(policy, 93, decoding=False) == 3
    assert drive.seat_lengths(policy, 2, 100) == [93, 100]
    assert drive.seat_lengths(policy, 1, 5) == [5]
    with pytest.raises(ValueError, match="cannot seat 3 sequences at context 2"):
        drive.seat_lengths(policy, 3, 2)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return tiny_engine(tiny_checkpoint(tmp_path_factory.mktemp("tiny")), slots=4, max_seq_len=128)


def test_seated_sequences_decode_at_the_context_over_their_prompts_kv(engine):
    kv = drive.books(engine)
    steps_before = engine.step_count
    prompts = drive.seat(engine, kv, 3, 40, seed=5)
    assert [len(p) for p in prompts] == [34, 37, 40]  # three 16-token-chunk steps each
    assert engine.step_count - steps_before == 9
    assert kv.decoding().tolist() == [0, 1, 2] and not kv.prefilling()
    assert {kv.sequence(s).position for s in range(3)} == {40}
    # The next step's logits for the last seated sequence are those of its prompt run alone: its KV
    # holds the prompt's values, computed by the model.
    assert kv.ensure_decode_blocks()
    seated = engine.logits(engine.policy.plan(kv, []))[2]
    _, alone = greedy_and_logits(engine, prompts[2], 2)  # its own books: after the seated step's logits
    np.testing.assert_allclose(seated, alone[1], rtol=1e-4, atol=1e-4 * np.abs(alone[1]).max())
    with pytest.raises(ValueError, match="empty books"):
        drive.seat(engine, kv, 1, 10)


def test_the_decode_loop_times_each_step_and_counts_its_tokens(engine):
    kv = drive.books(engine)
    drive.seat(engine, kv, 3, 20)
    timed = drive.time_decode(engine, kv, steps=4, warmup=2)
    assert len(timed.times) == 4 and all(t > 0 for t in timed.times)
    # each timed step's launch call, a part of its step
    launches = zip(timed.launch_ms, timed.times, strict=True)
    assert len(timed.launch_ms) == 4 and all(0 < ms < 1e3 * t for ms, t in launches)
    assert timed.tokens == 3 * 4
    # 1 step launched ahead, 2 warm-up and 4 timed: every sequence 7 positions on
    assert {kv.sequence(s).position for s in range(3)} == {27}
    assert len(drive.time_synchronous(engine, kv, steps=2, warmup=1)) == 2
    assert {kv.sequence(s).position for s in range(3)} == {30}
