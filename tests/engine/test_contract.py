"""The engine contract: every engine class implements each of its members, and instances satisfy it."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from helpers.engine_fixtures import tiny_checkpoint
from switchyard.service.engine.contract import DecodeEngine, EngineBase, TokenBudgetEngine
from switchyard.service.engine.paged import PagedEngine
from switchyard.service.engine.pipeline import PipelineEngine
from switchyard.service.engine.pipeline_group import LeaderEngine
from switchyard.service.engine.scheduler import Scheduler
from switchyard.service.engine.tensor_parallel import Engine, SlotBook
from switchyard.service.modelspec import ServingLayout

ENGINES = [Engine, PipelineEngine, LeaderEngine]
BASE_METHODS = {"validate_prompt", "free_slots", "slot_generation", "collect", "evict", "warmup", "compiled_count"}


def contract_members(kind: type, protocol: type = DecodeEngine) -> set[str]:
    """Names of a protocol's members (its own and its base protocols') that are ``kind`` (functions, or
    properties)."""
    return {name for klass in protocol.__mro__ if klass in (EngineBase, DecodeEngine, TokenBudgetEngine)
            for name, member in vars(klass).items() if not name.startswith("_") and isinstance(member, kind)}


def test_the_contract_has_the_calls_of_the_scheduler_and_the_warm_up():
    function = type(contract_members)
    properties = {"spec", "max_slots", "max_seq_len", "kv_tokens", "kv_block_size", "step_tokens"}
    assert contract_members(property) == contract_members(property, TokenBudgetEngine) == properties
    assert contract_members(function, EngineBase) == BASE_METHODS
    assert contract_members(function) == BASE_METHODS | {"room", "prefill", "insert", "dispatch", "generate"}
    assert contract_members(function, TokenBudgetEngine) == BASE_METHODS | {
        "check_fits", "free_blocks", "held_blocks", "blocks_to_begin", "begin", "prefilling", "decoding", "next_chunk",
        "ensure_decode_blocks", "dispatch"}
    assert inspect.signature(Scheduler).parameters["engine"].annotation == "DecodeEngine | TokenBudgetEngine"


@pytest.mark.parametrize(("cls", "protocol"), [*((c, DecodeEngine) for c in ENGINES), (PagedEngine, TokenBudgetEngine)],
                         ids=lambda c: c.__name__)
def test_each_engine_class_defines_every_method_of_the_contract(cls, protocol):
    for name in contract_members(type(contract_members), protocol):
        assert callable(getattr(cls, name, None)), f"{cls.__name__} lacks {name}()"
        want = list(inspect.signature(getattr(protocol, name)).parameters)
        got = list(inspect.signature(getattr(cls, name)).parameters)
        assert got == want, f"{cls.__name__}.{name}{got} differs from the contract's {want}"


def test_the_leader_delegates_explicitly():
    assert "__getattr__" not in vars(LeaderEngine)
    for name in contract_members(property):
        assert isinstance(vars(LeaderEngine).get(name), property), f"LeaderEngine.{name} is not a property"


def test_the_slot_book_uses_only_its_own_state():
    """No method of SlotBook reads an attribute that SlotBook's constructor does not set."""
    import ast
    import textwrap

    source = textwrap.dedent(inspect.getsource(SlotBook))
    tree = ast.parse(source)
    init = next(n for n in tree.body[0].body if getattr(n, "name", "") == "__init__")
    targets = [t for node in ast.walk(init) if isinstance(node, ast.Assign) for t in node.targets]
    targets += [node.target for node in ast.walk(init) if isinstance(node, ast.AnnAssign)]
    own = {t.attr for t in targets if isinstance(t, ast.Attribute)}
    methods = {n.name for n in tree.body[0].body if isinstance(n, ast.FunctionDef)}
    used = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"}
    assert used <= own | methods, f"SlotBook uses {sorted(used - own - methods)}"


def test_instances_satisfy_the_contract(tmp_path):
    class Channel:
        def send(self, op: int, *fields: int, tokens=None) -> None:
            pass

    folder = tiny_checkpoint(tmp_path)
    engine = Engine.from_checkpoint(folder, ServingLayout(tp=1, batch_slots=2, max_seq_len=32), progress=False)
    pipeline = PipelineEngine.from_checkpoint(folder, ServingLayout(tp=1, pp=2, batch_slots=2, max_seq_len=32),
                                              progress=False)
    leader = LeaderEngine(pipeline, Channel())
    for instance in (engine, pipeline, leader):
        assert isinstance(instance, DecodeEngine), type(instance).__name__
    assert (leader.spec, leader.max_slots, leader.max_seq_len) == (pipeline.spec, 2, 32)
    assert leader.free_slots() == [0, 1] and leader.room(1) == 32 and leader.compiled_count() == 0
    pipeline.generation[1] = 3
    assert leader.slot_generation(1) == 3 and isinstance(leader.slot_generation(1), int)
    pipeline.active[0] = True
    leader.evict(0)
    assert not np.any(pipeline.active)
    assert not isinstance(object(), DecodeEngine)
