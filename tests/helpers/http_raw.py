"""Plain HTTP calls for the tests that look at the bytes on the wire (http.client: no client library
between the test and what the server sent)."""

from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import urlsplit


def call(url: str, method: str = "GET", body: Any = None, *, raw: bytes | None = None,
         headers: dict[str, str] | None = None, timeout: float = 30) -> tuple[int, dict[str, str], bytes]:
    """(status, headers with lower-case names, body). ``body`` is sent as JSON, ``raw`` as it is."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        sent = {"Content-Type": "application/json", **(headers or {})}
        connection.request(method, parts.path + (f"?{parts.query}" if parts.query else ""), body=data, headers=sent)
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def error(url: str, method: str = "POST", body: Any = None, **kwargs: Any) -> tuple[int, dict[str, Any]]:
    """(status, the OpenAI error object) of a call that must fail."""
    status, _, data = call(url, method, body, **kwargs)
    return status, json.loads(data)["error"]
