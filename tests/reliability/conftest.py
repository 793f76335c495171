"""Reliability fixtures: a tiny-model engine with a fault-injection hook behind a real uvicorn on 127.0.0.1.

`FaultInjector` is the documented test hook of `LLMEngine(fault_injector=...)`: called every step with the
scheduled entries and the logits, it raises (failing the step) or writes NaN into the logits rows of requests
whose prompt contains a marker. Markers are plain prompt text, so HTTP tests can aim at one request.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import jax.numpy as jnp
import pytest

from jaxpaged.engine.async_llm import AsyncLLM, AsyncLLMConfig
from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.core.request import RequestStatus
from jaxpaged.sampling_params import SamplingParams
from server.app import build_app
from server.config import ServerConfig
from tests.server.conftest import LiveServer, serve

MODEL_NAME = "tiny"
API_KEY = "rel-key-456"
RAISE_MARKER = "<<raise>>"  # a step holding a request with this in its prompt raises
NAN_MARKER = "<<nan>>"  # rows of requests with this in their prompt get NaN logits
SLOW_MARKER = "<<slow>>"  # a step holding a request with this in its prompt takes SLOW_STEP_SECONDS more
SLOW_STEP_SECONDS = 0.02
ENGINE_ARGS = dict(max_model_len=128, max_num_seqs=64, max_num_batched_tokens=256, num_pages=512,
                   compilation_cache_dir=None)


class InjectedFault(RuntimeError):
    """What FaultInjector raises."""


class FaultInjector:
    """fault_injector(entries, logits) -> logits for LLMEngine: faults aimed by prompt markers."""

    def __init__(self):
        self.engine: LLMEngine | None = None  # set once the engine exists (to read prompts)
        self.raised = 0
        self.nan_rows = 0

    def _prompt(self, request_id: str) -> str:
        request = self.engine.scheduler.get_request(request_id) if self.engine else None
        return self.engine.tokenizer.decode(request.prompt_token_ids) if request else ""

    def __call__(self, entries, logits):
        prompts = [self._prompt(e.request_id) for e in entries]
        if any(RAISE_MARKER in p for p in prompts):
            self.raised += 1
            raise InjectedFault("injected step failure")
        if any(SLOW_MARKER in p for p in prompts):
            time.sleep(SLOW_STEP_SECONDS)
        rows = [i for i, (e, p) in enumerate(zip(entries, prompts)) if e.samples and NAN_MARKER in p]
        if rows:
            self.nan_rows += len(rows)
            logits = logits.at[jnp.asarray(rows)].set(jnp.nan)
        return logits


class FailBeforeForward:
    """Wraps `engine.runner._forward` (what `execute_model` and `execute` run) so a step holding a running request `request_id` raises BEFORE the model
    runs: the step's pages were scheduled (and their full pages hashed into the prefix cache) but their KV was
    never written. (`fault_injector` fires after the forward, when the KV pool is already written.)"""

    def __init__(self, engine: LLMEngine, request_id: str):
        self.engine, self.request_id, self.raised = engine, request_id, 0
        self._execute = engine.runner._forward
        engine.runner._forward = self

    def __call__(self, *args, **kwargs):
        request = self.engine.scheduler.get_request(self.request_id)
        if request is not None and request.status is RequestStatus.RUNNING:
            self.raised += 1
            raise InjectedFault("injected failure before the forward")
        return self._execute(*args, **kwargs)


def greedy_outputs(engine: LLMEngine, prompts, max_tokens: int) -> list:
    """CompletionOutputs of greedy requests run to completion on a synchronous engine (all added at once)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"greedy-{id(prompts)}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    done = {}
    for _ in range(100 * max_tokens * len(prompts)):
        done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests():
            return [done[rid] for rid in ids]
    raise AssertionError("greedy requests did not finish")


def make_engine(path: str, fault_injector: FaultInjector | None = None, **overrides) -> LLMEngine:
    engine = LLMEngine(EngineArgs(model=path, **{**ENGINE_ARGS, **overrides}), fault_injector=fault_injector)
    if fault_injector is not None:
        fault_injector.engine = engine
    return engine


@dataclasses.dataclass
class RelServer(LiveServer):
    faults: FaultInjector | None = None

    def wait_pages_free(self, timeout: float = 10.0) -> None:
        """Bounded wait until nothing runs or waits and every KV page is unreferenced."""
        self.wait_idle(timeout)
        pool = self.engine.engine.scheduler.pool
        deadline = time.monotonic() + timeout
        while pool.num_free_pages != pool.num_usable_pages and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pool.num_free_pages == pool.num_usable_pages, (pool.num_free_pages, pool.num_usable_pages)


@pytest.fixture(scope="session")
def tiny_path(tiny_checkpoints) -> str:
    return str(tiny_checkpoints["gqa4"])


@pytest.fixture(scope="session")
def rel_faults() -> FaultInjector:
    return FaultInjector()


@pytest.fixture(scope="session")
def nocache_engine(tiny_path) -> LLMEngine:
    """The reference for isolation tests: the same model with prefix caching OFF (every prompt computed)."""
    return make_engine(tiny_path, enable_prefix_caching=False, warmup=False)


@pytest.fixture(scope="session")
def rel_llm(tiny_path, rel_faults):
    llm = AsyncLLM(make_engine(tiny_path, rel_faults), AsyncLLMConfig(max_waiting_requests=1024))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def rel(rel_llm, tiny_path, rel_faults) -> RelServer:
    """The shared reliability server (no API key)."""
    app = build_app(rel_llm, ServerConfig(served_model_names=(MODEL_NAME,)))
    with serve(app) as url:
        yield RelServer(url, rel_llm, tiny_path, rel_faults)


@pytest.fixture(scope="session")
def rel_keyed(rel_llm, tiny_path) -> RelServer:
    """A second app over the same engine, requiring API_KEY, with a 64 KiB body cap."""
    app = build_app(rel_llm, ServerConfig(served_model_names=(MODEL_NAME,), api_key=API_KEY,
                                          max_request_bytes=64 * 1024))
    with serve(app) as url:
        yield RelServer(url, rel_llm, tiny_path)


class ErrorRecords(logging.Handler):
    """Collects WARNING+ records (ERROR ones fail tests) from the loggers uvicorn does not propagate."""

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def errors(self) -> list[str]:
        return [f"{r.name}: {r.getMessage()}" + (" (traceback)" if r.exc_info else "")
                for r in self.records if r.levelno >= logging.ERROR or r.exc_info]


@pytest.fixture
def error_logs():
    handler = ErrorRecords()
    loggers = [logging.getLogger(name) for name in ("", "uvicorn", "uvicorn.error", "uvicorn.access")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield handler
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


@contextlib.contextmanager
def timed(limit: float):
    """Assert the block took at most `limit` seconds."""
    start = time.monotonic()
    yield
    elapsed = time.monotonic() - start
    assert elapsed <= limit, f"took {elapsed:.2f}s > {limit}s"
