"""A small synchronous client of ``switchyard.v1.Decode``: what ``switchyard generate``, the tests
and the benchmark use. Records when each streamed message arrived."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc
from switchyard.service.proto import decode_pb2, decode_pb2_grpc

FINISH_NAMES = {
    decode_pb2.FINISH_REASON_UNSPECIFIED: "",
    decode_pb2.FINISH_REASON_STOP: "stop",
    decode_pb2.FINISH_REASON_LENGTH: "length",
}


def make_request(
    prompt: str | Sequence[int],
    *,
    max_tokens: int = 0,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    request_id: str = "",
    no_prefix_cache: bool = False,
    ignore_eos: bool = False,
    min_tokens: int = 0,
) -> Any:
    """``no_prefix_cache``: compute the prompt's KV afresh, reusing no cached prompt prefix;
    ``ignore_eos``, ``min_tokens``: a fixed-length output (benchmarks)."""
    request = decode_pb2.GenerateRequest(
        request_id=request_id,
        max_tokens=max_tokens,
        stop_strings=list(stop),
        stop_token_ids=list(stop_token_ids),
        no_prefix_cache=no_prefix_cache,
        ignore_eos=ignore_eos,
        min_tokens=min_tokens,
    )
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("seed", seed)):
        if value is not None:
            setattr(request.sampling, name, value)
    return request


@dataclasses.dataclass
class StreamResult:
    request_id: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    input_tokens: int = 0
    sent: float = 0.0  # time.perf_counter() when the call started
    arrivals: list[float] = dataclasses.field(default_factory=list)  # per token, perf_counter
    steps: list[int] = dataclasses.field(default_factory=list)
    batch_sizes: list[int] = dataclasses.field(default_factory=list)

    @property
    def gaps_ms(self) -> list[float]:
        """Client-side wait for each token: the first since the call started, then since the previous."""
        out, last = [], self.sent
        for t in self.arrivals:
            out.append((t - last) * 1e3)
            last = t
        return out


class DecodeClient:
    def __init__(self, target: str, *, channel: grpc.Channel | None = None) -> None:
        self.channel = channel or grpc.insecure_channel(target)
        self.stub = decode_pb2_grpc.DecodeStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> DecodeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def wait_ready(self, timeout: float = 60.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout)

    def stream(
        self, request: Any, *, timeout: float | None = None, metadata: Any = None
    ) -> Iterator[tuple[Any, float]]:
        """(message, arrival time) pairs as they come."""
        for message in self.stub.Generate(request, timeout=timeout, metadata=metadata):
            yield message, time.perf_counter()

    def generate(
        self, request: Any, *, timeout: float | None = None, metadata: Any = None,
        on_text: Callable[[str], None] | None = None,
    ) -> StreamResult:
        """Stream a generation to its end; ``on_text`` sees each text delta as it arrives."""
        result = StreamResult(sent=time.perf_counter())
        pieces = []
        for message, at in self.stream(request, timeout=timeout, metadata=metadata):
            result.request_id = message.request_id
            pieces.append(message.text)
            if on_text is not None:
                on_text(message.text)
            if message.token_ids:
                result.token_ids.extend(message.token_ids)
                result.arrivals.append(at)
                result.steps.append(message.step)
                result.batch_sizes.append(message.batch_size)
            if message.finish_reason:
                result.finish_reason = FINISH_NAMES.get(message.finish_reason, str(message.finish_reason))
                result.input_tokens = message.usage.input_tokens
        result.text = "".join(pieces)
        return result

    def model_info(self, timeout: float = 10.0) -> Any:
        return self.stub.ModelInfo(decode_pb2.ModelInfoRequest(), timeout=timeout)

    def traces(self, request_id: str = "", limit: int = 0, timeout: float = 10.0) -> list[Any]:
        from switchyard.service.api.server import trace_from_proto

        reply = self.stub.GetTraces(
            decode_pb2.GetTracesRequest(request_id=request_id, limit=limit), timeout=timeout
        )
        return [trace_from_proto(t) for t in reply.traces]
