"""The README's examples, run as written against a served tiny model: its Python blocks in order in
one namespace (the addresses and the model names pointed at the test server, nothing else changed)."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
from helpers import ROOT
from helpers.serving_harness import serving

pytestmark = pytest.mark.timeout(300)
README = (ROOT / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.S | re.M)


def test_the_readme_python_examples_run_as_written() -> None:
    code = blocks("python")
    assert len(code) >= 3, "the README's OpenAI and KServe examples (unary and streaming) are missing"
    with serving(http=True) as served:
        namespace: dict = {}
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            for block in code:
                for old, new in {"http://localhost:8000": served.http_url, "localhost:8001": served.target,
                                 '"llama-3-8b"': '"tiny"', '"llama3-8b"': '"tiny"'}.items():
                    block = block.replace(old, new)
                exec(compile(block, "README.md", "exec"), namespace)
        printed = out.getvalue()
        # What each example printed is what the server answers the same request with: the OpenAI
        # client's greedy completion and streamed chat (the whole chat answer asked for at once), then
        # tritonclient's unary answer (16 tokens of "Hello") and streamed text (32 tokens of "Once upon
        # a time"), each equal to the Decode API's greedy answer to its prompt.
        from openai import OpenAI
        from switchyard.service.api.client import DecodeClient, make_request

        client = DecodeClient(served.target)
        fox = client.stub.GenerateUnary(make_request("The quick brown fox", max_tokens=16), timeout=60).text
        hello = client.stub.GenerateUnary(make_request("Hello", max_tokens=16), timeout=60).text
        story = client.stub.GenerateUnary(make_request("Once upon a time", max_tokens=32), timeout=60).text
        with OpenAI(base_url=served.http_url + "/v1", api_key="unused", max_retries=0) as openai_client:
            chat = openai_client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=16, temperature=0)
        answers = [fox, chat.choices[0].message.content, hello, story]
    assert all(a.strip() for a in answers), answers
    assert printed == "".join(a + "\n" for a in answers), (printed, answers)
