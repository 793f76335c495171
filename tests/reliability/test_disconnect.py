"""A storm of clients that drop at random points: every page comes back, nothing is logged as an error."""

from __future__ import annotations

import asyncio
import random

import httpx

from tests.reliability.conftest import MODEL_NAME, SLOW_MARKER
from tests.reliability.sse import stream

NUM_CLIENTS = 100
LONG_PROMPT = "a prompt long enough to be prefilled in chunks " * 4  # sliced to 80-100 tokens: many share the 256-token step budget, so prefill is chunked


def _body(rng: random.Random, i: int, long_prompt: bool) -> dict:
    prompt = (LONG_PROMPT[: rng.randint(80, 100)] if long_prompt else f"client {i}") + f" {SLOW_MARKER}"
    return dict(model=MODEL_NAME, prompt=prompt, max_tokens=rng.randint(20, 60) if not long_prompt else 16,
                temperature=rng.choice([0, 0.9]), ignore_eos=True, n=rng.choice([1, 1, 2]))


async def _drop(client: httpx.AsyncClient, rng: random.Random, i: int) -> str:
    """One client that leaves at a random point; returns how it left."""
    how = rng.choice(["before_first_token", "mid_stream", "during_prefill", "non_stream"])
    if how == "mid_stream":
        await stream(client, "/v1/completions", _body(rng, i, False), max_events=rng.randint(1, 5))
        return how
    if how == "before_first_token":
        async with client.stream("POST", "/v1/completions", json={**_body(rng, i, False), "stream": True}):
            pass  # headers only: the connection closes before any token is read
        return how
    body = _body(rng, i, how == "during_prefill")
    if how == "during_prefill":
        body["stream"] = True
    task = asyncio.ensure_future(client.post("/v1/completions", json=body))
    await asyncio.sleep(rng.uniform(0.0, 0.05))
    task.cancel()  # the socket closes wherever the request is: sent, queued, prefilling or decoding
    try:
        await task
    except (asyncio.CancelledError, httpx.HTTPError):
        pass
    return how


def test_disconnect_storm_frees_every_page_without_errors(rel, error_logs):
    rng = random.Random(8)

    async def storm():
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 8)
        async with httpx.AsyncClient(base_url=rel.url, limits=limits, timeout=60) as client:
            ways = await asyncio.gather(*(_drop(client, rng, i) for i in range(NUM_CLIENTS)))
            survivor = await stream(client, "/v1/completions", dict(model=MODEL_NAME, prompt="still serving",
                                                                    max_tokens=4, temperature=0))
        return ways, survivor

    ways, survivor = asyncio.run(storm())
    assert set(ways) == {"before_first_token", "mid_stream", "during_prefill", "non_stream"}
    assert survivor.done and not survivor.errors
    rel.wait_pages_free(timeout=20)
    rel.engine.engine.scheduler.check_invariants()
    assert not error_logs.errors(), error_logs.errors()
