"""AsyncLLM's threading contract, against a scripted fake engine (fast, deterministic)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from jaxpaged.engine.async_llm import AsyncLLM, EngineShutdownError
from jaxpaged.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxpaged.sampling_params import SamplingParams


class FakeEngine:
    """One token per request per step; `fail_next` makes the next step raise."""

    def __init__(self):
        self.requests: dict[str, tuple[int, list[int]]] = {}
        self.aborted: list[str] = []
        self.steps = 0
        self.fail_next = False
        self.threads: set[str] = set()
        self.shutdowns: list[str] = []  # the thread of each LLMEngine.shutdown call

    def add_request(self, request_id, prompt, params):
        self.threads.add(threading.current_thread().name)
        if not prompt:
            raise ValueError("empty prompt")
        self.requests[request_id] = (params.max_tokens, [])

    def abort_request(self, ids):
        for rid in [ids] if isinstance(ids, str) else ids:
            if self.requests.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def is_request_running(self, request_id):
        return request_id in self.requests  # every request is in the batch

    def reset_prefix_cache(self):
        return True

    def step(self):
        self.threads.add(threading.current_thread().name)
        self.steps += 1
        time.sleep(0.002)
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("boom")
        outputs = []
        for rid, (max_tokens, tokens) in list(self.requests.items()):
            tokens.append(len(tokens))
            done = len(tokens) >= max_tokens
            comp = CompletionOutput(0, "x" * len(tokens), list(tokens), 0.0, None, "length" if done else None)
            outputs.append(RequestOutput(rid, "p", [1], [comp], done, RequestMetrics(arrival_time=0.0)))
            if done:
                del self.requests[rid]
        return outputs

    def shutdown(self):
        self.shutdowns.append(threading.current_thread().name)

    def stats(self):
        return {"num_requests_running": len(self.requests), "num_requests_waiting": 0, "kv_cache_usage": 0.0,
                "num_preemptions": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0}


@pytest.fixture
def fake():
    engine = FakeEngine()
    llm = AsyncLLM(engine)
    yield engine, llm
    llm.shutdown()


async def _collect(llm, rid, prompt="p", max_tokens=3):
    return [o async for o in llm.generate(rid, prompt, SamplingParams(max_tokens=max_tokens))]


def test_generate_streams_until_finished_on_the_engine_thread(fake):
    engine, llm = fake
    outs = asyncio.run(_collect(llm, "a", max_tokens=4))
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 4] and outs[-1].finished
    assert engine.threads == {"jaxpaged-engine"}


def test_add_error_is_raised_in_the_caller(fake):
    _, llm = fake
    with pytest.raises(ValueError, match="empty prompt"):
        asyncio.run(_collect(llm, "bad", prompt=""))
    assert len(asyncio.run(_collect(llm, "good"))) == 3


def test_consumer_leaving_early_aborts(fake):
    engine, llm = fake

    async def first_only():
        async for _ in llm.generate("leaver", "p", SamplingParams(max_tokens=1000)):
            break

    asyncio.run(first_only())
    deadline = time.monotonic() + 2
    while "leaver" not in engine.aborted and time.monotonic() < deadline:
        time.sleep(0.005)
    assert "leaver" in engine.aborted and not engine.requests


def test_cancelled_consumer_aborts(fake):
    engine, llm = fake

    async def cancel_midway():
        task = asyncio.ensure_future(_collect(llm, "cancelled", max_tokens=1000))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    deadline = time.monotonic() + 2
    while "cancelled" not in engine.aborted and time.monotonic() < deadline:
        time.sleep(0.005)
    assert "cancelled" in engine.aborted


def test_failing_step_fails_in_flight_requests_only(fake):
    engine, llm = fake

    async def scenario():
        queue = await llm.add_request("victim", "p", SamplingParams(max_tokens=1000))
        engine.fail_next = True
        outputs = []
        while (out := await llm.next_output(queue)) is not None:
            outputs.append(out)
            if out.finished:
                break
        return outputs

    outputs = asyncio.run(scenario())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "error"
    assert llm.is_running and llm.stats()["num_step_errors"] == 1
    assert asyncio.run(_collect(llm, "after"))[-1].outputs[0].finish_reason == "length"


def test_idle_thread_does_not_step(fake):
    engine, llm = fake
    asyncio.run(_collect(llm, "one"))
    steps = engine.steps
    time.sleep(0.2)
    assert engine.steps == steps


def test_shutdown_ends_streams_and_refuses_new_requests():
    engine = FakeEngine()
    llm = AsyncLLM(engine)

    async def scenario():
        queue = await llm.add_request("long", "p", SamplingParams(max_tokens=10**6))
        await llm.next_output(queue)
        await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
        with pytest.raises(EngineShutdownError):
            while await llm.next_output(queue) is not None:
                pass
        with pytest.raises(EngineShutdownError):
            await llm.add_request("late", "p", SamplingParams())

    asyncio.run(scenario())
    assert not llm.is_running


def test_shutdown_shuts_the_engine_down_once_on_its_thread():
    """LLMEngine.shutdown is what releases multi-host followers: AsyncLLM.shutdown must reach it."""
    engine = FakeEngine()
    llm = AsyncLLM(engine)
    asyncio.run(_collect(llm, "one"))
    llm.shutdown()
    llm.shutdown()
    assert engine.shutdowns == ["jaxpaged-engine"]
