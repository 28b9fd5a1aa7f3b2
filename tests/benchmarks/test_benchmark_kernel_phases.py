"""benchmarks/kernel_phases.py's summary of the phase timers (pure logic; the timers need a GPU)."""

from __future__ import annotations

from helpers import scripts
from switchyard.kernels import native


def test_summary_means_per_block_launch_and_spread_of_the_last_launch():
    kp = scripts.load("kernel_phases")
    slots, blocks = native.PHASE_SLOTS, native.PHASE_BLOCKS
    cycles, ns = [0] * slots, [0] * slots
    cycles[0] = 4  # block launches
    cycles[1], ns[1] = 4 * 1800, 4 * 900  # push ends 900 ns after a block starts, on average
    cycles[2], ns[2] = 4 * 4000, 4 * 2000
    last = [[0] * slots for _ in range(blocks)]
    last[0][:4] = [1_000, 1_900, 3_000, 3_200]  # block 0 of the last launch: start, push, reduce, finish
    last[1][:4] = [1_064, 1_950, 3_100, 3_400]
    got = kp.summarise("oneshot", native.PhaseCounters(4, cycles, ns, last))
    assert got["block_launches"] == 4
    assert got["phases"] == {"push": {"ns": 900.0, "cycles": 1800.0}, "reduce": {"ns": 2000.0, "cycles": 4000.0}}
    assert got["last_launch"] == {"blocks": 2, "start_spread_ns": 64, "end_of_last_block_ns": 2_400,
                                  "median_block_ns": 2_268.0}


def test_a_library_without_timers_gives_only_chain_times():
    assert scripts.load("kernel_phases").summarise("fused", None) == {}


def test_paged_attention_phases_are_named_by_slot_and_unmarked_slots_skipped():
    kp = scripts.load("kernel_phases")
    slots, blocks = native.PHASE_SLOTS, native.PHASE_BLOCKS
    cycles, ns = [0] * slots, [0] * slots
    cycles[0] = 2
    cycles[1], ns[1] = 2 * 400, 2 * 200  # the first copies issued
    cycles[3], ns[3] = 2 * 5000, 2 * 2500  # the stages (slot 2, the rest of the prologue, left unmarked)
    cycles[4], ns[4] = 2 * 5400, 2 * 2700
    got = kp.summarise("paged_attention", native.PhaseCounters(2, cycles, ns, [[0] * slots for _ in range(blocks)]))
    assert list(got["phases"]) == ["copies_issued", "stages", "warp_merge"]
    assert got["phases"]["stages"] == {"ns": 2500.0, "cycles": 5000.0}
    cycles[2], ns[2] = 2 * 600, 2 * 300
    got = kp.summarise("paged_attention", native.PhaseCounters(2, cycles, ns, [[0] * slots for _ in range(blocks)]))
    assert list(got["phases"])[:3] == ["copies_issued", "prologue", "stages"]
    assert got["phases"]["prologue"] == {"ns": 300.0, "cycles": 600.0}
    assert kp.pairs("1:1024,8:4096") == [(1, 1024), (8, 4096)] and kp.pairs("") == []


def test_paged_attention_blocks_grouped_by_slice_of_the_last_launch():
    kp = scripts.load("kernel_phases")
    slots, blocks = native.PHASE_SLOTS, native.PHASE_BLOCKS
    last = [[0] * slots for _ in range(blocks)]
    # 2 blocks a slice (rows x KV heads), 2 slices: slice 0's blocks reach the barrier later.
    last[0][:6] = [1_000, 1_100, 1_300, 2_000, 2_200, 2_900]
    last[1][:6] = [1_010, 1_110, 1_330, 2_050, 2_250, 2_910]
    last[2][:6] = [1_005, 1_100, 1_200, 1_700, 1_800, 2_905]
    last[3][:4] = [1_020, 1_120, 1_220, 1_720]  # this block's later phases not reached (0)
    got = kp.by_slice("paged_attention", native.PhaseCounters(2, [0] * slots, [0] * slots, last), 2)
    assert got["0"] == {"copies_issued": 100.0, "prologue": 310.0, "stages": 1_020.0, "warp_merge": 1_220.0,
                        "cluster_sync": 1_900.0}
    # A phase's mean is over the blocks that reached it.
    assert got["1"] == {"copies_issued": 97.5, "prologue": 197.5, "stages": 697.5, "warp_merge": 795.0,
                        "cluster_sync": 1_900.0}
    assert kp.by_slice("paged_attention", None, 2) == {}
