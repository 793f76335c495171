"""`python -m server --data-parallel-size 2`: two replicas of the default model and vllm-router, as real processes
on CPU. Through the router: the API key, /health, /v1/models, chat and streaming as with one replica; the
replicas on loopback with labelled metrics; a replica killed mid-load is failed over, restarted and rejoins;
SIGTERM drains the fleet and leaves no process behind.

The tests share one fleet and run in file order; the last one stops it.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from server.data_parallel import DataParallelConfig, replica_args
from tests.server.conftest import free_port

pytest.importorskip("vllm_router", reason="pip install vllm-router (the test extra has it)")

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
API_KEY = "dp-key-789"
START_TIMEOUT = 600.0  # a cold start compiles every step shape, two replicas at once on a shared CPU
ENGINE = ["--max-model-len", "512", "--num-pages", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "64"]
AUTH = {"Authorization": f"Bearer {API_KEY}"}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class Fleet:
    def __init__(self, proc: subprocess.Popen, port: int, base_port: int, log: Path):
        self.proc, self.url, self.base_port, self.log = proc, f"http://127.0.0.1:{port}", base_port, log

    def replicas(self) -> dict[int, psutil.Process]:
        """The launcher's live replica processes by rank."""
        found = {}
        for child in psutil.Process(self.proc.pid).children():
            try:
                cmd = child.cmdline()
            except psutil.NoSuchProcess:
                continue
            if "--data-parallel-rank" in cmd:
                found[int(cmd[cmd.index("--data-parallel-rank") + 1])] = child
        return found

    def healthy_workers(self) -> int:
        try:
            return httpx.get(self.url + "/readiness", timeout=2).json()["healthy_workers"]
        except (httpx.TransportError, ValueError, KeyError):
            return 0

    def serves_models(self) -> bool:
        try:
            return httpx.get(self.url + "/v1/models", headers=AUTH, timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def wait_ready(self, timeout: float) -> float:
        """Both replicas healthy in the router, and a request proxied through it answered (what a deployment's
        readiness probe checks: the router can report its workers healthy a moment before it proxies)."""
        start = time.monotonic()
        while self.healthy_workers() < 2 or not self.serves_models():
            if self.proc.poll() is not None or time.monotonic() - start > timeout:
                raise AssertionError(f"the fleet is not ready (launcher exit {self.proc.poll()}):\n"
                                     f"{self.log.read_text()[-4000:]}")
            time.sleep(0.5)
        return time.monotonic() - start

    def chat(self, content: str, max_tokens: int = 8, **extra) -> httpx.Response:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                **extra}
        return httpx.post(self.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)


def free_port_block(n: int) -> int:
    """The first of n consecutive free loopback ports below Linux's ephemeral range (32768 on): the launcher
    gives replica i base + i, and a port in that range can be taken by any client connection meanwhile."""
    for offset in range(0, 12000, 7):
        base, socks = 20000 + (os.getpid() * 13 + offset) % 12000, []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports below 32000")


def start_fleet(folder: Path) -> Fleet:
    """`python -m server -dp 2` on free ports, ready (both replicas healthy in the router)."""
    port, base_port = free_port(), free_port_block(2)
    log = folder / "fleet.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "server", "--data-parallel-size", "2", "--host", "127.0.0.1", "--port", str(port),
             "--data-parallel-base-port", str(base_port), "--api-key", API_KEY, *ENGINE, "--log-level", "info",
             "--shutdown-timeout", "10"],
            cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=out, stderr=subprocess.STDOUT)
    fleet = Fleet(proc, port, base_port, log)
    try:
        fleet.wait_ready(START_TIMEOUT)
    except BaseException:
        stop_fleet(fleet)
        raise
    return fleet


def stop_fleet(fleet: Fleet) -> None:
    """SIGTERM the launcher; whatever of the fleet is still running a minute later is killed."""
    if fleet.proc.poll() is None:
        descendants = psutil.Process(fleet.proc.pid).children(recursive=True)
        fleet.proc.send_signal(signal.SIGTERM)
        try:
            fleet.proc.wait(60)
        except subprocess.TimeoutExpired:
            fleet.proc.kill()
        for p in descendants:
            if p.is_running():
                p.kill()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    fleet = start_fleet(tmp_path_factory.mktemp("data_parallel"))
    try:
        yield fleet
    finally:
        stop_fleet(fleet)


def test_launcher_config_and_replica_flags():
    assert replica_args(["--model", "m", "-dp", "2", "--port=9", "--api-key", "k", "--served-model-name", "a", "b",
                         "--data-parallel-worker-urls", "http://h:1", "--max-model-len", "64"]) == \
        ["--model", "m", "--served-model-name", "a", "b", "--max-model-len", "64"]
    config = DataParallelConfig(size=3, port=9000, size_local=2, remote_urls=("http://other:8000",),
                                devices_per_replica=2)
    assert config.local_urls == ("http://127.0.0.1:9001", "http://127.0.0.1:9002")
    assert (config.replica_devices(0), config.replica_devices(1)) == ("0,1", "2,3")
    assert config.router_metrics_port == 9003
    cmd = config.router_command()
    assert cmd[cmd.index("--worker-urls") + 1:cmd.index("--policy")] == [*config.local_urls, "http://other:8000"]
    visible = DataParallelConfig(size=2, visible_devices=("4", "5", "6", "7"), devices_per_replica=2)
    assert visible.replica_devices(1) == "6,7"
    for bad in (dict(size=0), dict(size=2, size_local=3), dict(size=2, size_local=1),
                dict(size=2, base_port=8000), dict(size=2, policy="kv_aware"),
                dict(size=2, visible_devices=("0",))):
        with pytest.raises(ValueError):
            DataParallelConfig(**bad)


def test_the_router_serves_as_one_replica_would(fleet):
    assert httpx.get(fleet.url + "/health", timeout=5).status_code == 200
    keyless = httpx.get(fleet.url + "/v1/models", timeout=5)
    assert keyless.status_code == 401, (keyless.text, fleet.log.read_text()[-4000:])  # the replicas check the key
    models = httpx.get(fleet.url + "/v1/models", headers=AUTH, timeout=5).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    wrong = fleet.chat("hi", model="nope")
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
    chat = fleet.chat(QUESTION[0]["content"], max_tokens=32, temperature=0)
    assert chat.status_code == 200, chat.text
    answer = chat.json()["choices"][0]["message"]["content"]
    assert "Paris" in answer
    body = dict(model=MODEL, messages=QUESTION, max_tokens=32, temperature=0, stream=True)
    with httpx.stream("POST", fleet.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    streamed = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert streamed == answer


def test_replicas_listen_on_loopback_with_labelled_metrics(fleet):
    urls = [f"http://127.0.0.1:{fleet.base_port + rank}" for rank in (0, 1)]
    before = sum(_served(url) for url in urls)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # different prompts: both replicas get some
        assert all(r.status_code == 200 for r in pool.map(lambda i: fleet.chat(f"{i} " * 40 + "count"), range(8)))
    replicas = fleet.replicas()
    assert sorted(replicas) == [0, 1]
    served = 0
    for rank, proc in replicas.items():
        listening = {c.laddr for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        assert listening == {("127.0.0.1", fleet.base_port + rank)}
        url = f"http://127.0.0.1:{fleet.base_port + rank}"
        text = httpx.get(url + "/metrics", headers=AUTH, timeout=5).text
        running = [line for line in text.splitlines() if line.startswith("vllm:num_requests_running{")]
        assert running == [f'vllm:num_requests_running{{engine="0",model_name="{MODEL}",replica="{rank}"}} 0.0']
        served += _served(url)
    assert served >= before + 8, (before, served)


def test_a_killed_replica_is_failed_over_restarted_and_rejoins(fleet):
    victim = fleet.replicas()[1]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        in_flight = [pool.submit(fleet.chat, f"story number {i}: once upon a time", 32) for i in range(8)]
        streams = [pool.submit(_stream_outcome, fleet, f"a long story {i}") for i in range(4)]
        time.sleep(1.0)
        os.killpg(victim.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        for future in in_flight:  # each ends: served (by either replica, or retried) or an error, never a hang
            response = future.result(timeout=90)
            assert response.status_code == 200 or response.status_code >= 500, response.text
        # A stream the dead replica was sending is cut (the router passes the broken body on); the others end
        # with [DONE]. Either way it ends.
        assert {future.result(timeout=90) for future in streams} <= {"[DONE]", "cut"}
        after = list(pool.map(lambda i: fleet.chat(f"after the kill {i}"), range(16)))
    assert sum(r.status_code == 200 for r in after) >= 14, [r.text[:200] for r in after if r.status_code != 200]
    assert time.monotonic() - killed_at < 60
    replica = f"http://127.0.0.1:{fleet.base_port + 1}"
    while not _healthy(replica):  # restarted by the launcher: a warm start (the compilation cache is filled)
        assert time.monotonic() - killed_at < 180, fleet.log.read_text()[-4000:]
        time.sleep(0.5)
    assert fleet.replicas()[1].pid != victim.pid
    assert "replica 1 (127.0.0.1" in fleet.log.read_text() and "restarting it in 1 s" in fleet.log.read_text()
    # Back in the router's rotation: it serves some of a concurrent batch sent to the router (cache_aware
    # sends a request with no cached prefix to the least loaded replica; one at a time, all tie on replica 0).
    deadline = time.monotonic() + 30
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        while _served(replica) == 0:
            assert time.monotonic() < deadline, "the restarted replica got no request through the router"
            batch = pool.map(lambda i: fleet.chat(f"{time.monotonic()} {i} " * 10 + "back again"), range(8))
            assert all(r.status_code == 200 for r in batch)


def _stream_outcome(fleet: Fleet, content: str) -> str:
    """"[DONE]" when a long streamed chat completion ends normally, "cut" when its connection breaks."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 120,
            "ignore_eos": True, "stream": True}
    last = None
    try:
        with httpx.stream("POST", fleet.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
            for line in r.iter_lines():
                last = line[6:] if line.startswith("data: ") else last
    except httpx.RemoteProtocolError:
        return "cut"
    return last


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def _served(url: str) -> float:
    text = httpx.get(url + "/metrics", headers=AUTH, timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


@pytest.mark.slow
def test_64_clients_without_an_error(fleet):
    """The issue's load target: 64 concurrent chat clients, two requests each, every one answered."""
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        responses = list(pool.map(lambda i: fleet.chat(f"client {i % 64} asks question {i}", 16), range(128)))
    assert [r.status_code for r in responses] == [200] * 128, [r.text[:200] for r in responses if r.status_code != 200]


@pytest.mark.slow
def test_replicas_that_cannot_start_stop_the_launcher(tmp_path):
    """A model that does not load: each replica exits at once, is restarted with a growing backoff, and after
    MAX_EARLY_EXITS the launcher gives up: exit 1, nothing left (about 35 s)."""
    proc = subprocess.Popen([sys.executable, "-m", "server", "-dp", "2", "--host", "127.0.0.1",
                             "--port", str(free_port()), "--model", str(tmp_path / "no-such-model")],
                            cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    descendants: set[psutil.Process] = set()
    while proc.poll() is None:
        try:
            descendants |= set(psutil.Process(proc.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            break
        time.sleep(0.5)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr[-3000:]
    assert "5 times in a row within 60 s of its start: stopping" in stderr
    assert len(descendants) >= 5 + 1 + 1  # five starts of one replica, the other, the router
    assert not [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.slow
def test_a_killed_launcher_takes_its_children_with_it(tmp_path):
    """SIGKILL to the launcher (no drain runs): the kernel SIGTERMs each child (PR_SET_PDEATHSIG); all exit."""
    fleet = start_fleet(tmp_path)
    descendants = psutil.Process(fleet.proc.pid).children(recursive=True)
    fleet.proc.kill()
    fleet.proc.wait()
    gone, alive = psutil.wait_procs(descendants, timeout=60)
    for p in alive:
        p.kill()
    assert len(descendants) >= 3 and not alive, [p.cmdline() for p in alive]


def test_sigterm_drains_every_replica_and_the_router(fleet):
    """Last: a stream started before SIGTERM ends with [DONE], the launcher exits 0, nothing is left."""
    descendants = psutil.Process(fleet.proc.pid).children(recursive=True)
    assert len(descendants) >= 3  # two replicas and the router
    body = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me about Paris."}], max_tokens=48,
                temperature=0, stream=True, ignore_eos=True)
    with httpx.stream("POST", fleet.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 2:
                    fleet.proc.send_signal(signal.SIGTERM)
    assert events[-1] == "[DONE]" and len(events) >= 48
    assert fleet.proc.wait(60) == 0, fleet.log.read_text()[-4000:]
    time.sleep(0.5)
    left = [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [p.cmdline() for p in left]
