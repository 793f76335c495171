"""KV exhaustion (preemption keeps greedy outputs exact), isolation between requests, masked garbage pages."""

from __future__ import annotations

import asyncio

import httpx
import jax.numpy as jnp
import pytest

from jaxpaged.model_runner import KVPool
from jaxpaged.sampling_params import SamplingParams
from tests.reliability.conftest import MODEL_NAME, make_engine
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


def test_shared_system_prompt_does_not_leak_between_users(rel):
    """Prefix caching shares the system prompt's pages; each user's answer equals its answer alone."""
    system = {"role": "system", "content": "You are a careful assistant. " * 3}  # > 2 pages of 16 tokens

    def body(question: str) -> dict:
        return dict(model=MODEL_NAME, temperature=0, max_tokens=12, ignore_eos=True,
                    messages=[system, {"role": "user", "content": question}])

    async def scenario():
        async with httpx.AsyncClient(base_url=rel.url, timeout=60) as client:
            alone_a = await client.post("/v1/chat/completions", json=body("what is alpha?"))
            alone_b = await client.post("/v1/chat/completions", json=body("and beta, then?"))
            together = await asyncio.gather(*(client.post("/v1/chat/completions", json=body(q))
                                              for q in ["what is alpha?", "and beta, then?"] * 4))
            return alone_a, alone_b, together

    hits = rel.engine.stats()["prefix_cache_hits"]
    alone_a, alone_b, together = asyncio.run(scenario())
    content = [r.json()["choices"][0]["message"]["content"] for r in (alone_a, alone_b, *together)]
    assert content[2::2] == [content[0]] * 4 and content[3::2] == [content[1]] * 4
    assert rel.engine.stats()["prefix_cache_hits"] > hits  # the system prompt really was shared
