"""SIGTERM: `python -m server` stops accepting, lets in-flight streams end cleanly, exits 0, leaves no orphans.

The server runs through `tests/reliability/serve_instrumented.py` (the `server` package as `__main__`, each
engine step STEP_DELAY seconds slower), so how long a request takes is known: the edges of the grace period
are tested deterministically, in both directions.
"""

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
STEP_DELAY = 0.05  # seconds added to every engine step: a request of N tokens takes >= N * STEP_DELAY
GRACE = 5.0
EXIT_MARGIN = 15.0


def start_instrumented(tiny_path: str, port: int, tmp_path, extra: tuple[str, ...] = (),
                       step_delay: float = STEP_DELAY) -> subprocess.Popen:
    log = open(tmp_path / "server.log", "w")
    return subprocess.Popen(
        [sys.executable, "-m", "tests.reliability.serve_instrumented", str(tmp_path / "report.json"),
         str(step_delay), "--model", tiny_path, "--host", "127.0.0.1", "--port", str(port),
         "--max-model-len", "128", "--num-pages", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
         "--log-level", "info", *extra],
        stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float = START_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
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


# (max_tokens, grace): 24 tokens take >= 1.2 s, well inside a 5 s grace period but far longer than the
# server takes to reach its shutdown (0.1 s ticks): a drain that ignores the grace period cuts them.
# 100 tokens take >= 5 s: with no grace they cannot finish, so the stream must end with 503 + [DONE].
@pytest.mark.parametrize("max_tokens, grace", [(24, GRACE), (100, 0.0)])
def test_sigterm_drains_and_exits_zero(tiny_path, tmp_path, max_tokens, grace):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_instrumented(tiny_path, port, tmp_path, ("--shutdown-timeout", str(grace)))
    try:
        wait_healthy(proc, url)
        children = psutil.Process(proc.pid).children(recursive=True)
        start = time.monotonic()
        events, refused = _stream_then_sigterm(proc, url, max_tokens)
        code = proc.wait(timeout=GRACE + EXIT_MARGIN)
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    log = (tmp_path / "server.log").read_text()
    assert code == 0, log[-3000:]
    assert refused, "the server still accepted connections after SIGTERM"
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    errors = [c["error"] for c in chunks if "error" in c]
    finished = [ch["finish_reason"] for c in chunks for ch in c.get("choices", ()) if ch["finish_reason"]]
    tokens = sum(1 for c in chunks for ch in c.get("choices", ()) if ch.get("text"))
    if grace:  # the stream ran to its end within the grace period
        assert finished == ["length"] and not errors, chunks[-2:]
        assert max_tokens * STEP_DELAY <= elapsed < GRACE + EXIT_MARGIN
    else:  # cut at once: one 503 error chunk, no finish, far fewer tokens than asked
        assert [e["code"] for e in errors] == [503] and not finished, chunks[-2:]
        assert tokens < max_tokens // 2 and elapsed < max_tokens * STEP_DELAY
        assert "grace period (0.0 s) over: aborting 1 running" in log, log[-3000:]
    assert not [c for c in children if c.is_running()], "orphaned child processes"
    assert "Traceback" not in log, log[-3000:]
    assert "torch" not in json.loads((tmp_path / "report.json").read_text())["modules"]  # serving never imports it
