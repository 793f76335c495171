"""Faults injected through LLMEngine's `fault_injector` hook fail only the requests they hit."""

from __future__ import annotations

import asyncio

import httpx

from tests.reliability.conftest import MODEL_NAME, NAN_MARKER, RAISE_MARKER, SLOW_MARKER
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
