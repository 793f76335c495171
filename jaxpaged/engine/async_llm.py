"""AsyncLLM: the synchronous LLMEngine driven by one background thread, used from asyncio.

    event loop (many coroutines)            engine thread (one)
    ----------------------------            -------------------
    add_request / abort  --- commands --->  apply commands between steps
                                            engine.step()
    asyncio.Queue per request <-- call_soon_threadsafe -- RequestOutputs

The engine is not thread-safe, so only the engine thread ever touches it. It
sleeps on a condition variable while there is nothing to do. A failing step
fails only the requests in flight (finish_reason "error") and the thread keeps
serving.

Admission is bounded: beyond `AsyncLLMConfig.max_waiting_requests` sequences
waiting in the scheduler, `add_request` raises QueueFullError at once (the
server answers 503 with Retry-After) instead of letting the queue grow.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jaxpaged.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineShutdownError(RuntimeError):
    """The AsyncLLM was shut down while the request was queued or running."""


class QueueFullError(RuntimeError):
    """The waiting queue is at `max_waiting_requests`: retry later (nothing was queued)."""


DEFAULT_MAX_WAITING_REQUESTS = 1024


@dataclasses.dataclass(frozen=True)
class AsyncLLMConfig:
    """max_waiting_requests: most sequences (n per request) waiting to be scheduled before adds fail."""

    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS

    def __post_init__(self):
        value = self.max_waiting_requests
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"AsyncLLMConfig.max_waiting_requests={value!r}: must be an integer >= 1")


_ABORTED = object()  # stream sentinel: the request was aborted


@dataclasses.dataclass
class _Sink:
    """Where one request's outputs go: an asyncio.Queue on the caller's loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    params: SamplingParams
    last: RequestOutput | None = None

    def put(self, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass


@dataclasses.dataclass
class _Call:
    """A command: fn(), run on the engine thread between steps; its result or error goes to `future` (None:
    nobody waits, as for an abort)."""
    fn: Callable[[], Any]
    future: concurrent.futures.Future | None = None


class AsyncLLM:
    """Asyncio front of an LLMEngine that runs in its own thread (start() is called for you)."""

    def __init__(self, engine: LLMEngine, config: AsyncLLMConfig | None = None):
        self.engine = engine
        self.config = config or AsyncLLMConfig()
        self._commands: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._stats_lock = threading.Lock()
        self._stats: dict[str, float] = {}
        self._peak_running = 0
        self._num_steps = 0
        self._num_step_errors = 0
        self._publish_stats()
        self._thread = threading.Thread(target=self._run, name="jaxpaged-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, config: AsyncLLMConfig | None = None) -> AsyncLLM:
        return cls(LLMEngine(args), config)

    # ---- the asyncio side -------------------------------------------------

    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams) -> asyncio.Queue:
        """Queue a request; the engine's ValueError or QueueFullError (nothing queued) is raised here."""
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue(), params)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Call(functools.partial(self._add, request_id, prompt, params, sink), future))
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:  # the caller left while the add was in flight: undo it
            self.abort(request_id)
            raise
        return sink.queue

    async def generate(self, request_id: str, prompt: Any, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come; the last has `finished` set.

        If the consumer stops early (client gone: GeneratorExit / CancelledError)
        the request is aborted at once and its KV pages are freed.
        """
        queue = await self.add_request(request_id, prompt, params)
        finished = False
        try:
            while (output := await self.next_output(queue)) is not None:
                finished = output.finished
                yield output
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    @staticmethod
    async def next_output(queue: asyncio.Queue) -> RequestOutput | None:
        """The next output from a queue returned by add_request; None once the request was aborted."""
        item = await queue.get()
        if item is _ABORTED:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def abort(self, request_ids: str | Sequence[str]) -> None:
        """Abort requests (thread-safe, non-blocking): applied before the engine's next step."""
        ids = (request_ids,) if isinstance(request_ids, str) else tuple(request_ids)
        self._submit(_Call(functools.partial(self._abort, ids)))

    async def call_engine(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """fn(engine) on the engine thread, between two steps (a step already dispatched finishes first);
        returns its result or raises its error here. For the engine's own operations: weight updates, sleep."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(_Call(functools.partial(self._call, fn), future))
        return await asyncio.wrap_future(future)

    async def update_weights_from_disk(self, model_path: str) -> float:
        """LLMEngine.update_weights_from_disk between steps; returns its seconds."""
        return await self.call_engine(lambda engine: engine.update_weights_from_disk(model_path))

    async def sleep(self, level: int = 1) -> None:
        """LLMEngine.sleep between steps (RuntimeError while requests are unfinished)."""
        await self.call_engine(lambda engine: engine.sleep(level))

    async def wake_up(self) -> None:
        await self.call_engine(lambda engine: engine.wake_up())

    @property
    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    def stats(self) -> dict[str, float]:
        """A consistent snapshot of the engine's stats plus the loop's own counters."""
        with self._stats_lock:
            return dict(self._stats)

    def reset_peak_running(self) -> None:
        """Restart the `peak_num_requests_running` high-water mark."""
        with self._stats_lock:
            self._peak_running = 0
            self._stats["peak_num_requests_running"] = 0

    # ---- model facts for front ends (fixed at start-up, so safe from any thread) ----

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """Sampling defaults from the model's generation_config.json."""
        return self.engine.generation_defaults

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread; requests still in flight end with EngineShutdownError.

        The thread then shuts the engine down (multi-host: releases the followers)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _submit(self, command: _Call) -> None:
        with self._cond:
            if self._stopping:
                if command.future is not None:
                    command.future.set_exception(EngineShutdownError("the engine is shut down"))
                return
            self._commands.append(command)
            self._cond.notify()

    # ---- the engine thread ------------------------------------------------

    def _run(self) -> None:
        logger.debug("engine thread started")
        while True:
            with self._cond:
                while not self._stopping and not self._commands and not self._sinks:
                    self._cond.wait()
                if self._stopping:
                    break
                commands = list(self._commands)
                self._commands.clear()
            self._apply(commands)
            if self._sinks:
                self._step()  # publishes the stats itself
            else:
                self._publish_stats()
        self._fail_all(EngineShutdownError("the engine was shut down"))
        try:  # after the last step, on this thread: LLMEngine.shutdown (multi-host: the followers exit)
            self.engine.shutdown()
        except Exception:
            logger.exception("engine shutdown failed")
        logger.debug("engine thread stopped")

    def _apply(self, commands: list[_Call]) -> None:
        for command in commands:
            if command.future is None:
                command.fn()
            elif command.future.set_running_or_notify_cancel():  # else the caller went away before we got here
                try:
                    command.future.set_result(command.fn())
                except Exception as err:  # the engine's ValueError (never servable), or a bug: still the caller's
                    command.future.set_exception(err)

    def _add(self, request_id: str, prompt: Any, params: SamplingParams, sink: _Sink) -> None:
        waiting, limit = int(self.engine.stats()["num_requests_waiting"]), self.config.max_waiting_requests
        if waiting + params.n > limit:
            raise QueueFullError(f"{waiting} sequences are waiting (max_waiting_requests={limit}); retry later")
        self.engine.add_request(request_id, prompt, params)
        self._sinks[request_id] = sink

    def _call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        try:
            return fn(self.engine)
        finally:
            self._publish_stats()

    def _abort(self, request_ids: Sequence[str]) -> None:
        try:
            self.engine.abort_request(list(request_ids))
        except Exception:
            logger.exception("aborting %s failed", list(request_ids))
        for rid in request_ids:
            sink = self._sinks.pop(rid, None)
            if sink is not None:
                sink.put(_ABORTED)

    def _step(self) -> None:
        """One engine step; stats are published before any output is delivered, so a caller
        that has seen an output (or an error) reads stats that count its step."""
        try:
            outputs = self.engine.step()
        except Exception:
            self._num_step_errors += 1
            self._fail_running()
            return
        self._num_steps += 1
        self._publish_stats()
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if sink is None:
                continue
            sink.last = output
            sink.put(output)
            if output.finished:
                del self._sinks[output.request_id]

    def _fail_running(self) -> None:
        """After a failed step: fail the requests of the running batch; the waiting ones go on.

        The step's KV writes are lost, so the prefix cache is reset too (pages
        hashed when the step was scheduled never got their contents).
        """
        failed = {rid: sink for rid, sink in self._sinks.items() if self.engine.is_request_running(rid)}
        if not failed:  # the failure is not tied to the batch (e.g. in scheduling): fail everything
            failed = dict(self._sinks)
        logger.exception("engine step failed; failing the %d running requests (%d others go on)",
                         len(failed), len(self._sinks) - len(failed))
        for rid in failed:
            del self._sinks[rid]
        try:
            self.engine.abort_request(list(failed))
            self._reset_prefix_cache()
        except Exception:
            logger.exception("aborting the failed requests failed too")
        self._publish_stats()
        for rid, sink in failed.items():
            sink.put(_error_output(rid, sink))

    def _reset_prefix_cache(self) -> None:
        if not self.engine.reset_prefix_cache():
            logger.warning("could not reset the prefix cache after a failed step (pages still held)")

    def _fail_all(self, err: BaseException) -> None:
        with self._cond:
            commands = list(self._commands)
            self._commands.clear()
        for command in commands:
            if command.future is not None and not command.future.done():
                command.future.set_exception(err)
        sinks, self._sinks = self._sinks, {}
        for sink in sinks.values():
            sink.put(err)

    def _publish_stats(self) -> None:
        stats = dict(self.engine.stats())
        with self._stats_lock:
            self._peak_running = max(self._peak_running, int(stats["num_requests_running"]))
            stats.update(peak_num_requests_running=self._peak_running, num_steps=self._num_steps,
                         num_step_errors=self._num_step_errors)
            self._stats = stats


def _error_output(request_id: str, sink: _Sink) -> RequestOutput:
    """The request's last output (or an empty one) marked finished with finish_reason "error"."""
    last = sink.last
    if last is None:
        outputs = [CompletionOutput(i, "", [], None, None) for i in range(sink.params.n)]
        last = RequestOutput(request_id, None, [], outputs, False, RequestMetrics(arrival_time=0.0))
    outputs = [dataclasses.replace(o, finish_reason=o.finish_reason or "error") for o in last.outputs]
    return dataclasses.replace(last, outputs=outputs, finished=True)


__all__ = ["AsyncLLM", "AsyncLLMConfig", "EngineShutdownError", "QueueFullError"]
