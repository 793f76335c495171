"""Bad input gets the right status and OpenAI's error body; the API key guards what it should."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import API_KEY, MODEL_NAME

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
CMPL = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 4}

# (name, method, path, json body (None: no body), status, expected param or None)
CASES = [
    ("chat temperature < 0", "POST", "/v1/chat/completions", {**CHAT, "temperature": -0.5}, 400, "temperature"),
    ("chat top_p > 1", "POST", "/v1/chat/completions", {**CHAT, "top_p": 1.5}, 400, "top_p"),
    ("chat top_p = 0", "POST", "/v1/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p"),
    ("chat top_k < -1", "POST", "/v1/chat/completions", {**CHAT, "top_k": -5}, 400, "top_k"),
    ("chat top_logprobs > 20", "POST", "/v1/chat/completions",
     {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat top_logprobs without logprobs", "POST", "/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("chat empty messages", "POST", "/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages"),
    ("chat unknown role", "POST", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    ("chat image part", "POST", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages"),
    ("chat missing messages", "POST", "/v1/chat/completions", {"model": MODEL_NAME}, 400, "messages"),
    ("chat n = 0", "POST", "/v1/chat/completions", {**CHAT, "n": 0}, 400, "n"),
    ("chat max_tokens = 0", "POST", "/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("chat json_schema without schema", "POST", "/v1/chat/completions",
     {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400, "response_format"),
    ("chat invalid json schema", "POST", "/v1/chat/completions",
     {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 3}}}},
     400, "response_format"),
    ("chat two constraints", "POST", "/v1/chat/completions", {**CHAT, "guided_regex": "a", "guided_choice": ["a"]},
     400, "guided_choice"),
    ("chat tool_choice names a missing tool", "POST", "/v1/chat/completions",
     {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ("chat auto tool choice not enabled", "POST", "/v1/chat/completions",
     {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),
    ("completions bad regex", "POST", "/v1/completions", {**CMPL, "structured_outputs": {"regex": "(x"}}, 400,
     "structured_outputs"),
    ("chat beyond context", "POST", "/v1/chat/completions", {**CHAT, "max_tokens": 500}, 400, "messages"),
    ("chat stream_options without stream", "POST", "/v1/chat/completions",
     {**CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("chat unknown model", "POST", "/v1/chat/completions", {**CHAT, "model": "gpt-17"}, 404, "model"),
    ("completions logprobs > 5", "POST", "/v1/completions", {**CMPL, "logprobs": 6}, 400, "logprobs"),
    ("completions suffix", "POST", "/v1/completions", {**CMPL, "suffix": "end"}, 400, "suffix"),
    ("completions best_of != n", "POST", "/v1/completions", {**CMPL, "best_of": 3}, 400, "best_of"),
    ("completions beyond context", "POST", "/v1/completions", {**CMPL, "prompt": "x" * 100, "max_tokens": 100},
     400, "prompt"),
    ("completions empty prompt list", "POST", "/v1/completions", {**CMPL, "prompt": []}, 400, "prompt"),
    ("completions empty prompt", "POST", "/v1/completions", {**CMPL, "prompt": ""}, 400, "prompt"),
    ("completions ids outside vocab", "POST", "/v1/completions", {**CMPL, "prompt": [1, 999999]}, 400, "prompt"),
    ("completions empty stop", "POST", "/v1/completions", {**CMPL, "stop": [""]}, 400, "stop"),
    ("completions logit_bias outside vocab", "POST", "/v1/completions", {**CMPL, "logit_bias": {"99999": 1}},
     400, "logit_bias"),
    ("chat logit_bias outside vocab", "POST", "/v1/chat/completions", {**CHAT, "logit_bias": {"99999": 1}},
     400, "logit_bias"),  # the engine's typed error keeps its param (only "prompt" becomes "messages")
    ("completions stop_token_ids outside vocab", "POST", "/v1/completions",
     {**CMPL, "stop_token_ids": [99999]}, 400, "stop_token_ids"),
    ("completions repetition_penalty 0", "POST", "/v1/completions", {**CMPL, "repetition_penalty": 0}, 400,
     "repetition_penalty"),
    ("completions min_tokens > max_tokens", "POST", "/v1/completions", {**CMPL, "min_tokens": 9}, 400,
     "min_tokens"),
    ("completions wrong prompt type", "POST", "/v1/completions", {**CMPL, "prompt": {"a": 1}}, 400, "prompt"),
    ("completions unknown model", "POST", "/v1/completions", {**CMPL, "model": "nope"}, 404, "model"),
    ("detokenize outside vocab", "POST", "/detokenize", {"tokens": [5, 100000]}, 400, "tokens"),
    ("tokenize neither prompt nor messages", "POST", "/tokenize", {}, 400, "prompt"),
    ("unknown route", "GET", "/v1/nothing-here", None, 404, None),
    ("wrong method", "GET", "/v1/chat/completions", None, 405, None),
]


@pytest.fixture(scope="module")
def http(live):
    with httpx.Client(base_url=live.url, timeout=30) as client:
        yield client


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] in (status, "model_not_found")
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize("name,method,path,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_input(http, name, method, path, body, status, param):
    assert_openai_error(http.request(method, path, json=body), status, param)


def test_invalid_json_is_400(http):
    r = http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


def test_sdk_raises_bad_request(live):
    import openai
    with pytest.raises(openai.BadRequestError) as err:
        live.openai().chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
                                              temperature=-1)
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        live.openai().completions.create(model="not-served", prompt="x")


def test_streaming_request_error_is_a_plain_400(http):
    r = http.post("/v1/chat/completions", json={**CHAT, "stream": True, "temperature": -1})
    assert_openai_error(r, 400, "temperature")


def test_oversized_body_413(live_with_key):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    big = {**CMPL, "prompt": "x" * (100 * 1024)}  # the keyed app caps bodies at 64 KiB
    r = httpx.post(live_with_key.v1 + "/completions", json=big, headers=headers)
    assert_openai_error(r, 413)

    def chunks():  # no Content-Length: the streamed bytes are counted
        yield b'{"prompt": "'
        for _ in range(100):
            yield b"x" * 1024
        yield b'"}'

    r = httpx.post(live_with_key.v1 + "/completions", content=chunks(),
                   headers={**headers, "content-type": "application/json"})
    assert_openai_error(r, 413)


@pytest.mark.parametrize("path,method", [("/v1/models", "GET"), ("/v1/chat/completions", "POST"),
                                         ("/v1/completions", "POST"), ("/tokenize", "POST"),
                                         ("/detokenize", "POST"), ("/metrics", "GET")])
@pytest.mark.parametrize("key", [None, "wrong-key"])
def test_api_key_required(live_with_key, path, method, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.request(method, live_with_key.url + path, json={}, headers=headers)
    assert_openai_error(r, 401)


def test_api_key_accepted_and_health_open(live_with_key):
    import openai
    assert httpx.get(live_with_key.url + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        live_with_key.openai("wrong").models.list()
    client = live_with_key.openai(API_KEY)
    assert client.models.list().data[0].id == MODEL_NAME
    r = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    assert r.usage.completion_tokens >= 1
    ok = httpx.get(live_with_key.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200


@pytest.fixture
def failing_steps(live, monkeypatch):
    """Every engine step raises (as a device error would) while the test runs."""
    def broken_step():
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(live.engine.engine, "step", broken_step)


def test_engine_failure_is_a_500_and_the_server_survives(http, live, failing_steps, monkeypatch):
    assert_openai_error(http.post("/v1/completions", json=CMPL), 500)
    r = http.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and '"error"' in events[-2]
    monkeypatch.undo()
    assert http.post("/v1/completions", json=CMPL).status_code == 200
    assert live.wait_idle()["kv_cache_usage"] == 0.0
