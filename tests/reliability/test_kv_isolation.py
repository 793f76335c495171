"""KV exhaustion (preemption keeps greedy outputs exact), isolation between requests, masked garbage pages."""

from __future__ import annotations

import asyncio
import json

import httpx
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.worker.step_input import KVPool
from jaxpaged.sampling_params import SamplingParams
from tests.reliability.conftest import MODEL_NAME, greedy_outputs, make_engine
from tests.reliability.sse import assert_error_shape

PROMPTS = [f"request number {i}: " + "tell me about pages " * (1 + i % 3) for i in range(6)]
MAX_TOKENS = 40
MAX_STEPS = 2000


def _run_to_completion(engine, prompts, params) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    done: dict[str, list[int]] = {}
    for _ in range(MAX_STEPS):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            return done
    raise AssertionError(f"not finished after {MAX_STEPS} steps")


async def _reference(llm, prompts, params) -> dict[str, list[int]]:
    """Greedy outputs of the big-pool engine, one request at a time."""
    refs = {}
    for i, prompt in enumerate(prompts):
        outs = [o async for o in llm.generate(f"ref-{id(prompts)}-{i}", prompt, params)]
        refs[f"r{i}"] = outs[-1].outputs[0].token_ids
    return refs


@pytest.fixture(scope="module")
def small_pool(tiny_path):
    """9 usable pages of 16 tokens (one max_model_len sequence) for 6 requests of ~60 tokens each."""
    return make_engine(tiny_path, num_pages=10, max_num_seqs=6, max_num_batched_tokens=64)


def test_kv_exhaustion_preempts_and_matches_the_unconstrained_run(small_pool, rel_llm):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    preemptions = small_pool.scheduler.num_preemptions
    got = _run_to_completion(small_pool, PROMPTS, params)
    assert small_pool.scheduler.num_preemptions > preemptions  # the pool really ran out
    assert got == asyncio.run(_reference(rel_llm, PROMPTS, params))
    pool = small_pool.scheduler.pool
    assert pool.num_free_pages == pool.num_usable_pages


def test_garbage_in_unused_kv_pages_is_never_read(small_pool, rel_llm):
    """NaN in every page not in use (all of them, null page included): outputs stay exact and finite."""
    pool = small_pool.scheduler.pool
    assert pool.num_free_pages == pool.num_usable_pages and pool.reset_prefix_cache()
    kv = small_pool.runner.kv
    small_pool.runner.kv = KVPool(jnp.full_like(kv.k, jnp.nan), jnp.full_like(kv.v, jnp.nan))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    got = _run_to_completion(small_pool, PROMPTS[:3], params)
    assert got == asyncio.run(_reference(rel_llm, PROMPTS[:3], params))


def test_request_larger_than_the_model_length_is_a_400_at_once(rel):
    with httpx.Client(base_url=rel.url, timeout=10) as client:
        for body in (dict(prompt="x" * 200, max_tokens=1), dict(prompt="short", max_tokens=10**6),
                     dict(prompt=[1] * 120, max_tokens=20)):
            response = client.post("/v1/completions", json={"model": MODEL_NAME, **body})
            assert response.status_code == 400, response.text
            assert "max_model_len" in assert_error_shape(response.json())["message"]
            assert response.elapsed.total_seconds() < 1.0


def _chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])  # the template wrote any BOS itself


def test_shared_system_prompt_does_not_leak_between_users(rel, nocache_engine):
    """Prefix caching shares the system prompt's pages; each user's answer, alone or among 8 concurrent ones,
    equals the answer computed WITHOUT prefix caching (from the chat template's token ids, on the engine)."""
    system = {"role": "system", "content": "You are a careful assistant. " * 3}  # > 2 pages of 16 tokens
    questions = ["what is alpha?", "and beta, then?"]

    def body(question: str) -> dict:
        return dict(model=MODEL_NAME, temperature=0, max_tokens=12, ignore_eos=True,
                    messages=[system, {"role": "user", "content": question}])

    async def scenario():
        async with httpx.AsyncClient(base_url=rel.url, timeout=60) as client:
            alone = [await client.post("/v1/chat/completions", json=body(q)) for q in questions]
            together = await asyncio.gather(*(client.post("/v1/chat/completions", json=body(q))
                                              for q in questions * 4))
            return alone, together

    hits = rel.engine.stats()["prefix_cache_hits"]
    alone, together = asyncio.run(scenario())
    assert rel.engine.stats()["prefix_cache_hits"] > hits  # the system prompt really was shared
    tokenizer = nocache_engine.tokenizer
    prompts = [_chat_ids(tokenizer, body(q)["messages"]) for q in questions]
    expected = [o.text for o in greedy_outputs(nocache_engine, prompts, 12)]
    content = [r.json()["choices"][0]["message"]["content"] for r in (*alone, *together)]
    assert content == expected + expected * 4


def test_identical_pages_after_different_prefixes_are_not_shared(rel, nocache_engine):
    """Chained page hashes: a page's KV depends on every token before it, so a page of identical tokens after
    a different prefix (or at another position) must not be shared. Prompts are token ids aligned to the
    16-token pages: A B C, B C (B and C at other positions), D B C, A B D, C A B; first one after another
    (each finds the earlier ones cached), then all at once. Every answer equals the one computed without
    prefix caching."""
    rng = np.random.default_rng(20)
    a, b, c, d = (rng.integers(0, 250, 16).tolist() for _ in range(4))
    tail = [5, 6, 7]
    prompts = [a + b + c + tail, b + c + tail, d + b + c + tail, a + b + d + tail, c + a + b + tail, a + b + c + [9]]
    expected = [o.token_ids for o in greedy_outputs(nocache_engine, prompts, 10)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    async def generate(i, prompt, tag):
        return [o async for o in rel.engine.generate(f"chain-{tag}-{i}", prompt, params)][-1]

    async def scenario():
        one_by_one = [await generate(i, p, "seq") for i, p in enumerate(prompts)]
        together = await asyncio.gather(*(generate(i, p, "par") for i, p in enumerate(prompts)))
        return one_by_one, together

    hits = rel.engine.stats()["prefix_cache_hits"]
    one_by_one, together = asyncio.run(scenario())
    assert rel.engine.stats()["prefix_cache_hits"] > hits  # a b c + [9], and the second round, were shared
    assert [o.outputs[0].token_ids for o in one_by_one] == expected
    assert [o.outputs[0].token_ids for o in together] == expected
    assert [o.num_cached_tokens for o in one_by_one] == [0, 0, 0, 32, 0, 48]


def test_chat_over_http_equals_the_engines_greedy_output(rel, nocache_engine):
    """The chat endpoint (template, tokenization, detokenization, streaming or not) answers exactly what the
    engine answers greedily for the chat template's token ids."""
    messages = [{"role": "user", "content": "tell me a story about a paged cache"}]
    body = dict(model=MODEL_NAME, messages=messages, temperature=0, max_tokens=20, ignore_eos=True)
    with httpx.Client(base_url=rel.url, timeout=60) as client:
        plain = client.post("/v1/chat/completions", json=body).json()
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    expected = greedy_outputs(nocache_engine, [_chat_ids(nocache_engine.tokenizer, messages)], 20)[0]
    assert expected.text and len(expected.token_ids) == 20
    assert plain["choices"][0]["message"]["content"] == expected.text
    assert plain["usage"]["completion_tokens"] == 20
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == expected.text
