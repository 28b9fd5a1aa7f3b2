"""Token ids into text in the server's process (service/api/text.py): deltas that never split a
character, text held back while it could begin a stop string, the text before a stop string the last,
a stop token's own text left out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from helpers.serving_harness import tiny_tokenizer
from switchyard.service.api.text import TextStream, check_stop_strings
from switchyard.service.errors import InvalidRequestError


def events(tokens: list[int], last: str = "length") -> list[SimpleNamespace]:
    return [SimpleNamespace(request_id="r", index=i, token_id=t, finish_reason=last if i == len(tokens) - 1 else None,
                            step=i, batch_size=1, time=0.0) for i, t in enumerate(tokens)]


def run(stream: TextStream, evs) -> list:
    return [out for e in evs if (out := stream.push(e)) is not None]


@pytest.fixture(scope="module")
def tokens_and_text():
    tok = tiny_tokenizer()
    ids = tok.encode("The quick brown fox jumps over the lazy dog. Once upon a time there was a small model.")[1:]
    return tok, ids, tok.decode(ids)


def test_the_deltas_add_up_to_the_text(tokens_and_text):
    tok, ids, text = tokens_and_text
    out = run(TextStream(tok), events(ids))
    assert "".join(o.text for o in out) == text and out[-1].finish_reason == "length"
    assert [o.index for o in out] == list(range(len(ids)))


@pytest.mark.parametrize("stop", ["lazy", "y d", "model.", "The"])
def test_a_stop_string_ends_the_text_before_it(tokens_and_text, stop):
    tok, ids, text = tokens_and_text
    stream = TextStream(tok, (stop, "never there"))
    out = run(stream, events(ids))
    assert "".join(o.text for o in out) == text[: text.index(stop)]
    assert out[-1].finish_reason == "stop" and stream.stopped_at == out[-1].index + 1
    assert all(o.finish_reason is None for o in out[:-1])


def test_text_that_could_begin_a_stop_string_is_held_back_until_it_cannot(tokens_and_text):
    tok, ids, text = tokens_and_text
    out = run(TextStream(tok, ("quick brown cat",)), events(ids))
    sent = ""
    for o in out:
        sent += o.text
        assert not sent.endswith("quick") or o.finish_reason is not None, "a possible stop string was sent"
    assert sent == text and out[-1].finish_reason == "length"


def test_a_stop_tokens_own_text_is_left_out(tokens_and_text):
    tok, ids, _ = tokens_and_text
    out = run(TextStream(tok), events(ids[:5], last="stop"))
    assert "".join(o.text for o in out) == tok.decode(ids[:4]) and out[-1].finish_reason == "stop"


def test_stop_strings_are_checked():
    assert check_stop_strings(["a", "bc"]) == ("a", "bc")
    with pytest.raises(InvalidRequestError, match="at most 16 stop strings"):
        check_stop_strings(["x"] * 17)
    with pytest.raises(InvalidRequestError, match="non-empty and at most 256 characters"):
        check_stop_strings(["ok", ""])
