"""Builders for :class:`~switchyard.service.api.engine_process.EngineProcess` in tests: each runs in
the spawned engine process, so each is a module-level function of a module that process can import."""

from __future__ import annotations

import os
import time
from typing import Any

from switchyard.service.engine.compile_cache import WarmUp
from switchyard.service.modelspec import ModelSpecError


def tiny_from_checkpoint(options: Any) -> tuple[Any, WarmUp]:
    """serve's own builder, without the warm-up (steps compile on first use)."""
    from switchyard.cli.serve import build_engine

    return build_engine(options)


def refuses_the_layout(options: Any) -> tuple[Any, WarmUp]:
    raise ModelSpecError("layout.kv_tokens 99 needs 1.00 GiB of KV cache per GPU, but only 0.50 GiB is free")


def breaks(options: Any) -> tuple[Any, WarmUp]:
    raise RuntimeError("the checkpoint's shards disagree")


def exits_while_loading(options: Any) -> tuple[Any, WarmUp]:
    os._exit(3)


def loads_forever(options: Any) -> tuple[Any, WarmUp]:
    while True:
        time.sleep(1)


def reports_progress(flag: str) -> tuple[Any, WarmUp]:
    """Says it is compiling 1 of 3, waits for the file ``flag`` to appear, then refuses the layout."""
    from switchyard.service.api.engine_process import report_startup

    report_startup("compiling step programs", 1, 3)
    while not os.path.exists(flag):
        time.sleep(0.05)
    raise ModelSpecError("refused after reporting progress")
