"""SIGTERM: `python -m server` stops accepting, lets in-flight streams end cleanly, exits 0, leaves no orphans."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from tests.server.conftest import free_port

START_TIMEOUT = 180.0  # the first start compiles every step shape
SHUTDOWN_TIMEOUT = 3.0
EXIT_MARGIN = 15.0


def _start(tiny_path: str, port: int, tmp_path, grace: float) -> subprocess.Popen:
    log = open(tmp_path / "server.log", "w")
    return subprocess.Popen(
        [sys.executable, "-m", "server", "--model", tiny_path, "--host", "127.0.0.1", "--port", str(port),
         "--max-model-len", "128", "--num-pages", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
         "--shutdown-timeout", str(grace), "--log-level", "info"],
        stdout=log, stderr=subprocess.STDOUT)


def _wait_healthy(proc: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited during start-up"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not become healthy")


def _stream_then_sigterm(proc: subprocess.Popen, url: str, max_tokens: int) -> tuple[list[str], bool]:
    """Stream a completion; send SIGTERM after its first chunk; return (events, refused_new_connection)."""
    body = dict(prompt="shutting down soon", max_tokens=max_tokens, temperature=0, ignore_eos=True, stream=True)
    events, refused = [], False
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: "):])
            if len(events) == 1:
                proc.send_signal(signal.SIGTERM)
                time.sleep(0.3)
                try:
                    httpx.get(url + "/health", timeout=2)
                except httpx.TransportError:
                    refused = True
    return events, refused


@pytest.mark.parametrize("max_tokens, grace", [(24, SHUTDOWN_TIMEOUT), (100, 0.0)])
def test_sigterm_drains_and_exits_zero(tiny_path, tmp_path, max_tokens, grace):
    """24 tokens finish within the grace period; with no grace the stream is cut: a 503 chunk + [DONE]."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start(tiny_path, port, tmp_path, grace)
    try:
        _wait_healthy(proc, url)
        children = psutil.Process(proc.pid).children(recursive=True)
        start = time.monotonic()
        events, refused = _stream_then_sigterm(proc, url, max_tokens)
        code = proc.wait(timeout=SHUTDOWN_TIMEOUT + EXIT_MARGIN)
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    log = (tmp_path / "server.log").read_text()
    assert code == 0, log[-3000:]
    assert elapsed < SHUTDOWN_TIMEOUT + EXIT_MARGIN
    assert refused, "the server still accepted connections after SIGTERM"
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    errors = [c["error"] for c in chunks if "error" in c]
    finished = [ch["finish_reason"] for c in chunks for ch in c.get("choices", ()) if ch["finish_reason"]]
    assert finished == ["length"] or [e["code"] for e in errors] == [503], chunks[-2:]
    if grace:
        assert finished == ["length"] and not errors
    assert not [c for c in children if c.is_running()], "orphaned child processes"
    assert "Traceback" not in log, log[-3000:]
