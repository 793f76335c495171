"""A real uvicorn server on 127.0.0.1 (in a thread) over the tiny checkpoint, shared by the server tests."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from jaxpaged.engine.async_llm import AsyncLLM
from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from server.app import build_app
from server.config import ServerConfig

MODEL_NAME = "tiny"
ENGINE_ARGS = dict(max_model_len=128, max_num_seqs=16, max_num_batched_tokens=64, num_pages=200,
                   compilation_cache_dir=None)
API_KEY = "test-key-123"


@dataclasses.dataclass
class LiveServer:
    url: str  # http://127.0.0.1:<port>
    engine: AsyncLLM
    model_path: str

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def openai(self, api_key: str = "unused"):
        import openai
        return openai.OpenAI(base_url=self.v1, api_key=api_key, max_retries=0, timeout=60)

    def wait_idle(self, timeout: float = 5.0) -> dict:
        """Engine stats once nothing runs or waits (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.engine.stats()
            if stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0:
                return stats
            time.sleep(0.01)
        raise AssertionError(f"engine still busy after {timeout}s: {self.engine.stats()}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(app, timeout: float = 30.0):
    """Run `app` under uvicorn in a thread on a free port; yield its base URL; stop it after."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=1) as client:  # one client: httpx.get builds one (~27 ms of CPU) a call
        while True:
            try:
                if client.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"the server on port {port} did not come up")
            time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(10)


@contextlib.contextmanager
def live_server(path: str, **engine_args):
    """A LiveServer over its own engine (ENGINE_ARGS and `engine_args`) on the checkpoint at `path`."""
    llm = AsyncLLM(LLMEngine(EngineArgs(model=path, **{**ENGINE_ARGS, **engine_args})))
    try:
        with serve(build_app(llm, ServerConfig(served_model_names=(MODEL_NAME, path)))) as url:
            yield LiveServer(url, llm, path)
    finally:
        llm.shutdown()


@pytest.fixture(scope="session")
def async_llm(tiny_checkpoints):
    engine = LLMEngine(EngineArgs(model=str(tiny_checkpoints["gqa4"]), **ENGINE_ARGS))
    llm = AsyncLLM(engine)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def live(async_llm, tiny_checkpoints) -> LiveServer:
    path = str(tiny_checkpoints["gqa4"])
    app = build_app(async_llm, ServerConfig(served_model_names=(MODEL_NAME, path)))
    with serve(app) as url:
        yield LiveServer(url, async_llm, path)


@pytest.fixture(scope="session")
def live_with_key(async_llm, tiny_checkpoints) -> LiveServer:
    """A second app over the same engine, requiring API_KEY."""
    path = str(tiny_checkpoints["gqa4"])
    app = build_app(async_llm, ServerConfig(served_model_names=(MODEL_NAME,), api_key=API_KEY,
                                            max_request_bytes=64 * 1024))
    with serve(app) as url:
        yield LiveServer(url, async_llm, path)
