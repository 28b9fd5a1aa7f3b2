"""Hostile and mistaken HTTP clients: each gets its status and an OpenAI-shaped error, and the server
stays healthy with every KV block free afterwards."""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import socket

import pytest
from helpers.http_raw import call, error
from helpers.serving_harness import serving
from prometheus_client.parser import text_string_to_metric_families
from switchyard.service.api.wire import Limits

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(120)
MAX_BYTES = 64 << 10


@pytest.fixture(scope="module")
def served():
    with serving(http=True, max_queue=256, limits=Limits(default_max_tokens=16, max_request_bytes=MAX_BYTES)) as s:
        yield s


def _completions(served) -> str:
    return served.http_url + "/v1/completions"


def _still_healthy(served) -> None:
    served.assert_no_leaked_slots()
    assert call(served.http_url + "/health")[0] == 200
    status, _, body = call(_completions(served), "POST", {"model": "tiny", "prompt": "still here", "max_tokens": 2})
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize(("raw", "expect"), [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
    (b"[1, 2, 3]", "must be a JSON object"),
    (b"", "not valid JSON"),
    (b"[" * 50_000, "not valid JSON"),  # deep nesting: a bounded error, not a crash
])
def test_malformed_bodies_are_400(served, raw, expect) -> None:
    status, err = error(_completions(served), raw=raw)
    assert status == 400 and expect in err["message"] and err["type"] == "invalid_request_error"


@pytest.mark.parametrize(("fields", "names"), [
    ({"prompt": 42}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "two"]}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 7}, "top_p"),
    ({"prompt": "hi", "seed": -3}, "seed"),
    ({"prompt": "hi", "stop": 5}, "stop"),
    ({"prompt": "hi", "stop": ["x"] * 100}, "stop"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "ignore_eos": "true"}, "ignore_eos"),
    ({"prompt": "hi", "min_tokens": 99, "max_tokens": 4}, "min_tokens"),
    ({"prompt": "hi", "n": 2}, "n must be 1"),
    ({"prompt": "hi", "logprobs": 1}, "logprobs"),
    ({"prompt": "hi", "echo": True}, "echo"),
    ({"prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
    ({"prompt": [99999]}, "token ids"),
    ({"prompt": ["a"] * 65}, "at most 64"),
    ({"model": 7, "prompt": "hi"}, "model"),
])
def test_wrong_fields_are_400_naming_the_field(served, fields, names) -> None:
    status, err = error(_completions(served), body={"model": "tiny", **fields})
    assert status == 400, err
    assert names in err["message"], err


@pytest.mark.parametrize(("fields", "names"), [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"content": "hi"}]}, "role"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "text parts"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, "logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
])
def test_wrong_chat_fields_are_400(served, fields, names) -> None:
    status, err = error(served.http_url + "/v1/chat/completions", body={"model": "tiny", **fields})
    assert status == 400 and names in err["message"], err


def test_the_openai_client_gets_its_exceptions(served) -> None:
    with openai.OpenAI(base_url=served.http_url + "/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.completions.create(model="llama-70b", prompt="hi")
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="tiny", prompt="hi", max_tokens=10**12)
        assert err.value.code == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError, match="n must be 1"):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=3)
    _still_healthy(served)


def test_huge_bodies_are_413_before_they_are_read(served) -> None:
    big = {"model": "tiny", "prompt": "x" * (2 * MAX_BYTES)}
    status, err = error(_completions(served), body=big)
    assert status == 413 and str(MAX_BYTES) in err["message"]
    # Without a Content-Length (chunked), the limit holds while reading.
    payload = json.dumps(big).encode()
    with socket.create_connection(("127.0.0.1", served.server.http_port), timeout=10) as sock:
        head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
        sock.sendall(head + f"{len(payload):x}\r\n".encode() + payload + b"\r\n0\r\n\r\n")
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413")
    _still_healthy(served)


def test_unknown_routes_and_methods_answer_in_openai_shape(served) -> None:
    status, err = error(served.http_url + "/v1/embeddings", body={"input": "hi"})
    assert status == 404 and err["code"] == "not_found"
    status, err = error(_completions(served), method="GET")
    assert status == 405 and "Method Not Allowed" in err["message"]


def test_a_full_queue_is_429_and_draining_is_503() -> None:
    with serving(http=True, max_queue=1) as s:
        body = {"model": "tiny", "prompt": "busy", "max_tokens": 200, "ignore_eos": True}

        async def burst() -> list[int]:
            from aiohttp import ClientSession

            async with ClientSession() as session:
                async def one() -> int:
                    async with session.post(s.http_url + "/v1/completions", json=body) as r:
                        await r.read()
                        return r.status

                return await asyncio.gather(*(one() for _ in range(24)))

        statuses = asyncio.run(burst())
        # Some were admitted (slots fill one step at a time), the rest found the one-place queue full.
        assert set(statuses) == {200, 429}
        s.assert_no_leaked_slots()
        s.server.call(s.app.drain())
        assert call(s.http_url + "/health")[0] == 503
        status, err = error(s.http_url + "/v1/completions", body={"model": "tiny", "prompt": "x"})
        assert status == 503 and err["type"] == "service_unavailable"


@pytest.mark.timeout(600)
def test_ten_thousand_disconnects_free_every_kv_block(served, caplog) -> None:
    """10 000 clients that leave: right after sending, after the first streamed bytes, or while their
    answer is being made, up to 2 000 at once (as many as the process may hold sockets for: a client's
    and the server's end each take one); each cancels its request in the engine or is turned away
    (429) while the queue is full. Nothing is logged as an error, and the server is healthy with every
    KV block free afterwards."""
    total = 10_000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    wave = max(100, min(2_000, (hard - 1_000) // 2))

    async def leave(n: int) -> None:
        stream = n % 3 != 2
        body = json.dumps({"model": "tiny", "prompt": f"leave {n}", "max_tokens": 200, "ignore_eos": True,
                           "stream": stream}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", served.server.http_port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        if n % 3 == 1:
            await asyncio.wait_for(reader.read(1), 60)  # the stream has begun (or the queue was full)
        elif n % 3 == 2:
            await asyncio.sleep(0.01 * (n % 5))
        writer.transport.abort()

    async def everyone() -> None:
        for start in range(0, total, wave):
            await asyncio.gather(*(leave(n) for n in range(start, min(start + wave, total))))

    try:
        with caplog.at_level(logging.WARNING):
            asyncio.run(everyone())
            _still_healthy(served)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text[-2000:]
    # The clients that left mid-answer are counted as gone (499), not as failures (500).
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(call(served.http_url + "/metrics")[2].decode()):
        for sample in family.samples:
            if sample.name == "switchyard_http_requests_total" and sample.labels["route"] == "/v1/completions":
                counts[sample.labels["status"]] = counts.get(sample.labels["status"], 0) + sample.value
    assert counts.get("499", 0) > 0 and "500" not in counts, counts
