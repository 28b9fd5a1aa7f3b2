"""One step contract: the engine, the pipeline's stage 0 and the fake engine offer the scheduler the same
calls and sizes, and benchmarks build their engines through the public configuration alone."""

from __future__ import annotations

import ast

import pytest
from helpers import ROOT
from switchyard.service.engine.engine import Engine, EngineConfig
from switchyard.service.engine.fake import FakeEngine
from switchyard.service.engine.pipeline_group import LeaderEngine

CALLS = {"launch", "collect", "warmup", "compiled_count"}
SIZES = {"spec", "config", "policy", "max_slots", "max_seq_len", "kv_tokens", "kv_block_size", "step_tokens"}


@pytest.mark.parametrize("cls", [Engine, FakeEngine, LeaderEngine])
def test_every_engine_offers_the_scheduler_the_same_calls(cls):
    assert all(callable(getattr(cls, name, None)) for name in CALLS), cls


def test_the_fake_and_the_leader_have_every_size_the_scheduler_reads():
    fake = FakeEngine(config=EngineConfig(batch_slots=2, max_seq_len=64))
    assert all(hasattr(fake, name) for name in SIZES)
    leader = LeaderEngine(fake, channel=None)  # the sizes are the wrapped engine's
    assert all(getattr(leader, name) is getattr(fake, name) for name in SIZES)


# A benchmark's own objects (self, cls), the standard library's underscore names (os._exit) and
# PyTorch's compiler settings (torch._dynamo.config), for the PyTorch peer, are not the product's.
OWN_OR_STANDARD = {"self", "cls", "os", "sys", "torch"}


def test_no_benchmark_touches_a_private_attribute_of_a_product_object():
    """Benchmarks build their variants through the engine's public configuration and drive engines
    through the public contract: no ``engine._name``."""
    found = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in OWN_OR_STANDARD:
                continue
            found.append(f"{path.name}:{node.lineno} .{node.attr}")
    assert not found, found
