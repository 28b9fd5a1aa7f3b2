"""A pod's start as a client sees it: ModelInfo tells how far start-up is until the model is ready,
and a restart on the same compile cache loads every step program instead of compiling it."""

from __future__ import annotations

import re
import signal

import pytest
from helpers.serve_process import serve_tiny, serving, wait_for
from switchyard.service.api.client import DecodeClient

pytestmark = pytest.mark.timeout(600)

SMALL = ("--step-tokens", "32", "--kv-tokens", "256")
PHASES = {"starting", "loading weights", "compiling step programs", "ready"}


def start_once(tmp_path, cache, name: str) -> tuple[list[str], str]:
    """One start to SERVING and a clean stop: the start-up phases ModelInfo showed, and its compile_cache."""
    with serve_tiny(tmp_path, slots=2, max_seq_len=64, warmup=True, log_name=name,
                    extra=(*SMALL, "--compile-cache", str(cache))) as (proc, target, log):
        client = DecodeClient(target)
        phases: list[str] = []

        def ready() -> bool:
            info = client.model_info(timeout=2)
            if not phases or phases[-1] != info.startup:
                phases.append(info.startup)
            assert info.startup_done <= info.startup_total
            return info.ready and serving(target)

        wait_for(ready, 300, f"SERVING ({log.read_text()[-2000:]})")
        described = client.model_info().compile_cache
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
        return phases, described


def test_model_info_tells_the_start_and_a_restart_loads_every_step_program(tmp_path) -> None:
    cache = tmp_path / "cache"
    phases, cold = start_once(tmp_path, cache, "cold.log")
    assert set(phases) <= PHASES and phases[-1] == "ready" and phases[0] != "ready", phases
    programs = int(re.match(r"(\d+) step programs", cold)[1])
    assert f"0 loaded from the compile cache at {cache.resolve()}" in cold, cold
    _, warm = start_once(tmp_path, cache, "warm.log")
    assert f"{programs} loaded from the compile cache" in warm and ", 0 compiled" in warm, warm
