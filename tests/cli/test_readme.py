"""The README's examples, run as written against a served tiny model: its Python blocks in order in
one namespace (the address and the model name pointed at the test server, nothing else changed)."""

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
    assert len(code) >= 2, "the README's KServe examples (unary and streaming) are missing"
    with serving() as served:
        namespace: dict = {}
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            for block in code:
                block = block.replace("localhost:8001", served.target).replace('"llama-3-8b"', '"tiny"')
                exec(compile(block, "README.md", "exec"), namespace)
        printed = out.getvalue().splitlines()
    assert len(printed) == 2 and all(line.strip() for line in printed), printed
    # The unary answer (16 tokens of "Hello") and the streamed text (32 tokens of "Once upon a time")
    # came from the tiny model: greedy, so each equals the Decode API's answer to the same prompt.
    from switchyard.service.api.client import DecodeClient, make_request

    with serving() as served:
        client = DecodeClient(served.target)
        hello = client.stub.GenerateUnary(make_request("Hello", max_tokens=16), timeout=60).text
        story = client.stub.GenerateUnary(make_request("Once upon a time", max_tokens=32), timeout=60).text
    assert printed == [hello, story]
