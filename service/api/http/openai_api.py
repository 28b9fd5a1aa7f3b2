"""OpenAI's completions and chat completions: a JSON body into RequestSpecs, and the response
objects and stream chunks exactly as OpenAI shapes them. Pure functions (no I/O); ``app.py`` runs
:func:`completion_request` / :func:`chat_request` in the server's text pool (they tokenize).

Fields taken: ``model`` (the served one; absent means it), ``prompt`` (a string, a list of strings,
token ids, or a list of token-id lists: one choice each) or ``messages`` (content a string or a list
of text parts, through the checkpoint's chat template with ``add_generation_prompt``),
``max_completion_tokens`` / ``max_tokens`` (absent: the server's default), ``temperature`` (absent:
1, as OpenAI's), ``top_p``, ``top_k``, ``seed``, ``stop``, ``stop_token_ids``, ``n`` (1 only),
``ignore_eos``, ``min_tokens``, ``stream`` with ``stream_options`` (``include_usage``,
``continuous_usage_stats``), ``chat_template_kwargs``. What this server does not do
(``logprobs``, ``echo``, penalties, ``logit_bias``, tools, ``n`` > 1, JSON output) is refused with a
400 that names it, never silently ignored; fields it does not know are ignored, as OpenAI clients
send their own extras.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from switchyard.service.api.text import check_stop_strings
from switchyard.service.api.wire import RequestSpec, check_request_id, sampling_from
from switchyard.service.errors import InvalidRequestError, quoted

from .errors import HttpError, ModelNotFound

MAX_PROMPTS = 64  # choices one completions request may ask for
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default (the gRPC API's is greedy)
MAX_MESSAGES = 4096
# Values of unsupported fields that mean "not used", as clients send them by default.
_UNSUPPORTED_COMMON = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
}
_UNSUPPORTED_COMPLETION = {"echo": (None, False), "suffix": (None, "")}
_UNSUPPORTED_CHAT = {
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none", "auto"),
    "top_logprobs": (None, 0),
}


@dataclasses.dataclass(frozen=True)
class OpenAIRequest:
    """A checked request: one RequestSpec per choice, and how to answer."""

    kind: str  # "completion" or "chat"
    model: str
    specs: list[RequestSpec]
    stream: bool = False
    include_usage: bool = False  # a final chunk with the usage
    continuous_usage: bool = False  # the usage so far on every chunk


# ---- fields ---------------------------------------------------------------------------------------


def _bad(name: str, expected: str, value: Any) -> InvalidRequestError:
    shown = quoted(value) if isinstance(value, str) else quoted(repr(value))
    return InvalidRequestError(f"{name} must be {expected}, got {shown}")


def _integer(body: dict[str, Any], name: str, *, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    # JSON has one number type: 16.0 is an integer, 16.5 and true are not.
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, "an integer", value)
    if value < low or (high is not None and value > high):
        bound = f"from {low} to {high}" if high is not None else f"at least {low}"
        raise _bad(name, f"an integer {bound}", value)
    return value


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(name, "a number", value)
    return float(value)


def _boolean(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, "true or false", value)
    return value


def _token_ids(value: Any, name: str) -> list[int]:
    if not value:
        raise InvalidRequestError(f"{name} is empty: give text or at least one token id")
    if any(isinstance(t, bool) or not isinstance(t, int) for t in value):
        raise _bad(name, "a list of integer token ids", value[:8])
    return list(value)


def _refuse_unsupported(body: dict[str, Any], table: dict[str, tuple[Any, ...]]) -> None:
    for name, neutral in table.items():
        if name in body and body[name] not in neutral:
            raise HttpError(400, f"{name} is not supported by this server", code="unsupported_parameter", param=name)


def _check_model(body: dict[str, Any], served: str) -> str:
    model = body.get("model")
    if model is None:
        return served
    if not isinstance(model, str):
        raise _bad("model", "a string", model)
    if model != served:
        raise ModelNotFound(model, served)
    return model


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool, bool]:
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False, False
    if not stream:
        raise HttpError(400, "stream_options is only allowed when stream is true", param="stream_options")
    if not isinstance(options, dict):
        raise _bad("stream_options", "an object", options)
    return stream, _boolean(options, "include_usage"), _boolean(options, "continuous_usage_stats")


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise _bad("stop", "a string or a list of strings", stop)
    return check_stop_strings(stop)


def _common(body: dict[str, Any], served: str) -> dict[str, Any]:
    """Checks and values every request kind shares (the RequestSpec fields but the prompt)."""
    _refuse_unsupported(body, _UNSUPPORTED_COMMON)
    n = _integer(body, "n", low=1)
    if n not in (None, 1):
        raise HttpError(400, f"n must be 1 (one choice per prompt) on this server, got {n}", param="n",
                        code="unsupported_parameter")
    if body.get("response_format") not in (None, {"type": "text"}):
        raise HttpError(400, "response_format other than text is not supported by this server",
                        param="response_format", code="unsupported_parameter")
    max_tokens = _integer(body, "max_completion_tokens", low=1)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", low=1)
    top_k = _integer(body, "top_k", low=-1)
    temperature = _number(body, "temperature")
    sampling = sampling_from(
        DEFAULT_TEMPERATURE if temperature is None else temperature,
        None if top_k in (None, -1) else top_k,  # -1: off, as vLLM spells it
        _number(body, "top_p"),
        _integer(body, "seed", low=0, high=2**64 - 1),
    )
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in stop_ids):
        raise _bad("stop_token_ids", "a list of integer token ids", stop_ids)
    return {
        "model": _check_model(body, served),
        "max_tokens": max_tokens,
        "sampling": sampling,
        "stop_token_ids": tuple(stop_ids),
        "stop_strings": _stops(body),
        "ignore_eos": _boolean(body, "ignore_eos"),
        "min_tokens": _integer(body, "min_tokens", low=0) or 0,
    }


def _spec(request_id: str, prompt_ids: list[int], common: dict[str, Any], limits: Any,
          max_seq_len: int | None) -> RequestSpec:
    max_tokens = common["max_tokens"]
    if max_tokens is None:  # the server's default, never more than the context leaves
        room = None if max_seq_len is None else max_seq_len - len(prompt_ids)
        max_tokens = limits.default_max_tokens if room is None else max(1, min(limits.default_max_tokens, room))
    return RequestSpec(
        request_id=request_id,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,  # the scheduler checks it against the context (400, context_length_exceeded)
        sampling=common["sampling"],
        stop_token_ids=common["stop_token_ids"],
        stop_strings=common["stop_strings"],
        ignore_eos=common["ignore_eos"],
        min_tokens=common["min_tokens"],
    )


# ---- requests -------------------------------------------------------------------------------------


def _prompts(value: Any) -> list[str | list[int]]:
    """``prompt`` as a list of prompts: each a string or a list of token ids."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise _bad("prompt", "a string, a list of strings, or token ids", value)
    if all(isinstance(p, str) for p in value):
        prompts: list[str | list[int]] = list(value)
    elif all(isinstance(p, list) for p in value):
        prompts = [_token_ids(p, "prompt") for p in value]
    else:
        prompts = [_token_ids(value, "prompt")]
    if len(prompts) > MAX_PROMPTS:
        raise InvalidRequestError(f"prompt holds {len(prompts)} prompts; at most {MAX_PROMPTS}")
    return prompts


def completion_request(body: dict[str, Any], encoder: Any, limits: Any, served: str, request_id: str,
                       max_seq_len: int | None) -> OpenAIRequest:
    """A ``/v1/completions`` body -> OpenAIRequest (HttpError / InvalidRequestError say what is wrong)."""
    _refuse_unsupported(body, _UNSUPPORTED_COMPLETION)
    if body.get("logprobs") is not None:
        raise HttpError(400, "logprobs are not supported by this server", param="logprobs",
                        code="unsupported_parameter")
    if "prompt" not in body:
        raise HttpError(400, "prompt is required", param="prompt")
    prompts = _prompts(body["prompt"])
    common = _common(body, served)
    stream, include_usage, continuous = _stream_options(body)
    base = check_request_id(request_id)
    specs = []
    for n, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty: give text or at least one token id")
            ids = encoder.encode(prompt)
        else:
            ids = prompt
        specs.append(_spec(base if len(prompts) == 1 else f"{base}-{n}", ids, common, limits, max_seq_len))
    return OpenAIRequest("completion", common["model"], specs, stream, include_usage, continuous)


def _message_text(message: Any, n: int) -> dict[str, Any]:
    """One chat message for the template: content as text (text parts joined by new lines)."""
    if not isinstance(message, dict):
        raise _bad(f"messages[{n}]", "an object", message)
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise _bad(f"messages[{n}].role", "a string", role)
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise HttpError(400, f"messages[{n}].content: only text parts are supported, got {quoted(str(kind))}",
                                param="messages", code="unsupported_content")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif content is not None and not isinstance(content, str):
        raise _bad(f"messages[{n}].content", "a string or a list of text parts", content)
    if message.get("tool_calls"):
        raise HttpError(400, "tool calls are not supported by this server", param="messages",
                        code="unsupported_parameter")
    out = {k: v for k, v in message.items() if k in ("name",) and isinstance(v, str)}
    return {**out, "role": role, "content": content if content is not None else ""}


def chat_request(body: dict[str, Any], encoder: Any, limits: Any, served: str, request_id: str,
                 max_seq_len: int | None, template: Any) -> OpenAIRequest:
    """A ``/v1/chat/completions`` body -> OpenAIRequest, its prompt rendered by ``template``
    (a :class:`~.chat_template.ChatTemplate`)."""
    _refuse_unsupported(body, _UNSUPPORTED_CHAT)
    if body.get("logprobs") not in (None, False):
        raise HttpError(400, "logprobs are not supported by this server", param="logprobs",
                        code="unsupported_parameter")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, "messages must be a non-empty list of messages", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequestError(f"messages holds {len(messages)} messages; at most {MAX_MESSAGES}")
    common = _common(body, served)
    stream, include_usage, continuous = _stream_options(body)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise _bad("chat_template_kwargs", "an object", kwargs)
    text = template.render([_message_text(m, n) for n, m in enumerate(messages)],
                           add_generation_prompt=_boolean(body, "add_generation_prompt", True), extra=kwargs)
    ids = encoder.encode(text, special=False)  # the template wrote the special tokens it wants
    if not ids:
        raise InvalidRequestError("the chat template rendered these messages as no text")
    spec = _spec(check_request_id(request_id), ids, common, limits, max_seq_len)
    return OpenAIRequest("chat", common["model"], [spec], stream, include_usage, continuous)


# ---- responses ------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response_id(kind: str, request_id: str) -> str:
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request_id}"


def response(kind: str, rid: str, created: int, model: str, choices: Sequence[tuple[str, str | None]],
             use: dict[str, int]) -> dict[str, Any]:
    """A whole (non-streamed) answer; ``choices``: (text, finish reason) per choice."""
    if kind == "chat":
        return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                             "finish_reason": reason} for i, (text, reason) in enumerate(choices)],
                "usage": use}
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": reason}
                        for i, (text, reason) in enumerate(choices)],
            "usage": use}


def chunk(kind: str, rid: str, created: int, model: str, index: int, text: str | None, reason: str | None, *,
          role: bool = False, use: dict[str, int] | None = None, with_usage: bool = False) -> dict[str, Any]:
    """One stream chunk of choice ``index``. Chat: ``role`` sends the assistant role (the first chunk),
    ``text`` None an empty delta (the last). ``with_usage``: the chunk carries a ``usage`` key (null
    unless ``use``), as OpenAI's do when the usage was asked for."""
    if kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    else:
        out = {"id": rid, "object": "text_completion", "created": created, "model": model,
               "choices": [{"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}]}
    if with_usage or use is not None:
        out["usage"] = use
    return out


def usage_chunk(kind: str, rid: str, created: int, model: str, use: dict[str, int]) -> dict[str, Any]:
    """The last chunk when ``stream_options.include_usage``: no choices, the whole request's usage."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def models(model: str, created: int, max_seq_len: int | None) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model, created, max_seq_len)]}


def model_card(model: str, created: int, max_seq_len: int | None) -> dict[str, Any]:
    card: dict[str, Any] = {"id": model, "object": "model", "created": created, "owned_by": "switchyard"}
    if max_seq_len is not None:
        card["max_model_len"] = max_seq_len
    return card
