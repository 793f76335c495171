"""Many clients at once are batched; a client that leaves frees its request at once; /metrics moves."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import MODEL_NAME

NO_EOS = {"ignore_eos": True}


async def _stream_chat(client: httpx.AsyncClient, i: int) -> tuple[str, str | None, bool]:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"client {i}"}], "max_tokens": 12,
            "temperature": 0.8, "seed": i, "stream": True, **NO_EOS}
    text, finish, done = "", None, False
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            choice = json.loads(line[6:])["choices"][0]
            text += choice["delta"].get("content") or ""
            finish = choice["finish_reason"] or finish
    return text, finish, done


def test_32_concurrent_streams_are_batched(live):
    live.wait_idle()
    live.engine.reset_peak_running()

    async def run_all():
        async with httpx.AsyncClient(base_url=live.url, timeout=120,
                                     limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(_stream_chat(client, i) for i in range(32)))

    results = asyncio.run(run_all())
    assert all(done and finish == "length" for _, finish, done in results)
    assert live.engine.stats()["peak_num_requests_running"] > 1
    # each streamed text equals the same seeded request answered whole
    for i in (0, 17, 31):
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"client {i}"}], "max_tokens": 12,
                "temperature": 0.8, "seed": i, **NO_EOS}
        whole = httpx.post(live.v1 + "/chat/completions", json=body, timeout=60).json()
        assert whole["choices"][0]["message"]["content"] == results[i][0]


def _wait_released(live, baseline_usage: float, timeout: float = 1.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        stats = live.engine.stats()
        if stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0 \
                and stats["kv_cache_usage"] == baseline_usage:
            return time.monotonic() - start
        time.sleep(0.01)
    raise AssertionError(f"request still held {timeout}s after the client left: {live.engine.stats()}")


@pytest.fixture
def slow_steps(live, monkeypatch):
    """Each engine step takes >= 20 ms, so a 110-token request outlives the client (the tiny model is fast)."""
    engine = live.engine.engine
    step = engine.step

    def slow_step():
        time.sleep(0.02)
        return step()

    monkeypatch.setattr(engine, "step", slow_step)


def _generation_tokens(live) -> float:
    return _sample(httpx.get(live.url + "/metrics").text, "vllm:generation_tokens_total")


def test_client_dropping_mid_stream_frees_its_request(live, slow_steps):
    baseline = live.wait_idle()["kv_cache_usage"]
    before = _generation_tokens(live)
    body = {"model": MODEL_NAME, "prompt": "a long story", "max_tokens": 110, "stream": True, **NO_EOS}
    with httpx.Client(base_url=live.url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
            assert got and live.engine.stats()["num_requests_running"] == 1
    _wait_released(live, baseline)
    assert _generation_tokens(live) - before < 110  # aborted, not run to the end


def test_client_dropping_a_non_streamed_request_frees_it(live, slow_steps):
    baseline = live.wait_idle()["kv_cache_usage"]
    before = _generation_tokens(live)
    body = {"model": MODEL_NAME, "prompt": "another long story", "max_tokens": 110, **NO_EOS}
    try:
        httpx.post(live.v1 + "/completions", json=body, timeout=0.3)
    except httpx.TimeoutException:
        pass
    _wait_released(live, baseline)
    assert _generation_tokens(live) - before < 110


def _sample(text: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_metrics_parse_and_move(live):
    live.wait_idle()
    expected = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                "vllm:num_preemptions_total", "vllm:request_success_total",
                "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                "vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count"}
    r = httpx.post(live.v1 + "/completions", json={"model": MODEL_NAME, "prompt": [1, 2, 3], "max_tokens": 2,
                                                   **NO_EOS})
    assert r.status_code == 200
    before = httpx.get(live.url + "/metrics").text
    names = {s.name for f in text_string_to_metric_families(before) for s in f.samples}
    assert expected <= names, expected - names
    r = httpx.post(live.v1 + "/completions", json={"model": MODEL_NAME, "prompt": [4, 5, 6, 7], "max_tokens": 5,
                                                   **NO_EOS})
    assert r.status_code == 200
    after = httpx.get(live.url + "/metrics").text

    def delta(name, **labels):
        return _sample(after, name, **labels) - _sample(before, name, **labels)

    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:prompt_tokens_total") == 4
    assert delta("vllm:generation_tokens_total") == 5
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:time_to_first_token_seconds_count") == 1
    assert delta("vllm:inter_token_latency_seconds_count") == 4
    assert delta("vllm:prefix_cache_queries_total") > 0
