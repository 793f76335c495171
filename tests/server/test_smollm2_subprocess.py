"""`python -m server` as a subprocess on the built-in SmolLM2, driven like the README (slow: compiles)."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from tests.server.conftest import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_server():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--max-model-len", "256", "--num-pages", "64", "--max-num-seqs", "4",
                             "--max-num-batched-tokens", "64", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        else:
            raise RuntimeError(f"server did not come up: {proc.stderr.read() if proc.poll() is not None else ''}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_readme_chat_example(smollm2_server):
    from openai import OpenAI

    client = OpenAI(base_url=smollm2_server + "/v1", api_key="EMPTY", max_retries=0)
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
