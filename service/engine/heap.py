"""The Python heap of a serving process once it is ready to serve."""

from __future__ import annotations

import gc
import time


def freeze_warm_heap() -> tuple[int, float]:
    """Collect garbage once, then move every object alive now (in the engine's process the traced
    and compiled programs, the jit caches, the weights' handles; in the server's the libraries it
    imported and the tokenizer) to the collector's permanent generation, where no later collection
    scans them. Serving allocates all the time, so full collections come regularly, and each one
    scanning that heap holds the thread that steps the engine or delivers the tokens, and with it
    every stream. Returns the objects frozen and the milliseconds of the collection before."""
    t0 = time.perf_counter()
    gc.collect()
    collect_ms = 1e3 * (time.perf_counter() - t0)
    gc.freeze()
    return gc.get_freeze_count(), collect_ms
