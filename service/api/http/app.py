"""The OpenAI-compatible HTTP front end: aiohttp on its own port, on the gRPC server's event loop.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (a JSON answer, or server-sent
events with ``stream``), ``GET /v1/models`` (and ``/v1/models/{model}``), ``GET /health`` (200 while
serving, 503 while loading, draining or failed: the pods' probes), ``GET /metrics`` (Prometheus).

A thin layer over :class:`~switchyard.service.api.server.DecodeApp`, which the gRPC handlers share:
the same bridge to the engine, limits, request identity, text pool and traces. A handler reads the
body (bounded by the same ``max_request_bytes``), converts it in the text pool
(``openai_api.py``: checks, chat template, tokenizing), and reads each choice's events from
``DecodeApp.generate``. A streamed answer's headers go out once every choice has its first token, so a
request the engine refuses (queue full, too long) gets its HTTP status, not a stream that fails at
once. A client that goes away cancels its handler (aiohttp's handler cancellation), which leaves the
bridge's iterator and so cancels the request in the engine: its KV blocks go back at the next step.

aiohttp, not an ASGI server: it runs inside the loop that ``serve()`` already owns, beside
``grpc.aio``, without taking over the process's signals (uvicorn's ``Server.serve`` installs its own
SIGINT/SIGTERM handlers, which would race the drain), and it cancels a handler when its client
disconnects, which is what frees the engine's KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web
from switchyard.service.api import parsing
from switchyard.service.telemetry import tracing

from . import openai_api, sse
from .errors import HttpError, ModelNotFound, http_error, too_large
from .listen import any_address_socket, is_any_address
from .metrics import CONTENT_TYPE

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
# An answer to a client that has gone (aiohttp cancels the handler) is never written: 499 in metrics.
CLIENT_GONE = 499


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(obj, ensure_ascii=False).encode("utf-8"), status=status,
                        content_type="application/json")


def _error(err: HttpError) -> web.Response:
    return _json(err.body(), err.status)


class HttpFrontEnd:
    """The routes over ``app`` (a DecodeApp) and the server's life (:meth:`start`, :meth:`stop`)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.created = int(time.time())
        self._runner: web.AppRunner | None = None
        self.port = 0

    # ---- life ------------------------------------------------------------------------------------
    def web_app(self) -> web.Application:
        # Bodies are read by the handlers, which answer an oversize one with 413 in OpenAI's shape.
        web_app = web.Application(client_max_size=self.app.limits.max_request_bytes,
                                  middlewares=[self._errors_and_counts])
        web_app.router.add_post("/v1/completions", self.completions)
        web_app.router.add_post("/v1/chat/completions", self.chat_completions)
        web_app.router.add_get("/v1/models", self.models)
        web_app.router.add_get("/v1/models/{model}", self.model)
        web_app.router.add_get("/health", self.health)
        web_app.router.add_get("/metrics", self.metrics)
        return web_app

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: any free port); returns the port. OSError when it cannot."""
        self._runner = web.AppRunner(self.web_app(), handle_signals=False, access_log=None,
                                     handler_cancellation=True)
        await self._runner.setup()
        try:
            if is_any_address(host):
                site: web.BaseSite = web.SockSite(self._runner, any_address_socket(port))
            else:
                site = web.TCPSite(self._runner, host.strip("[]"), port, reuse_port=False)
            await site.start()
        except OSError:
            await self._runner.cleanup()
            self._runner = None
            raise
        server = site._server  # aiohttp keeps the asyncio server there; its socket says the port
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else port
        return self.port

    async def stop(self, grace: float = 1.0) -> None:
        if self._runner is not None:
            await self._runner.shutdown()
            await self._runner.cleanup()
            self._runner = None

    # ---- middleware ------------------------------------------------------------------------------
    @web.middleware
    async def _errors_and_counts(self, request: web.Request,
                                 handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                                 ) -> web.StreamResponse:
        """Every answer OpenAI-shaped (aiohttp's own 404 / 405 too) and counted by route and status."""
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "other"
        status = CLIENT_GONE
        try:
            response = await handler(request)
            status = response.status
            return response
        except HttpError as err:
            status = err.status
            return _error(err)
        except web.HTTPException as err:
            status = err.status
            if err.status == 413:
                return _error(too_large(request.content_length, self.app.limits.max_request_bytes))
            return _error(HttpError(err.status, f"{request.method} {request.path}: {err.reason}",
                                    code="not_found" if err.status == 404 else None))
        except asyncio.CancelledError:
            raise
        except ConnectionResetError:
            # The client left while its answer was written: its request is cancelled already (the
            # stream's events closed), so there is nothing to log; aiohttp drops what is returned
            # (raised, it would log the disconnect as an error).
            status = CLIENT_GONE
            return web.Response(status=CLIENT_GONE)
        except Exception as err:
            answer = http_error(err)
            status = answer.status
            return _error(answer)
        finally:
            self.app.metrics.http_request(route, status)

    # ---- small routes ----------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        try:
            self.app.require_ready()
        except Exception as err:
            raise http_error(err) from None
        return _json({})

    async def models(self, request: web.Request) -> web.Response:
        return _json(openai_api.models(self.app.model_name, self.created, self.app.max_seq_len))

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name != self.app.model_name:
            raise ModelNotFound(name, self.app.model_name)
        return _json(openai_api.model_card(name, self.created, self.app.max_seq_len))

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.app.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    # ---- generation ------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, openai_api.completion_request)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, openai_api.chat_request, self.app.chat_template)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        limit = self.app.limits.max_request_bytes
        if request.content_length is not None and request.content_length > limit:
            raise too_large(request.content_length, limit)  # refused before a byte of it is read
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large(None, limit) from None
        parsing.set_request_bytes(len(raw))  # held against the text pool's budget while converting
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
            raise HttpError(400, f"the request body is not valid JSON: {str(err)[:200]}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise HttpError(400, f"the request body must be a JSON object, got {type(body).__name__}",
                            code="invalid_json")
        return body

    async def _generate(self, request: web.Request, convert: Callable[..., openai_api.OpenAIRequest],
                        *args: Any) -> web.StreamResponse:
        body = await self._body(request)
        app = self.app
        asked = await app.convert(convert, body, app.model_name, request.headers.get(REQUEST_ID_HEADER, ""),
                                  app.max_seq_len, *args)
        parent = tracing.parent_context((k.lower(), v) for k, v in request.headers.items())
        streams = [app.generate(spec, timeout=None, parent=parent) for spec in asked.specs]
        rid = openai_api.response_id(asked.kind, asked.specs[0].request_id)
        created = int(time.time())
        async with _merged(streams) as events:
            if not asked.stream:
                return _json(await _whole(asked, events, rid, created))
            first = await _until_every_choice_began(events, len(asked.specs))
            response = web.StreamResponse(headers=sse.HEADERS)
            await response.prepare(request)
            try:
                await _stream(response, asked, _chain(first, events), rid, created)
            except (ConnectionResetError, asyncio.CancelledError):
                raise
            except Exception as err:  # after the headers: an error event, then the end of the stream
                with contextlib.suppress(ConnectionResetError):
                    await response.write(sse.error_event(http_error(err).body()))
                    await response.write(sse.DONE)
            return response


# ---- events of several choices -------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _merged(streams: list[AsyncIterator[Any]]) -> AsyncIterator[AsyncIterator[tuple[int, Any]]]:
    """(choice, event) pairs of every stream as they come; a stream's error is raised from the merged
    iterator. Leaving the context (the answer is done, the client went away, an error) closes every
    stream, which cancels what is still generating."""
    if len(streams) == 1:
        async def single() -> AsyncIterator[tuple[int, Any]]:
            async for event in streams[0]:
                yield 0, event

        iterator = single()
        try:
            yield iterator
        finally:
            await iterator.aclose()
            await streams[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: AsyncIterator[Any]) -> None:
        try:
            async with contextlib.aclosing(stream) as events:
                async for event in events:
                    queue.put_nowait((index, event, None))
            queue.put_nowait((index, done, None))
        except asyncio.CancelledError:
            raise
        except Exception as err:
            queue.put_nowait((index, done, err))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]

    async def merged() -> AsyncIterator[tuple[int, Any]]:
        live = len(tasks)
        while live:
            index, event, err = await queue.get()
            if err is not None:
                raise err
            if event is done:
                live -= 1
                continue
            yield index, event

    iterator = merged()
    try:
        yield iterator
    finally:
        await iterator.aclose()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _until_every_choice_began(events: AsyncIterator[tuple[int, Any]], choices: int) -> list[tuple[int, Any]]:
    """The events up to the first of every choice: until then the engine may still refuse one (queue
    full, too long), and that refusal is the answer's HTTP status rather than an event in a stream."""
    first: list[tuple[int, Any]] = []
    began: set[int] = set()
    while len(began) < choices:
        try:
            item = await anext(events)
        except StopAsyncIteration:
            break
        first.append(item)
        began.add(item[0])
    return first


async def _chain(first: list[tuple[int, Any]], rest: AsyncIterator[tuple[int, Any]]) -> AsyncIterator[tuple[int, Any]]:
    for item in first:
        yield item
    async for item in rest:
        yield item


async def _whole(asked: openai_api.OpenAIRequest, events: AsyncIterator[tuple[int, Any]], rid: str,
                 created: int) -> dict[str, Any]:
    texts: list[list[str]] = [[] for _ in asked.specs]
    reasons: list[str | None] = [None] * len(asked.specs)
    produced = [0] * len(asked.specs)
    async for index, event in events:
        texts[index].append(event.text)
        produced[index] += event.token_id is not None
        if event.finish_reason is not None:
            reasons[index] = event.finish_reason
    prompt = sum(len(spec.prompt_ids) for spec in asked.specs)
    return openai_api.response(asked.kind, rid, created, asked.model,
                               [("".join(t), r) for t, r in zip(texts, reasons, strict=True)],
                               openai_api.usage(prompt, sum(produced)))


async def _stream(response: web.StreamResponse, asked: openai_api.OpenAIRequest,
                  events: AsyncIterator[tuple[int, Any]], rid: str, created: int) -> None:
    """One chunk per token (a final event without a token: a chunk with the finish reason only)."""
    kind, model = asked.kind, asked.model
    prompt_tokens = sum(len(spec.prompt_ids) for spec in asked.specs)
    produced = 0
    greeted = [False] * len(asked.specs)  # chat: the first chunk of a choice carries the role
    with_usage = asked.include_usage or asked.continuous_usage
    async for index, event in events:
        produced += event.token_id is not None
        use = openai_api.usage(prompt_tokens, produced) if asked.continuous_usage else None
        if kind == "chat" and not greeted[index]:
            greeted[index] = True
            if event.finish_reason is None or event.text:
                await response.write(sse.event(openai_api.chunk(kind, rid, created, model, index, "", None,
                                                                 role=True, use=use, with_usage=with_usage)))
        text: str | None = event.text
        if kind == "chat" and event.finish_reason is not None and not event.text:
            text = None  # the last chat chunk: an empty delta with the finish reason
        await response.write(sse.event(openai_api.chunk(kind, rid, created, model, index, text,
                                                         event.finish_reason, use=use, with_usage=with_usage)))
    if asked.include_usage:
        await response.write(sse.event(openai_api.usage_chunk(kind, rid, created, model,
                                                              openai_api.usage(prompt_tokens, produced))))
    await response.write(sse.DONE)
