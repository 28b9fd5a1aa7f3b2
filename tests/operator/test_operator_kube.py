"""Kube.update_status, the one read-build-write loop of the status writers: a conflict (409) means
read again and rebuild, never overwrite; any other error, or the last conflict, goes to the caller."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from switchyard.operator.kube import CONFLICT_ATTEMPTS, ApiError, Kube


@dataclasses.dataclass
class ScriptedKube(Kube):
    """A Kube whose reads return ``reads`` in turn and whose status patches fail with ``errors`` in turn."""

    reads: list[dict[str, Any] | None] = dataclasses.field(default_factory=list)
    errors: list[int | None] = dataclasses.field(default_factory=list)
    patches: list[tuple[dict[str, Any], str | None]] = dataclasses.field(default_factory=list)

    def get(self, kind: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        return self.reads.pop(0)

    def patch_status(self, kind: str, namespace: str | None, name: str, status: Any,
                     resource_version: str | None = None) -> dict[str, Any]:
        self.patches.append((dict(status), resource_version))
        error = self.errors.pop(0) if self.errors else None
        if error is not None:
            raise ApiError(error, "scripted")
        return {}


def obj(version: str, replicas: int = 1) -> dict[str, Any]:
    return {"metadata": {"resourceVersion": version}, "status": {"replicas": replicas}}


def test_a_conflict_rereads_and_rebuilds_from_the_new_read():
    kube = ScriptedKube(api=None, reads=[obj("1"), obj("2", replicas=3)], errors=[409])
    built = []

    def build(live: dict[str, Any]) -> dict[str, Any]:
        built.append(live["metadata"]["resourceVersion"])
        return {"replicas": live["status"]["replicas"] + 1}

    live, status = kube.update_status("DecodeService", "default", "llama", build)
    assert built == ["1", "2"] and live == obj("2", replicas=3) and status == {"replicas": 4}
    assert kube.patches == [({"replicas": 2}, "1"), ({"replicas": 4}, "2")]


def test_conflicts_on_every_round_raise_the_last_one():
    kube = ScriptedKube(api=None, reads=[obj(str(i)) for i in range(CONFLICT_ATTEMPTS)],
                        errors=[409] * CONFLICT_ATTEMPTS)
    with pytest.raises(ApiError) as err:
        kube.update_status("DecodeService", "default", "llama", lambda live: {"replicas": 1})
    assert err.value.status == 409 and len(kube.patches) == CONFLICT_ATTEMPTS == 5
    kube = ScriptedKube(api=None, reads=[obj("1"), obj("2")], errors=[409, 409])
    with pytest.raises(ApiError):
        kube.update_status("DecodeService", "default", "llama", lambda live: {"replicas": 1}, attempts=2)
    assert len(kube.patches) == 2


def test_other_errors_are_not_retried():
    kube = ScriptedKube(api=None, reads=[obj("1"), obj("2")], errors=[422])
    with pytest.raises(ApiError) as err:
        kube.update_status("DecodeService", "default", "llama", lambda live: {"replicas": 1})
    assert err.value.status == 422 and len(kube.patches) == 1


def test_nothing_is_written_for_a_deleted_object_or_an_empty_build():
    kube = ScriptedKube(api=None, reads=[None])
    assert kube.update_status("DecodeService", "default", "llama", lambda live: {"replicas": 1}) is None
    kube = ScriptedKube(api=None, reads=[obj("1")])
    assert kube.update_status("DecodeService", "default", "llama", lambda live: None) is None
    assert kube.patches == []
    # A build that returns None after a conflict stops there too.
    kube = ScriptedKube(api=None, reads=[obj("1"), obj("2", replicas=0)], errors=[409])
    assert kube.update_status("DecodeService", "default", "llama",
                              lambda live: {"replicas": 1} if live["status"]["replicas"] else None) is None
    assert len(kube.patches) == 1
