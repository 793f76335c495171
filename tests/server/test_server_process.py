"""`python -m server` as real processes on the tiny checkpoint: what it logs, and multi-host shutdown.

The server runs as a machine without torch would run it: `torch` is hidden from the process
(sys.modules["torch"] = None, so transformers finds no PyTorch and would print its advice).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.server.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
# `python -m server <args>` with torch hidden, as on a serving machine (torch is a test-only dependency).
NO_TORCH_SERVER = ("import runpy, sys; sys.modules['torch'] = None; sys.argv[0] = 'server'; "
                   "runpy.run_module('server', run_name='__main__', alter_sys=True)")
# XDG_CACHE_HOME of the server processes: their compilation cache persists between test runs.
CACHE_HOME = Path.home() / ".cache" / "jaxpaged" / "server-tests"
ENGINE = ["--max-model-len", "128", "--num-pages", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "16",
          "--block-size", "16"]
READY = re.compile(r"INFO jaxpaged\.engine\.llm_engine: jaxpaged ready in [\d.]+ s .*KV pool (\d+) pages x (\d+) tokens = "
                   r"(\d+) tokens .*backend (\w+)")


def start_server(model: Path, port: int, cache_home: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_home), "JAX_PLATFORMS": "cpu", **(env or {})}
    return subprocess.Popen([sys.executable, "-c", NO_TORCH_SERVER, "--model", str(model), "--host", "127.0.0.1",
                             "--port", str(port), *ENGINE, *extra], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_healthy(url: str, procs: list[subprocess.Popen], timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            break
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    stop(procs)
    logs = "\n---\n".join(p.stderr.read()[-3000:] for p in procs)
    raise AssertionError(f"the server did not come up (exit codes {[p.poll() for p in procs]}):\n{logs}")


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()


def complete(url: str) -> dict:
    response = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0},
                          timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_server_logs_its_ready_line_and_no_torch_advice(tiny_checkpoints):
    port = free_port()
    proc = start_server(tiny_checkpoints["gqa4"], port, CACHE_HOME / "single")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [proc])
        complete(url)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        stop([proc])
    assert proc.returncode == 0, stderr[-3000:]
    ready = READY.search(stderr)
    assert ready, stderr[-3000:]
    pages, page_size, tokens, backend = ready.groups()
    assert (int(pages), int(page_size), int(tokens), backend) == (63, 16, 63 * 16, "cpu")  # page 0: the null page
    # progress while it compiles: each step shape counted when the compile pool has finished it, in order
    shapes = re.findall(r"INFO jaxpaged\.worker\.compilation: step shape (\d+)/(\d+) (?:compiled|loaded from the cache)",
                        stderr)
    assert shapes and [int(i) for i, _ in shapes] == list(range(1, int(shapes[0][1]) + 1)), stderr[-3000:]
    assert stderr.index("step shape 1/") < stderr.index(f"compiled {shapes[0][1]} step shapes") < ready.start()
    assert "INFO server.lifecycle: serving " in stderr  # once listening (server/lifecycle.py)
    assert "PyTorch was not found" not in stderr
    assert "Unable to initialize backend" not in stderr  # JAX's INFO noise stays out at --log-level info


def test_multihost_followers_exit_when_the_server_stops(tiny_checkpoints):
    """Process 0 serves HTTP, process 1 follows (jax.distributed, 1 CPU device each, tp=2); SIGTERM to
    process 0: both exit 0 (the follower is released by LLMEngine.shutdown, reached from AsyncLLM.shutdown)."""
    port, coordinator = free_port(), f"127.0.0.1:{free_port()}"
    multihost = ["--tensor-parallel-size", "2", "--num-processes", "2", "--distributed-coordinator", coordinator]
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    procs = [start_server(tiny_checkpoints["gqa8"], port, CACHE_HOME / f"process{i}", *multihost,
                          "--process-id", str(i), env=env) for i in range(2)]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, procs)
        response = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=60)
        if response.status_code != 200:
            stop(procs)
            raise AssertionError(f"{response.text}\n{procs[0].stderr.read()[-4000:]}")
        procs[0].send_signal(signal.SIGTERM)
        outs = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        stop(procs)
    assert [p.returncode for p in procs] == [0, 0], "\n---\n".join(o[-3000:] for o in outs)
    followed = re.search(r"process 1 followed (\d+) steps; exiting", outs[1])
    assert followed and int(followed.group(1)) > 0, outs[1][-3000:]
