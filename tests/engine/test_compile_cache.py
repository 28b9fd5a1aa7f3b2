"""The compile cache: a second engine of the same layout loads every step program and serves the same
greedy tokens; any change to what a program is built from is another program; a damaged entry is
compiled again."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
from helpers.engine_fixtures import generate, tiny_engine
from switchyard.service.engine.compile_cache import (
    ProgramStore,
    program_key,
    source_digest,
    stable_repr,
    trim,
)
from switchyard.service.engine.engine import EngineConfig

pytestmark = pytest.mark.timeout(600)

SMALL = {"slots": 2, "max_seq_len": 64, "step_tokens": 32, "block_size": 16, "idle_step_tokens": 32}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [[int(t) for t in rng.integers(3, 512, n)] for n in (5, 40)]


def test_a_key_follows_every_fact_and_not_their_order() -> None:
    facts = {"shape": {"width": 2, "chunk_tokens": 0}, "jax": "0.11.2", "devices": [[0, "NVIDIA H100"]]}
    assert program_key(facts) == program_key(dict(reversed(list(facts.items()))))
    for name, other in (("jax", "0.11.3"), ("devices", [[1, "NVIDIA H100"]]), ("shape", {"width": 4})):
        assert program_key({**facts, name: other}) != program_key(facts), name


def test_the_source_digest_follows_the_code(tmp_path: Path) -> None:
    (tmp_path / "service" / "engine").mkdir(parents=True)
    step = tmp_path / "service" / "engine" / "step.py"
    step.write_text("x = 1\n")
    (tmp_path / "notes.md").write_text("not code")
    before = source_digest(tmp_path, ("service/engine",))
    (tmp_path / "notes.md").write_text("changed, still not code")
    assert source_digest(tmp_path, ("service/engine",)) == before
    step.write_text("x = 2\n")
    assert source_digest(tmp_path, ("service/engine",)) != before


def test_trimming_removes_the_oldest_entries_until_the_rest_fit(tmp_path: Path) -> None:
    for age, name in enumerate(("newest", "middle", "oldest")):
        path = tmp_path / name
        path.write_bytes(b"x" * 100)
        os.utime(path, (1000 - age, 1000 - age))
    assert trim(tmp_path, 250) == 100
    assert sorted(p.name for p in tmp_path.iterdir()) == ["middle", "newest"]
    assert trim(tmp_path, 200) == 0
    assert trim(tmp_path, 0) == 200 and not list(tmp_path.iterdir())


def test_a_configuration_reads_the_same_in_every_process() -> None:
    config = EngineConfig(batch_slots=2, max_seq_len=64)
    text = stable_repr({"config": config, "sort": sorted})
    assert " at 0x" not in text and "builtins.sorted" in text
    assert stable_repr(EngineConfig(batch_slots=2, max_seq_len=64)) == stable_repr(config)


def test_a_second_engine_loads_every_step_program_and_serves_the_same_tokens(tiny_checkpoint_dir, tmp_path,
                                                                           prompts, caplog) -> None:
    """Warm start on the first engine's store, one entry of it damaged: that one is compiled (and kept)
    again, every other is loaded, and the tokens are the first engine's."""
    store = ProgramStore(tmp_path / "programs")
    first = tiny_engine(tiny_checkpoint_dir, **SMALL)
    cold = first.warmup(store)
    assert cold.loaded == 0 and cold.programs == len(first.policy.shapes()) > 1
    kept = sorted(p.stem for p in store.folder.glob("*.exe"))
    assert kept == sorted(first.program_keys().values())
    expected = generate(first, prompts, 8)

    damaged = sorted(store.folder.glob("*.exe"))[0]
    damaged.write_bytes(damaged.read_bytes()[:100])
    second = tiny_engine(tiny_checkpoint_dir, **SMALL)
    progress: list[tuple[int, int]] = []
    with caplog.at_level(logging.WARNING):
        warm = second.warmup(store, lambda done, total: progress.append((done, total)))
    assert (warm.loaded, warm.programs) == (cold.programs - 1, cold.programs)
    assert progress == [(i, cold.programs) for i in range(1, cold.programs + 1)]
    assert any(damaged.name in r.getMessage() and "does not load" in r.getMessage() for r in caplog.records)
    assert len(damaged.read_bytes()) > 100, "the damaged entry was not written again"
    assert "loaded from the compile cache" in warm.describe()
    compiled = second.compiled_count()
    assert generate(second, prompts, 8) == expected
    assert second.compiled_count() == compiled, "serving after a warm start compiled a step program"


@pytest.mark.parametrize("change", [{"max_seq_len": 80}, {"step_tokens": 16}, {"dtype": "float32"},
                                    {"quantization": "fp8"}, {"kv_cache_dtype": "fp8"}])
def test_an_engine_built_otherwise_has_other_programs(tiny_checkpoint_dir, change) -> None:
    keys = set(tiny_engine(tiny_checkpoint_dir, **SMALL).program_keys().values())
    assert keys == set(tiny_engine(tiny_checkpoint_dir, **SMALL).program_keys().values())
    assert not keys & set(tiny_engine(tiny_checkpoint_dir, **{**SMALL, **change}).program_keys().values())
