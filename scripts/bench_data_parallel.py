"""Data parallelism behind a router, measured: prefix-cache hit rate and router overhead.

Starts two replicas (`python -m server --data-parallel-rank i` on loopback, the default model), then for each
setting runs the same kind of workload (many requests over a few long shared prefixes, each with its own
suffix) and reads the replicas' /metrics before and after:

    1 replica (direct) | vllm-router cache_aware | vllm-router round_robin | sglang-router cache_aware | ...

Each setting gets prefixes of its own (its own seed), so no setting hits what an earlier one left cached.
Then the router's overhead: streaming requests one at a time, alternating direct to replica 0 and through a
router whose only worker is replica 0, time to first token (client side) for each.

    python scripts/bench_data_parallel.py --num-requests 96 --num-prefixes 8
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
WORDS = ("river stone market lantern orbit cedar violet harbor signal meadow copper thunder pocket garden "
         "engine silver window canyon puzzle ember falcon glacier velvet compass island mirror quartz saddle "
         "timber valley whisper anchor bridge candle desert forest galaxy hammer jungle kettle ladder marble "
         "needle ocean pepper rocket shadow tunnel umbrella vessel wagon yellow zebra").split()


def start(argv: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc: subprocess.Popen, grace: float = 60) -> None:
    """SIGTERM the process group, SIGKILL it after `grace` s; the whole group, also when the leader is gone
    (sglang-router's server lingers for its shutdown grace period, holding its ports)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def start_router(kind: str, policy: str, port: int, workers: list[str], log: Path) -> subprocess.Popen:
    """A router on `port` (its metrics on port + 1), once both ports are free; ready when it returns."""
    if not (port_free(port) and port_free(port + 1)):
        raise SystemExit(f"port {port} or {port + 1} is taken: another router still runs")
    router = start(router_argv(kind, policy, port, workers, port + 1), log)
    wait_ok(f"http://127.0.0.1:{port}/readiness", router)
    time.sleep(3)  # every worker marked healthy
    if router.poll() is not None:
        raise SystemExit(f"{kind} exited: {log.read_text()[-2000:]}")
    return router


def wait_ok(url: str, proc: subprocess.Popen, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not answer 200 (exit {proc.poll()})")


def router_argv(kind: str, policy: str, port: int, workers: list[str], metrics_port: int) -> list[str]:
    module = {"vllm-router": "vllm_router.launch_router", "sglang-router": "sglang_router.launch_router"}[kind]
    return [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers,
            "--policy", policy, "--prometheus-port", str(metrics_port), "--health-check-interval-secs", "2",
            "--worker-startup-check-interval", "1", "--log-level", "warning" if kind == "vllm-router" else "warn"]


def workload(seed: int, num: int, num_prefixes: int, prefix_words: int, suffix_words: int) -> list[str]:
    rng = random.Random(seed)
    prefixes = [" ".join(rng.choice(WORDS) for _ in range(prefix_words)) for _ in range(num_prefixes)]
    # Each request's prefix drawn at random (not in turn: round robin over a cyclic order would split the
    # prefixes between the replicas as neatly as a cache-aware policy).
    return [f"{rng.choice(prefixes)}\n\nRequest {i}: " + " ".join(rng.choice(WORDS) for _ in range(suffix_words))
            for i in range(num)]


def prefix_counters(urls: list[str]) -> list[tuple[float, float, float]]:
    """(prefix cache queries, hits, finished requests) of each replica."""
    out = []
    for url in urls:
        values = {"queries": 0.0, "hits": 0.0, "done": 0.0}
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            name, _, value = line.rpartition(" ")
            if name.startswith("vllm:prefix_cache_queries_total"):
                values["queries"] += float(value)
            elif name.startswith("vllm:prefix_cache_hits_total"):
                values["hits"] += float(value)
            elif name.startswith("vllm:request_success_total"):
                values["done"] += float(value)
        out.append((values["queries"], values["hits"], values["done"]))
    return out


def ttft(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> float | None:
    """Seconds to the first streamed token of a completion; None on an error."""
    body = dict(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True, ignore_eos=True)
    start, first = time.perf_counter(), None
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return None
        for line in r.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - start
    return first


def run_setting(url: str, replicas: list[str], prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    before = prefix_counters(replicas)
    with httpx.Client(timeout=300) as client, concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        start = time.monotonic()
        ttfts = list(pool.map(lambda p: ttft(client, url, p, max_tokens), prompts))
        wall = time.monotonic() - start
    after = prefix_counters(replicas)
    delta = [tuple(a - b for a, b in zip(x, y)) for x, y in zip(after, before)]
    queries, hits = sum(d[0] for d in delta), sum(d[1] for d in delta)
    ok = [t for t in ttfts if t is not None]
    return dict(hit_rate=hits / queries if queries else 0.0, errors=len(ttfts) - len(ok),
                per_replica=[int(d[2]) for d in delta], ttft_p50_ms=1000 * statistics.median(ok),
                wall_s=wall)


def overhead(direct: str, routed: str, prompts: list[str]) -> dict:
    """Alternating single requests, direct and through the router: p50 TTFT of each (ms), and the p50 of the
    differences of neighbouring pairs (less sensitive to the machine's slow drifts)."""
    times = {"direct": [], "router": []}
    with httpx.Client(timeout=120) as client:
        for i, prompt in enumerate(prompts):
            order = [("direct", direct), ("router", routed)]
            for name, url in order if i % 2 else order[::-1]:
                times[name].append(ttft(client, url, prompt, 4))
    p50 = {name: 1000 * statistics.median([t for t in ts if t is not None]) for name, ts in times.items()}
    pairs = [r - d for d, r in zip(times["direct"], times["router"]) if d is not None and r is not None]
    return {**p50, "pair_diff": 1000 * statistics.median(pairs), "n": len(pairs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-port", type=int, default=19100)
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-words", type=int, default=180)
    p.add_argument("--suffix-words", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--overhead-requests", type=int, default=40)
    p.add_argument("--routers", nargs="+", default=["vllm-router", "sglang-router"])
    p.add_argument("--overhead-policies", nargs="+", default=["cache_aware", "round_robin"],
                   help="policies of the single-worker routers of the overhead measurement")
    p.add_argument("--engine-args", default="--max-model-len 512 --num-pages 160 --max-num-seqs 8 "
                   "--max-num-batched-tokens 128")
    p.add_argument("--logs", default="/tmp/bench_data_parallel")
    args = p.parse_args()
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    ports = [args.base_port + i for i in range(2)]
    replicas = [f"http://127.0.0.1:{port}" for port in ports]
    procs = [start([sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port),
                    "--data-parallel-rank", str(rank), *args.engine_args.split(), "--log-level", "warning"],
                   logs / f"replica{rank}.log") for rank, port in enumerate(ports)]
    results = {}
    try:
        for url, proc in zip(replicas, procs):
            wait_ok(url + "/health", proc)
        settings = [("1 replica (direct)", None, None)]
        settings += [(f"{kind} {policy}", kind, policy) for kind in args.routers
                     for policy in ("cache_aware", "round_robin")]
        settings = settings if args.num_requests else []
        for seed, (name, kind, policy) in enumerate(settings):
            prompts = workload(seed, args.num_requests, args.num_prefixes, args.prefix_words, args.suffix_words)
            if kind is None:
                results[name] = run_setting(replicas[0], replicas[:1], prompts, args.concurrency, args.max_tokens)
            else:
                port = args.base_port + 10 + 2 * seed
                router = start_router(kind, policy, port, replicas, logs / f"{kind}-{policy}.log")
                try:
                    results[name] = run_setting(f"http://127.0.0.1:{port}", replicas, prompts, args.concurrency,
                                                args.max_tokens)
                finally:
                    stop(router, grace=5)
            print(name, json.dumps(results[name]), flush=True)
        short = workload(1000, args.overhead_requests, args.overhead_requests, 20, 4)
        routers = [(k, p) for k in args.routers for p in args.overhead_policies] if args.overhead_requests else []
        for i, (kind, policy) in enumerate(routers):
            port = args.base_port + 30 + 2 * i
            router = start_router(kind, policy, port, replicas[:1], logs / f"{kind}-{policy}-overhead.log")
            try:
                name = f"{kind} {policy} overhead"
                results[name] = overhead(replicas[0], f"http://127.0.0.1:{port}", short)
            finally:
                stop(router, grace=5)
            print(name, json.dumps(results[name]), flush=True)
    finally:
        for proc in procs:
            stop(proc)
    (logs / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
