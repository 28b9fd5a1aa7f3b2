"""``switchyard serve --tiny`` as the pod runs it, through HTTP: /health through the life cycle (503
while loading, 200 serving, 503 draining), the openai client against the engine in its own process,
and in-flight HTTP streams finishing within the drain's grace period."""

from __future__ import annotations

import signal
import threading

import pytest
from helpers.http_raw import call
from helpers.serve_process import free_port, serve_tiny, wait_for

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(600)


def _health(url: str) -> int:
    try:
        return call(url + "/health", timeout=5)[0]
    except OSError:
        return 0  # not listening yet


def test_serve_answers_the_openai_client_and_drains_http_streams(tmp_path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with serve_tiny(tmp_path, slots=4, http_port=port) as (proc, _, log):
        wait_for(lambda: _health(url) in (200, 503), 120, "the HTTP port")
        wait_for(lambda: _health(url) == 200, 300, f"/health 200; log:\n{log.read_text()[-3000:]}")
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            assert [m.id for m in client.models.list().data] == ["tiny"]
            chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                  max_tokens=4, extra_body={"ignore_eos": True})
            assert chat.usage.completion_tokens == 4
            stream = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=48, stream=True,
                                               temperature=0, extra_body={"ignore_eos": True})
            chunks = iter(stream)
            first = next(chunks)
            received = [first]
            drained = threading.Thread(target=lambda: received.extend(chunks))
            drained.start()
            proc.send_signal(signal.SIGTERM)  # the stream in flight finishes; new requests are refused
            wait_for(lambda: _health(url) in (0, 503), 60, "/health 503 while draining")
            drained.join(120)
        assert sum(1 for c in received if c.choices and c.choices[0].text is not None) == 48
        assert received[-1].choices[0].finish_reason == "length"
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
