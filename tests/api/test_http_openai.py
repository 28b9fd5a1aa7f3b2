"""The OpenAI-compatible HTTP API driven by the real ``openai`` client: completions and chat, whole and
streamed, usage, the fields benchmarks send, and the errors a client library maps to its exceptions."""

from __future__ import annotations

import json

import pytest
from helpers.http_raw import call
from helpers.serving_harness import serving, tiny_dir, tiny_tokenizer
from switchyard.service.api.client import DecodeClient, make_request

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def served():
    with serving(http=True) as s:
        yield s


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=served.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_client(served):
    with DecodeClient(served.target) as c:
        yield c


def test_models_and_health(client, served) -> None:
    (model,) = client.models.list().data
    assert (model.id, model.object, model.owned_by) == ("tiny", "model", "switchyard")
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("llama-70b")
    assert call(served.http_url + "/health")[0] == 200


def test_completion_is_the_decode_apis_text_with_usage(client, grpc_client, served) -> None:
    answer = client.completions.create(model="tiny", prompt="Hello world", max_tokens=12, temperature=0)
    assert answer.object == "text_completion" and answer.model == "tiny" and answer.id.startswith("cmpl-")
    (choice,) = answer.choices
    same = grpc_client.generate(make_request("Hello world", max_tokens=12), timeout=60)  # greedy too
    assert choice.text == same.text and choice.index == 0
    assert choice.finish_reason == same.finish_reason
    prompt_tokens = len(tiny_tokenizer().encode("Hello world"))
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (prompt_tokens, len(same.token_ids))
    assert answer.usage.total_tokens == prompt_tokens + len(same.token_ids)
    served.assert_no_leaked_slots()


def test_streamed_completion_is_one_token_per_chunk_then_the_usage(client) -> None:
    whole = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    *token_chunks, last = chunks
    assert all(c.object == "text_completion" and len(c.choices) == 1 and c.usage is None for c in token_chunks)
    assert len(token_chunks) == whole.usage.completion_tokens == 20
    assert "".join(c.choices[0].text for c in token_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in token_chunks][-1] == "length"
    assert last.choices == [] and last.usage == whole.usage
    assert len({c.id for c in chunks}) == 1


def test_continuous_usage_stats_put_the_count_so_far_on_every_chunk(client) -> None:
    chunks = list(client.completions.create(
        model="tiny", prompt="Count", max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    assert [c.usage.completion_tokens for c in chunks[:-1]] == [1, 2, 3, 4, 5, 6]
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []


def test_token_id_prompts_and_a_list_of_prompts(client) -> None:
    ids = tiny_tokenizer().encode("The quick brown fox")
    by_text = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=8, temperature=0)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    both = client.completions.create(model="tiny", prompt=["The quick brown fox", "Hello world"], max_tokens=8,
                                     temperature=0)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].text == by_text.choices[0].text
    streamed = list(client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=8, temperature=0,
                                              stream=True))
    for index in (0, 1):
        text = "".join(c.choices[0].text for c in streamed if c.choices[0].index == index)
        assert text == by_text.choices[0].text


def test_chat_renders_the_checkpoints_template_as_transformers_does(client) -> None:
    transformers = pytest.importorskip("transformers")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_dir()))
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_tokens = len(tiny_tokenizer().encode(text, special=False))
    answer = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10,
                                            temperature=0)
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    (choice,) = answer.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert answer.usage.prompt_tokens == prompt_tokens
    # The same prompt as a completion gives the same text: the template is all the chat adds.
    same = client.completions.create(model="tiny", prompt=tiny_tokenizer().encode(text, special=False),
                                     max_tokens=10, temperature=0)
    assert choice.message.content == same.choices[0].text


def test_streamed_chat_sends_the_role_first_then_a_token_per_chunk(client) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) <= 8
    assert "".join(c.choices[0].delta.content for c in content) == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finals] == ["length"]
    assert chunks[-1].usage == whole.usage and chunks[-1].choices == []


def test_a_template_that_refuses_the_messages_is_a_400(served) -> None:
    from switchyard.service.api.http.chat_template import ChatTemplate

    template = ChatTemplate("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}"
                            "{% endif %}{{ messages[0].content }}")
    assert template.render([{"role": "user", "content": "hi"}]) == "hi"
    from switchyard.service.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="first must be user"):
        template.render([{"role": "assistant", "content": "hi"}])


def test_chat_without_a_template_is_a_clear_400() -> None:
    from switchyard.service.api.http.chat_template import ChatTemplate

    with serving(http=True, chat_template=ChatTemplate.missing("this model has no chat template")) as s, \
            openai.OpenAI(base_url=s.http_url + "/v1", api_key="unused", max_retries=0) as c:
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        assert c.completions.create(model="tiny", prompt="still serving", max_tokens=2).choices[0].text is not None


def test_sampling_fields_are_honoured(client) -> None:
    def text(**fields) -> str:
        return client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12,
                                         extra_body=fields).choices[0].text

    assert text(temperature=0.9, seed=7) == text(temperature=0.9, seed=7)
    seeds = {text(temperature=0.9, seed=seed) for seed in range(4)}
    assert len(seeds) > 1, "the seed changes what is sampled"
    greedy = text(temperature=0)
    assert text(temperature=0) == greedy
    # top_k and top_p reach the engine's checks (the fake engine samples by seed alone)
    assert text(temperature=0.9, top_k=5, top_p=0.9, seed=3) and text(top_k=-1)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        text(top_p=0)
    stop = greedy[len(greedy) // 2:][:3]
    if stop.strip():
        cut = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0,
                                        stop=[stop])
        assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text


def test_min_tokens_and_ignore_eos_on_every_api(served, client, grpc_client) -> None:
    """A model whose end-of-sequence id is a token the prompt's greedy output makes early: it stops
    there, unless ignore_eos, or min_tokens holds it back; the same on HTTP, gRPC and KServe."""
    free = grpc_client.generate(make_request("Once upon a time", max_tokens=40), timeout=60).token_ids
    k = next(i for i in range(2, 20) if free[i] not in free[:i])
    with serving(http=True, eos_token_ids=(free[k],)) as s, \
            openai.OpenAI(base_url=s.http_url + "/v1", api_key="unused", max_retries=0) as c, \
            DecodeClient(s.target) as g:
        def http(**extra):
            answer = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=40, temperature=0,
                                          extra_body=extra)
            return answer.usage.completion_tokens, answer.choices[0].finish_reason

        assert http() == (k + 1, "stop")
        assert http(ignore_eos=True) == (40, "length")
        tokens, _ = http(min_tokens=k + 3)
        assert tokens >= k + 3
        grpc_stop = g.generate(make_request("Once upon a time", max_tokens=40), timeout=60)
        grpc_free = g.generate(make_request("Once upon a time", max_tokens=40, ignore_eos=True), timeout=60)
        grpc_min = g.generate(make_request("Once upon a time", max_tokens=40, min_tokens=k + 3), timeout=60)
        assert (len(grpc_stop.token_ids), grpc_stop.finish_reason) == (k + 1, "stop")
        assert (len(grpc_free.token_ids), grpc_free.finish_reason) == (40, "length")
        assert grpc_free.token_ids == free and len(grpc_min.token_ids) >= k + 3
        s.assert_no_leaked_slots()


def test_min_tokens_holds_back_stop_strings_too(client) -> None:
    greedy = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=30, temperature=0,
                                       extra_body={"ignore_eos": True})
    text = greedy.choices[0].text
    stop = text[2:5]
    if not stop.strip() or text.find(stop) != 2:
        pytest.skip("no usable stop string near the start")
    early = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=30, temperature=0,
                                      stop=[stop], extra_body={"ignore_eos": True})
    held = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=30, temperature=0,
                                     stop=[stop], extra_body={"ignore_eos": True, "min_tokens": 30})
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens < 30
    assert held.usage.completion_tokens == 30 and held.choices[0].text == text


def test_an_error_after_the_headers_is_an_error_event(client, served) -> None:
    stream = client.completions.create(model="tiny", prompt="a long one", max_tokens=200, stream=True,
                                       extra_headers={"X-Request-Id": "cut-mid-stream"},
                                       extra_body={"ignore_eos": True})
    first = next(iter(stream))
    assert first.id == "cmpl-cut-mid-stream"
    served.scheduler.cancel("cut-mid-stream")  # the engine ends it: not a finish the client asked for
    with pytest.raises(openai.APIError, match="cancelled"):
        for _ in stream:
            pass
    served.assert_no_leaked_slots()


def test_sse_wire_format(served) -> None:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "stream": True, "ignore_eos": True}
    status, headers, raw = call(served.http_url + "/v1/completions", "POST", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = raw.decode().split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    assert all(e.startswith("data: {") for e in events[:-2]) and len(events[:-2]) == 3
    assert json.loads(events[0][len("data: "):])["object"] == "text_completion"
