"""Request identity (service/api/requests.py): an id stays taken from submission until the engine
says the request is gone, however its caller leaves; events never change hands."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from switchyard.service.api.requests import RequestTable
from switchyard.service.errors import DuplicateRequestError


def event(request_id: str, index: int, finish: str | None = None):
    return SimpleNamespace(request_id=request_id, index=index, finish_reason=finish)


def test_an_id_is_taken_until_its_final_event():
    table, seen = RequestTable(), []
    table.take("a", seen.append)
    with pytest.raises(DuplicateRequestError, match="'a' is already in flight"):
        table.take("a", seen.append)
    table.event(event("a", 0))
    table.event(event("a", 1, "length"))
    assert [e.index for e in seen] == [0, 1] and "a" not in table
    table.take("a", seen.append)  # free again


def test_a_caller_that_leaves_keeps_the_id_taken_and_gets_nothing_more():
    table, first, second = RequestTable(), [], []
    table.take("x", first.append)
    table.event(event("x", 0))
    assert table.leave("x")  # the engine still holds it: the caller cancels it there
    table.event(event("x", 1))  # the engine's step was already under way
    with pytest.raises(DuplicateRequestError):
        table.take("x", second.append)
    table.event(event("x", 2, "cancelled"))  # the engine confirms: the id is free
    table.take("x", second.append)
    table.event(event("x", 0))
    assert [e.index for e in first] == [0] and [e.index for e in second] == [0]
    assert table.attached_ids() == ["x"]


def test_a_refusal_frees_the_id_and_a_lost_engine_fails_every_caller_still_there():
    table, got = RequestTable(), {}
    for rid in ("a", "b", "c"):
        table.take(rid, lambda e, rid=rid: got.setdefault(rid, []).append(e))
    table.rejected("a")
    assert table.leave("b") and not table.leave("a")
    assert table.fail_all(lambda rid: event(rid, 0, "error")) == 2
    assert list(got) == ["c"] and got["c"][0].finish_reason == "error" and len(table) == 0


def test_a_failing_sink_does_not_stop_the_deliveries(caplog):
    table, seen = RequestTable(), []

    def broken(_):
        raise RuntimeError("sink broke")

    table.take("bad", broken)
    table.take("good", seen.append)
    table.event(event("bad", 0, "stop"))
    table.event(event("good", 0, "stop"))
    assert len(seen) == 1 and len(table) == 0 and "sink broke" in caplog.text
