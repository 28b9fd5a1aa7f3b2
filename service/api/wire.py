"""Between wire messages and engine requests: conversion, the server's own checks, error -> gRPC status.

The rules on prompts, stops, sampling and lengths live once, in the scheduler and the engine (their
errors carry the messages clients see); here are only what the wire adds: request size, defaults,
printable request ids. Pure functions; the servicers in ``server.py`` and ``kserve.py`` call them.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import grpc
from switchyard.service.api.text import check_stop_strings
from switchyard.service.errors import DuplicateRequestError, InvalidRequestError, OutOfRangeError, QueueFullError


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-request limits the server applies before the scheduler sees a request."""

    default_max_tokens: int = 256
    # Larger requests get INVALID_ARGUMENT from us before they are parsed (parsing.py); gRPC's own
    # transport limit (a few times larger, see server.py) answers RESOURCE_EXHAUSTED before they are
    # even received whole.
    max_request_bytes: int = 1 << 20


class Unavailable(Exception):
    """The server cannot take requests now (loading, draining)."""


def status_for(err: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status for an error raised while taking a request."""
    if isinstance(err, OutOfRangeError):
        return grpc.StatusCode.OUT_OF_RANGE, str(err)
    if isinstance(err, DuplicateRequestError):
        return grpc.StatusCode.ALREADY_EXISTS, str(err)
    if isinstance(err, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(err)
    if isinstance(err, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(err) or "the request queue is full; retry later"
    if isinstance(err, Unavailable):
        return grpc.StatusCode.UNAVAILABLE, str(err)
    if isinstance(err, GenerationEnded):
        return err.code, str(err)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(err).__name__}: {err}"


def new_request_id() -> str:
    return uuid.uuid4().hex


def check_request_id(request_id: str) -> str:
    """A new id when empty; otherwise printable (it goes into logs, traces and metadata)."""
    if not request_id:
        return new_request_id()
    if not request_id.isprintable():
        raise InvalidRequestError("request_id must be printable characters")
    return request_id


def check_max_tokens(max_tokens: int, limits: Limits, room: int | None = None) -> int:
    """``room``: context left after the prompt; the default never asks for more than that."""
    if max_tokens == 0:
        return max(1, min(limits.default_max_tokens, room)) if room is not None else limits.default_max_tokens
    if max_tokens < 0:
        raise InvalidRequestError(f"max_tokens must be positive (0 = the server default), got {max_tokens}")
    return max_tokens  # the scheduler checks it against the context (OUT_OF_RANGE)


EMPTY_PROMPT = "prompt is empty: give text or at least one token id"


def sampling_from(temperature: float | None, top_k: int | None, top_p: float | None, seed: int | None) -> Any:
    """SamplingParams with defaults for unset values, validated (InvalidRequestError says which)."""
    from switchyard.service.engine.sampling import SamplingParams

    params = SamplingParams(
        temperature=0.0 if temperature is None else float(temperature),
        top_k=0 if top_k is None else int(top_k),
        top_p=1.0 if top_p is None else float(top_p),
        seed=0 if seed is None else int(seed),
    )
    params.validate()
    return params


@dataclasses.dataclass
class RequestSpec:
    """What a wire request asks for, checked, before it becomes a scheduler GenerationRequest (the
    stop strings stay with the server, which owns the text)."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: Any
    stop_token_ids: tuple[int, ...]
    stop_strings: tuple[str, ...]
    reuse_prefix: bool = True  # may reuse the cached KV of a prompt prefix
    ignore_eos: bool = False  # the model's end-of-sequence ids do not stop it
    min_tokens: int = 0  # no stop ends it before this many tokens

    def to_generation_request(self, *, deadline: float | None, on_event: Any) -> Any:
        from switchyard.service.engine.request import GenerationRequest

        return GenerationRequest(
            request_id=self.request_id,
            prompt_ids=self.prompt_ids,
            max_tokens=self.max_tokens,
            sampling=self.sampling,
            stop_token_ids=self.stop_token_ids,
            deadline=deadline,
            on_event=on_event,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            reuse_prefix=self.reuse_prefix,
        )


def from_generate_request(
    msg: Any, tokenizer: Any, limits: Limits, max_seq_len: int | None = None
) -> RequestSpec:
    """A ``switchyard.v1.GenerateRequest`` -> RequestSpec (raises InvalidRequestError); its size was
    checked on the wire."""
    request_id = check_request_id(msg.request_id)
    which = msg.WhichOneof("prompt")
    if which == "text" and msg.text:
        prompt_ids = tokenizer.encode(msg.text)
    elif which == "token_ids":
        prompt_ids = list(msg.token_ids.ids)  # the engine checks them against the vocabulary
    else:
        raise InvalidRequestError(EMPTY_PROMPT)
    s = msg.sampling
    sampling = sampling_from(
        s.temperature if s.HasField("temperature") else None,
        s.top_k if s.HasField("top_k") else None,
        s.top_p if s.HasField("top_p") else None,
        s.seed if s.HasField("seed") else None,
    )
    stop_ids = tuple(msg.stop_token_ids)  # the scheduler adds the model's end-of-sequence ids
    return RequestSpec(
        request_id=request_id,
        prompt_ids=prompt_ids,
        max_tokens=check_max_tokens(
            msg.max_tokens, limits, None if max_seq_len is None else max_seq_len - len(prompt_ids)
        ),
        sampling=sampling,
        stop_token_ids=stop_ids,
        stop_strings=check_stop_strings(msg.stop_strings),
        reuse_prefix=not msg.no_prefix_cache,
        ignore_eos=msg.ignore_eos,
        min_tokens=msg.min_tokens,  # the scheduler checks it against max_tokens
    )


class GenerationEnded(Exception):
    """A generation that ended without finishing: deadline, engine error, cancellation."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def check_final_event(event: Any, request_id: str) -> None:
    """Raise GenerationEnded for a final event that is not a normal finish (stop / length)."""
    reason = event.finish_reason
    if reason in (None, "stop", "length"):
        return
    if reason == "deadline":
        raise GenerationEnded(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"request {request_id}: deadline passed after {event.index} tokens",
        )
    if reason == "cancelled":
        raise GenerationEnded(grpc.StatusCode.CANCELLED, f"request {request_id} was cancelled")
    raise GenerationEnded(
        grpc.StatusCode.INTERNAL,
        f"request {request_id}: the engine failed while generating (see the server log)",
    )
