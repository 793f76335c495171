"""Load and overload: many concurrent streams complete with exact usage; a full queue answers 503 at once."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import psutil
import pytest

from jaxpaged.engine.async_llm import AsyncLLM, AsyncLLMConfig
from server.app import build_app
from server.config import ServerConfig
from tests.reliability.conftest import MODEL_NAME, SLOW_MARKER, FaultInjector, make_engine
from tests.reliability.sse import assert_error_shape, stream
from tests.server.conftest import serve

NUM_CLIENTS = 256
ROUNDS = 3
RSS_GROWTH_BOUND = 50 << 20
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "kv", "page", "jax"]


def _request(rng: random.Random, i: int) -> tuple[str, dict, int, int]:
    """(path, body, n, max_tokens) of client i: chat or completion, mixed lengths and sampling params."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))) + f" #{i}"
    n, max_tokens = rng.choice([1, 1, 1, 2]), rng.randint(1, 6)
    sampling = rng.choice([dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=i),
                           dict(temperature=1.0, top_k=5), dict(temperature=0.7, min_p=0.1, presence_penalty=0.5),
                           dict(temperature=0, repetition_penalty=1.2)])
    body = dict(model=MODEL_NAME, n=n, max_tokens=max_tokens, ignore_eos=True,
                stream_options={"include_usage": True}, **sampling)
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": prompt}, n, max_tokens
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}, n, max_tokens


def _prompt_tokens(rel, path: str, body: dict) -> int:
    tokenizer = rel.engine.engine.tokenizer
    if path == "/v1/completions":
        return len(tokenizer(body["prompt"])["input_ids"])
    text = tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


async def _round(rel, seed: int) -> None:
    rng = random.Random(seed)
    requests = [_request(rng, i) for i in range(NUM_CLIENTS)]
    limits = httpx.Limits(max_connections=NUM_CLIENTS + 8, max_keepalive_connections=NUM_CLIENTS + 8)
    async with httpx.AsyncClient(base_url=rel.url, limits=limits, timeout=120) as client:
        results = await asyncio.gather(*(stream(client, path, body) for path, body, _, _ in requests))
    for (path, body, n, max_tokens), result in zip(requests, results):
        assert result.status == 200 and result.done and not result.errors, (path, body, result)
        usage = result.usage
        assert usage["completion_tokens"] == n * max_tokens, (body, usage)
        assert usage["prompt_tokens"] == _prompt_tokens(rel, path, body), (body, usage)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_256_concurrent_streams_three_rounds_no_leaks(rel):
    """A warm-up round (one-time compiles, allocator pools), then ROUNDS measured ones."""
    rss = []
    for round_index in range(ROUNDS + 1):
        start = time.monotonic()
        asyncio.run(_round(rel, seed=round_index))
        stats = rel.wait_idle(timeout=10)
        assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0
        rel.wait_pages_free()
        assert rel.engine.stats()["kv_cache_usage"] == 0.0  # cached prefix pages stay, unreferenced
        if round_index:
            rss.append(psutil.Process().memory_info().rss)
        print(f"round {round_index}: {time.monotonic() - start:.1f}s, rss {psutil.Process().memory_info().rss >> 20} MiB")
    assert rss[2] <= rss[0] + RSS_GROWTH_BOUND, [r >> 20 for r in rss]
    assert rel.engine.stats()["peak_num_requests_running"] > 16  # the batch really was concurrent


@pytest.fixture(scope="module")
def small_queue(tiny_path):
    """2 running + at most 4 waiting sequences; every step of a <<slow>> request takes 20 ms more."""
    faults = FaultInjector()
    llm = AsyncLLM(make_engine(tiny_path, faults, max_num_seqs=2), AsyncLLMConfig(max_waiting_requests=4))
    with serve(build_app(llm, ServerConfig(served_model_names=(MODEL_NAME,)))) as url:
        yield url, llm
    llm.shutdown()


async def _timed_post(client: httpx.AsyncClient, body: dict) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    response = await client.post("/v1/completions", json=body)
    return response, time.monotonic() - start


def test_full_queue_answers_503_with_retry_after_at_once_then_recovers(small_queue):
    url, llm = small_queue
    body = dict(model=MODEL_NAME, prompt=f"busy {SLOW_MARKER}", max_tokens=20, temperature=0, ignore_eos=True)

    async def burst():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.gather(*(_timed_post(client, body) for _ in range(16)))

    results = asyncio.run(burst())
    ok = [r for r, _ in results if r.status_code == 200]
    rejected = [(r, t) for r, t in results if r.status_code == 503]
    assert len(ok) + len(rejected) == len(results)
    assert len(ok) >= 4 and rejected  # at least the 4 waiting slots are taken
    for response, seconds in rejected:
        assert response.headers["retry-after"] == "1"
        assert assert_error_shape(response.json())["code"] == "queue_full"
        assert seconds < 1.0, seconds  # at once, not after a timeout (a full run takes >= 20 x 20 ms)
    assert all(r.json()["usage"]["completion_tokens"] == 20 for r in ok)
    deadline = time.monotonic() + 10
    while llm.stats()["num_requests_waiting"] or llm.stats()["num_requests_running"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    again = httpx.post(url + "/v1/completions", json={**body, "prompt": "recovered"}, timeout=60)
    assert again.status_code == 200
