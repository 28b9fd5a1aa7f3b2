"""freeze_warm_heap: what is alive after warm-up goes to the permanent generation; garbage is freed first."""

from __future__ import annotations

import gc
import weakref

from switchyard.service.engine.heap import freeze_warm_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_the_live_heap_is_frozen_and_garbage_is_collected_first():
    kept = [Node() for _ in range(100)]
    garbage = Node()
    gone = weakref.ref(garbage)
    del garbage
    try:
        frozen, collect_ms = freeze_warm_heap()
        assert gone() is None  # collected before the freeze, not kept forever
        # Frozen objects are in no generation a collection scans. (The freeze count itself may drop
        # between two reads: a frozen object another thread releases is freed all the same.)
        kept_ids = {id(node) for node in kept}
        assert not any(id(o) in kept_ids for o in gc.get_objects())
        assert frozen >= len(kept) and collect_ms >= 0
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
