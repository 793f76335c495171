"""Faults injected through LLMEngine's `fault_injector` hook fail only the requests they hit."""

from __future__ import annotations

import asyncio

import httpx
import jax.numpy as jnp

from tests.reliability.conftest import (MODEL_NAME, NAN_MARKER, RAISE_MARKER, SLOW_MARKER, FailBeforeForward,
                                        greedy_outputs, make_engine)
from tests.reliability.sse import assert_error_shape, stream

GREEDY = dict(model=MODEL_NAME, temperature=0, ignore_eos=True)


def _completion(prompt: str, max_tokens: int = 8) -> dict:
    return {**GREEDY, "prompt": prompt, "max_tokens": max_tokens}


def test_step_exception_fails_its_requests_and_the_server_goes_on(rel, error_logs):
    errors_before = rel.engine.stats()["num_step_errors"]
    with httpx.Client(base_url=rel.url, timeout=60) as client:
        bad = client.post("/v1/completions", json=_completion(f"x {RAISE_MARKER} y"))
        assert bad.status_code == 500
        assert assert_error_shape(bad.json())["type"] == "InternalServerError"
        good = client.post("/v1/completions", json=_completion("after the fault"))
        assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] == "length"
    assert rel.engine.stats()["num_step_errors"] == errors_before + 1
    assert any("engine step failed" in e for e in error_logs.errors())  # logged once, with the traceback
    rel.wait_pages_free()


def test_step_exception_mid_stream_ends_streams_with_an_error_chunk(rel):
    async def scenario():
        async with httpx.AsyncClient(base_url=rel.url, timeout=60) as client:
            victim = asyncio.ensure_future(stream(client, "/v1/completions", _completion(f"long {SLOW_MARKER}", 100)))
            await asyncio.sleep(0.5)  # the victim (2 s of slow steps) is decoding when the faulty request joins the batch
            bad = await stream(client, "/v1/completions", _completion(RAISE_MARKER, 4))
            return await victim, bad

    victim, bad = asyncio.run(scenario())
    for result in (victim, bad):
        assert result.status == 200 and result.done
        assert [assert_error_shape({"error": e})["code"] for e in result.errors] == [500]
    rel.wait_pages_free()


def test_nan_logits_fail_only_that_request(rel):
    async def scenario():
        async with httpx.AsyncClient(base_url=rel.url, timeout=60) as client:
            alone = await client.post("/v1/completions", json=_completion("a healthy prompt", 24))
            together = await asyncio.gather(
                client.post("/v1/completions", json=_completion("a healthy prompt", 24)),
                client.post("/v1/completions", json=_completion(f"sick {NAN_MARKER}", 24)),
                stream(client, "/v1/completions", _completion(f"sick stream {NAN_MARKER}", 24)))
            return alone, together

    nan_rows = rel.faults.nan_rows
    alone, (healthy, sick, sick_stream) = asyncio.run(scenario())
    assert rel.faults.nan_rows > nan_rows
    assert healthy.status_code == 200 and healthy.json()["choices"] == alone.json()["choices"]
    assert sick.status_code == 500 and assert_error_shape(sick.json())["code"] == 500
    assert sick_stream.done and [e["code"] for e in sick_stream.errors] == [500]
    rel.wait_pages_free()


def test_nan_row_finishes_with_reason_error_at_the_engine(rel_llm):
    from jaxpaged.sampling_params import SamplingParams

    async def run():
        params = SamplingParams(temperature=0, max_tokens=5)
        return [o async for o in rel_llm.generate("nan-direct", f"p {NAN_MARKER}", params)]

    outputs = asyncio.run(run())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "error"
    assert outputs[-1].outputs[0].token_ids == []  # the garbage token is never appended


def test_a_step_failing_before_the_forward_resets_the_prefix_cache(tiny_path, nocache_engine):
    """The step that fails was scheduled, so its prompt's full pages are already hashed in the prefix cache,
    but the forward never ran: their KV was never written. The pool is NaN (nothing in use), so a later
    request with the same prefix that took those pages would read NaN and fail. After the reset it is
    computed afresh and equals the answer computed without prefix caching."""
    from jaxpaged.engine.async_llm import AsyncLLM
    from jaxpaged.worker.step_input import KVPool
    from jaxpaged.sampling_params import SamplingParams

    engine = make_engine(tiny_path, warmup=False)
    fault = FailBeforeForward(engine, "doomed")
    kv = engine.runner.kv
    engine.runner.kv = KVPool(jnp.full_like(kv.k, jnp.nan), jnp.full_like(kv.v, jnp.nan))
    prefix = [(7 * i + 3) % 250 for i in range(40)]  # 2 full pages of 16 tokens, and 8 more
    later = prefix + [11, 12, 13]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = AsyncLLM(engine)

    async def run(request_id, prompt):
        return [o async for o in llm.generate(request_id, prompt, params)][-1]

    try:
        doomed = asyncio.run(run("doomed", prefix + [1, 2]))
        assert fault.raised == 1 and doomed.outputs[0].finish_reason == "error"
        hits = engine.scheduler.pool.prefix_cache_hits
        after = asyncio.run(run("after", later))
    finally:
        llm.shutdown()
    expected = greedy_outputs(nocache_engine, [later], 8)[0]
    assert (after.outputs[0].finish_reason, after.outputs[0].token_ids) == ("length", expected.token_ids)
    assert engine.scheduler.pool.prefix_cache_hits == hits  # nothing of the failed step was found
