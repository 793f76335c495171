"""`python -m server --model gemma3-270m` as a subprocess: the built-in Gemma 3 answers a completion
(slow: loads and compiles a 262k-vocabulary model)."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from tests.server.conftest import free_port

pytestmark = pytest.mark.slow


def test_gemma3_server_completion():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "server", "--model", "gemma3-270m", "--host", "127.0.0.1",
                             "--port", str(port), "--max-model-len", "128", "--num-pages", "48",
                             "--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(1)
        else:
            raise RuntimeError(f"server did not come up: {proc.stderr.read() if proc.poll() is not None else ''}")
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "gemma3-270m"
        resp = httpx.post(url + "/v1/completions", timeout=300, json={
            "model": "gemma3-270m", "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0})
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert "France" in choice["text"] and choice["finish_reason"] in ("length", "stop")
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
