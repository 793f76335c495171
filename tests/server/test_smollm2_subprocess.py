"""`python -m server` as a subprocess on the built-in SmolLM2 (the README's serve command), driven like the
README's example; in the default test run (so in CI). It runs through `tests/reliability/serve_instrumented.py`
(the `server` package as `__main__`, unchanged steps) so its imported modules are known at exit: serving the
default model (GGUF weights and vocabulary) never imports torch.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.conftest import free_port

START_TIMEOUT = 600.0  # the first start compiles every step shape (about a minute on CPU)


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm2_server")
    port = free_port()
    log = open(folder / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "tests.reliability.serve_instrumented", str(folder / "report.json"),
                             "0", "--host", "127.0.0.1", "--port", str(port),
                             "--max-model-len", "256", "--num-pages", "64", "--max-num-seqs", "4",
                             "--max-num-batched-tokens", "64", "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT
    try:
        healthy = False
        with httpx.Client(timeout=1) as client:  # one client: httpx.get builds one (~27 ms of CPU) a call
            while not healthy and time.monotonic() < deadline and proc.poll() is None:
                try:
                    healthy = client.get(url + "/health").status_code == 200
                except httpx.TransportError:
                    time.sleep(0.5)
        if not healthy:
            raise RuntimeError(f"server did not come up: {(folder / 'server.log').read_text()[-3000:]}")
        yield url, proc, folder
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_readme_chat_example(smollm2_server):
    from openai import OpenAI

    url, _, _ = smollm2_server
    client = OpenAI(base_url=url + "/v1", api_key="EMPTY", max_retries=0)
    assert client.models.list().data[0].id == "smollm2-135m-instruct"
    chat = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32, temperature=0)
    assert "Paris" in chat.choices[0].message.content
    stream = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat.choices[0].message.content


def test_serving_the_default_model_never_imports_torch(smollm2_server):
    """Last in this module: SIGTERM, exit 0, then the modules the server process had imported."""
    url, proc, folder = smollm2_server
    assert httpx.post(url + "/v1/completions", json=dict(prompt="Hi", max_tokens=2), timeout=60).status_code == 200
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, (folder / "server.log").read_text()[-3000:]
    modules = json.loads((folder / "report.json").read_text())["modules"]
    assert "jaxpaged" in modules and "server" in modules and "uvicorn" in modules
    assert "torch" not in modules
