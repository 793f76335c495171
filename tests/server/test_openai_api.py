"""The OpenAI SDK against a live server over the tiny checkpoint (and greedy parity with the engine)."""

from __future__ import annotations

import dataclasses

import pytest

from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.sampling_params import SamplingParams
from tests.server.conftest import ENGINE_ARGS, MODEL_NAME

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Say hello."}]
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(live):
    return live.openai()


def test_models_list(client, live):
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == MODEL_NAME and live.model_path in ids


def test_chat_completion(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, extra_body=NO_EOS)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL_NAME
    (choice,) = r.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_chat_content_parts_equal_string(client):
    kw = dict(model=MODEL_NAME, max_tokens=5, temperature=0, extra_body=NO_EOS)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hello."}]}]
    a = client.chat.completions.create(messages=parts, **kw)
    b = client.chat.completions.create(messages=[{"role": "user", "content": "Say hello."}], **kw)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_completion(client):
    r = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=7, extra_body=NO_EOS)
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 7


def test_completion_prompt_forms_and_echo(client):
    r = client.completions.create(model=MODEL_NAME, prompt=[[65, 66, 67], [68, 69]], max_tokens=3, echo=True,
                                  temperature=0, extra_body=NO_EOS)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text.startswith("ABC") and r.choices[1].text.startswith("DE")
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 6


def test_streaming_chat_equals_non_streamed_for_a_seed(client):
    kw = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0.9, seed=1234, extra_body=NO_EOS)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 12
    assert usage.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_completion_equals_non_streamed(client):
    kw = dict(model=MODEL_NAME, prompt="abc", max_tokens=10, temperature=0.7, seed=7, extra_body=NO_EOS)
    full = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == full


def test_seeded_request_repeats(client):
    kw = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=1.0, seed=99, extra_body=NO_EOS)
    a, b = (client.chat.completions.create(**kw).choices[0].message.content for _ in range(2))
    c = client.chat.completions.create(**{**kw, "seed": 100}).choices[0].message.content
    assert a == b and a != c


def test_n_two(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=2, max_tokens=8, temperature=1.0,
                                       seed=5, extra_body=NO_EOS)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content
    assert r.usage.completion_tokens == 16
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=2, max_tokens=8,
                                                 temperature=1.0, seed=5, stream=True, extra_body=NO_EOS))
    for i in range(2):
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
        assert streamed == r.choices[i].message.content


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3, extra_body=NO_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.top_logprobs[-1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy picks the top token
        assert item.bytes == list(item.token.encode())


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL_NAME, prompt="xyz", max_tokens=4, logprobs=2, temperature=0,
                                  extra_body=NO_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert lp.text_offset[0] == 0 and all(len(t) >= 1 for t in lp.top_logprobs)
    assert all(x <= 0 for x in lp.token_logprobs)


def _printable_stop(text: str) -> str:
    for ch in text[1:]:
        if ch.isalnum():
            return ch
    pytest.skip(f"no alphanumeric character to stop on in {text!r}")


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_stop_string(client, endpoint):
    kw = dict(model=MODEL_NAME, max_tokens=30, temperature=0, extra_body=NO_EOS)
    create = (lambda **k: client.chat.completions.create(messages=MESSAGES, **k)) if endpoint == "chat" else \
        (lambda **k: client.completions.create(prompt="The stop test", **k))
    text_of = (lambda r: r.choices[0].message.content) if endpoint == "chat" else (lambda r: r.choices[0].text)
    full = text_of(create(**kw))
    stop = _printable_stop(full)
    r = create(stop=[stop], **kw)
    assert text_of(r) == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    with_stop = create(stop=[stop], **{**kw, "extra_body": {**NO_EOS, "include_stop_str_in_output": True}})
    assert text_of(with_stop) == full[:full.index(stop) + 1]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_stop_strings_held_back_matched_and_included(client, endpoint, stream):
    """Greedy with logit_bias {"a": +100} writes "aaaa...": "aab" is held back as "aa" until the end,
    "aaa" matches on the 3rd token; the engine (not the server) keeps it with include_stop_str_in_output."""
    kw = dict(model=MODEL_NAME, temperature=0, logit_bias={"97": 100}, stream=stream)
    create = (lambda **k: client.chat.completions.create(messages=MESSAGES, **k)) if endpoint == "chat" else \
        (lambda **k: client.completions.create(prompt="x", **k))

    def result(**k):
        r = create(**kw, **k)
        if not stream:
            c = r.choices[0]
            return (c.message.content if endpoint == "chat" else c.text), c.finish_reason
        chunks = [c.choices[0] for c in r if c.choices]
        pieces = [(c.delta.content if endpoint == "chat" else c.text) or "" for c in chunks]
        return "".join(pieces), chunks[-1].finish_reason

    assert result(max_tokens=6, stop=["aab"], extra_body=NO_EOS) == ("aaaaaa", "length")
    assert result(max_tokens=6, stop=["aaa"], extra_body=NO_EOS) == ("", "stop")
    assert result(max_tokens=6, stop=["aaa"], extra_body={**NO_EOS, "include_stop_str_in_output": True}) == \
        ("aaa", "stop")


@pytest.mark.parametrize("prompt", ["Hello there, general", [72, 101, 108, 108, 111, 32, 33]])
def test_greedy_over_http_equals_the_engine(client, live, prompt):
    engine = LLMEngine(dataclasses.replace(EngineArgs(model=live.model_path, **ENGINE_ARGS), warmup=False),
                       loaded=live.engine.engine.model)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("ref", prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}, params)
    expected = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            expected = out.outputs[0] if out.finished else expected
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body=NO_EOS)
    assert r.choices[0].text == expected.text


def test_tokenize_detokenize(live):
    import httpx
    r = httpx.post(live.url + "/tokenize", json={"model": MODEL_NAME, "prompt": "AB"}).json()
    assert r["tokens"][-2:] == [65, 66] and r["count"] == len(r["tokens"]) and r["max_model_len"] == 128
    chat = httpx.post(live.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == [258, ord("h"), ord("i"), 257, 259]  # <|user|>hi<|eos|><|assistant|>
    assert httpx.post(live.url + "/detokenize", json={"tokens": [72, 105]}).json() == {"prompt": "Hi"}


def test_health_and_version(live):
    import httpx
    assert httpx.get(live.url + "/health").status_code == 200
    assert httpx.get(live.url + "/version").json()["version"]
