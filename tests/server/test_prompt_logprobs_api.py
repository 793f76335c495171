"""Prompt log-probabilities over HTTP: /v1/completions echo (alone, with logprobs, with max_tokens=0) in
OpenAI's legacy format, and vLLM's prompt_logprobs on both endpoints; equal to a plain full forward."""

from __future__ import annotations

import json

import httpx
import jax
import numpy as np
import pytest

from jaxpaged.models import llama
from jaxpaged.models.loader import load_model
from tests.server.conftest import MODEL_NAME

# longer than the server's 64-token step budget: prefilled in two chunks
PROMPT = np.random.default_rng(3).integers(32, 127, size=100).tolist()
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def reference(live):
    """Per prompt position j >= 1: log_softmax of a plain f32 forward, the distribution of token j."""
    model = load_model(live.model_path, dtype="float32")
    logits = llama.forward(model.config, model.params, np.asarray([PROMPT], np.int32))[0]
    return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def post(live, path: str, body: dict) -> dict:
    r = httpx.post(live.v1 + path, json={"model": MODEL_NAME, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def check_echo(logprobs: dict, reference, k: int) -> None:
    n = len(PROMPT)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["text_offset"][0] == 0
    for j in range(1, n):
        assert logprobs["token_logprobs"][j] == pytest.approx(reference[j - 1][PROMPT[j]], abs=1e-4), j
        top = logprobs["top_logprobs"][j]  # keyed by text: the tiny tokenizer's bytes >= 128 all read "\ufffd"
        want = np.sort(reference[j - 1])[::-1][:k]
        assert top and all(np.min(np.abs(want - v)) < 1e-4 or v == logprobs["token_logprobs"][j]
                           for v in top.values()), j
    assert "".join(logprobs["tokens"][:n]) == "".join(chr(t) for t in PROMPT)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(live, reference, stream):
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2, "stream": stream}
    if not stream:
        out = post(live, "/completions", body)
        (choice,) = out["choices"]
        assert out["usage"] == {"prompt_tokens": 100, "completion_tokens": 0, "total_tokens": 100}
        logprobs, text, finish = choice["logprobs"], choice["text"], choice["finish_reason"]
    else:
        with httpx.stream("POST", live.v1 + "/completions", json={"model": MODEL_NAME, **body}, timeout=120) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        choices = [c["choices"][0] for c in chunks]
        text = "".join(c["text"] for c in choices)
        logprobs = {k: sum((c["logprobs"][k] for c in choices if c["logprobs"]), []) for k in
                    ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        finish = choices[-1]["finish_reason"]
    assert text == "".join(chr(t) for t in PROMPT) and finish == "length"
    assert len(logprobs["tokens"]) == 100
    check_echo(logprobs, reference, 2)
    assert logprobs["text_offset"] == list(range(100))
    live.wait_idle()


def test_echo_logprobs_and_prompt_logprobs_agree_even_after_a_prefix_cache_hit(live, reference):
    post(live, "/completions", {"prompt": PROMPT, "max_tokens": 1})  # caches the prompt's pages
    out = post(live, "/completions", {"prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 1,
                                      "prompt_logprobs": 1, "temperature": 0, **NO_EOS})
    (choice,) = out["choices"]
    logprobs, prompt_lps = choice["logprobs"], choice["prompt_logprobs"]
    assert len(logprobs["tokens"]) == 103 and len(prompt_lps) == 100 and prompt_lps[0] is None
    check_echo(logprobs, reference, 1)
    for j in range(1, 100):
        entry = prompt_lps[j][str(PROMPT[j])]
        assert entry["logprob"] == logprobs["token_logprobs"][j]
        assert entry["rank"] == int(np.sum(reference[j - 1] > reference[j - 1][PROMPT[j]])) + 1
    assert choice["text"].startswith("".join(chr(t) for t in PROMPT)) and len(choice["text"]) > 100
    assert logprobs["text_offset"][100] == 100  # the generated tokens follow the echoed prompt
    assert out["usage"]["completion_tokens"] == 3
    live.wait_idle()


def test_echo_alone_and_chat_prompt_logprobs(live):
    out = post(live, "/completions", {"prompt": "hello", "max_tokens": 2, "echo": True, **NO_EOS})
    assert out["choices"][0]["text"].startswith("hello") and out["choices"][0]["logprobs"] is None
    chat = post(live, "/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                            "prompt_logprobs": 0})
    lps = chat["prompt_logprobs"]
    assert lps[0] is None and len(lps) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in lps[1:])


@pytest.mark.parametrize("body, param", [({"max_tokens": 0}, "max_tokens"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
                                         ({"prompt_logprobs": -1}, "prompt_logprobs")])
def test_bad_prompt_logprob_requests_are_400(live, body, param):
    r = httpx.post(live.v1 + "/completions", json={"model": MODEL_NAME, "prompt": "x", **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
