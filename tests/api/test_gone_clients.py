"""A client that is gone is never answered, and never logged as an error: the server ends a request
a moment before its call's deadline, does not answer a call gRPC has already ended, and drops gRPC's
traceback for a write that raced the end of a call."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from switchyard.service.api import server
from switchyard.service.api.wire import GenerationEnded


class EndedCall:
    def __init__(self) -> None:
        self.aborted = False

    def done(self) -> bool:
        return True

    async def abort(self, code, details) -> None:
        self.aborted = True


def test_a_call_that_grpc_has_ended_is_not_answered(caplog):
    app = server.DecodeApp(model_name="tiny")
    context = EndedCall()
    with caplog.at_level(logging.DEBUG), pytest.raises(asyncio.CancelledError):
        asyncio.run(app.abort_for(GenerationEnded(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed"), context))
    assert not context.aborted and "request failed" not in caplog.text


def test_a_request_ends_before_its_calls_deadline():
    assert server.request_timeout(None) is None
    assert server.request_timeout(2.0) == pytest.approx(2.0 - server.DEADLINE_MARGIN_S)
    assert server.request_timeout(0.01) == 0.0


def test_grpcs_traceback_for_a_write_to_an_ended_call_is_dropped(caplog):
    async def build() -> None:
        server.build_server(server.DecodeApp(model_name="tiny"))  # installs the filter

    asyncio.run(build())
    grpc_log = logging.getLogger("grpc._cython.cygrpc")
    with caplog.at_level(logging.INFO):
        grpc_log.error("ExecuteBatchError raised in core by servicer method [/switchyard.v1.Decode/Generate]")
        grpc_log.error("Unexpected [ValueError] raised by servicer method")
    assert "ExecuteBatchError" not in caplog.text and "Unexpected [ValueError]" in caplog.text
