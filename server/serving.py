"""Running engine requests for a handler: submit, merge outputs, stop on disconnect, SSE framing."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from fastapi import Request

from jaxpaged.engine.async_llm import AsyncLLM, EngineShutdownError
from jaxpaged.outputs import RequestOutput
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.errors import InvalidRequestError
from server.errors import ClientDisconnected, OpenAIError, error_body, from_invalid_request
from server.metrics import RequestTracker, ServerMetrics

logger = logging.getLogger(__name__)

DISCONNECT_POLL_SECONDS = 0.1


class Submitted:
    """Engine requests of one HTTP request (one per prompt), added and not yet drained."""

    def __init__(self, engine: AsyncLLM, metrics: ServerMetrics):
        self.engine, self.metrics = engine, metrics
        self.queues: list[tuple[str, asyncio.Queue]] = []
        self.trackers: dict[str, RequestTracker] = {}
        self.unfinished: set[str] = set()

    async def add(self, request_id: str, prompt: Any, params: SamplingParams, prompt_param: str) -> None:
        """Add one engine request; its InvalidRequestError becomes a 400 naming the parameter (a prompt
        problem as `prompt_param`), and the ones added before are aborted."""
        try:
            queue = await self.engine.add_request(request_id, prompt, params)
        except InvalidRequestError as err:
            self.abort()
            raise from_invalid_request(err, prompt_param) from None
        except BaseException:
            self.abort()
            raise
        self.queues.append((request_id, queue))
        self.trackers[request_id] = self.metrics.tracker(params)
        self.unfinished.add(request_id)

    def abort(self) -> None:
        """Abort what has not finished (idempotent) and record what was generated."""
        if self.unfinished:
            self.engine.abort(sorted(self.unfinished))
            self.unfinished.clear()
        for tracker in self.trackers.values():
            tracker.close()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) pairs as the engine produces them; aborts the rest if left early."""
        next_output = self.engine.next_output
        pending = {asyncio.ensure_future(next_output(q)): (i, rid, q) for i, (rid, q) in enumerate(self.queues)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    i, rid, queue = pending.pop(future)
                    output = future.result()
                    if output is None:  # aborted from elsewhere
                        raise OpenAIError(500, f"request {rid} was aborted")
                    self.trackers[rid].on_output(output)
                    yield i, output
                    if output.finished:
                        self.unfinished.discard(rid)
                    else:
                        pending[asyncio.ensure_future(next_output(queue))] = (i, rid, queue)
        finally:
            for future in pending:
                future.cancel()
            self.abort()

    async def final_outputs(self) -> list[RequestOutput]:
        """The finished output of every prompt, in prompt order."""
        finals: dict[int, RequestOutput] = {}
        async for i, output in self.outputs():
            if output.finished:
                finals[i] = output
        return [finals[i] for i in range(len(self.queues))]


async def until_disconnect(request: Request, work: Awaitable, on_disconnect: Callable[[], None]):
    """Await `work`, polling the client; if it leaves, cancel the work and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
            on_disconnect()


def sse(data: dict | str) -> str:
    """One server-sent event."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


async def sse_stream(chunks: AsyncIterator[dict], submitted: Submitted) -> AsyncIterator[str]:
    """SSE framing: every chunk, then `[DONE]`; an error becomes an error chunk before `[DONE]`."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except OpenAIError as err:
        yield sse(err.body())
    except EngineShutdownError as err:  # the server is stopping: a clean end, not a crash
        yield sse(error_body(503, f"the engine is not running: {err}"))
    except Exception as err:  # the stream has started: the status is already 200
        logger.exception("streaming failed")
        yield sse(error_body(500, f"internal server error: {type(err).__name__}: {err}"))
    finally:
        submitted.abort()
    yield sse("[DONE]")


def check_finished_ok(outputs: Sequence[RequestOutput]) -> None:
    """A request the engine failed (finish_reason "error") is a 500."""
    if any(o.finish_reason == "error" for out in outputs for o in out.outputs):
        raise OpenAIError(500, "the engine failed while generating this request; see the server log")


def usage(outputs: Sequence[RequestOutput]) -> dict[str, int]:
    """Token counts of finished outputs (from their metrics: a DELTA output holds only its last tokens)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(o.metrics.num_generation_tokens for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
