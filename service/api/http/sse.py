"""Server-sent events as OpenAI streams them: ``data: {json}\\n\\n`` per chunk, ``data: [DONE]`` at the
end; an error as an ``error`` event whose data is an OpenAI error object (the OpenAI client raises
it; clients that read only ``data:`` lines see the ``error`` key)."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"
HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    # Proxies (nginx, ingress controllers) would otherwise buffer the stream and hold tokens back.
    "X-Accel-Buffering": "no",
}


def event(obj: Any) -> bytes:
    # Compact separators: a chunk per token, so every byte is paid once per token per stream.
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


def error_event(obj: Any) -> bytes:
    return b"event: error\n" + event(obj)
