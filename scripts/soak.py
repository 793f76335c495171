"""Soak test: a mixed streaming / non-streaming load against any OpenAI-compatible jaxpaged server for a
given time; reports errors, latency percentiles and the server's RSS over time.

    python scripts/soak.py --base-url http://127.0.0.1:8000 --duration 60 --concurrency 16 [--api-key K]
                           [--server-pid PID] [--model NAME] [--max-tokens 16] [--json out.json]

RSS comes from psutil with --server-pid, else from the server's /metrics `process_resident_memory_bytes`.
Exit status 1 when any request failed (a 5xx, a transport error or an error chunk).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import re
import sys
import time

import httpx

WORDS = ["paged", "attention", "kernel", "cache", "prefix", "token", "stream", "batch", "jax", "model"]
_RSS = re.compile(r"^process_resident_memory_bytes\s+([0-9.e+]+)$", re.M)


@dataclasses.dataclass(frozen=True)
class SoakConfig:
    base_url: str
    duration: float
    concurrency: int
    api_key: str | None = None
    server_pid: int | None = None
    model: str | None = None
    max_tokens: int = 16
    max_prompt_words: int = 40
    sample_every: float = 5.0
    request_timeout: float = 120.0
    seed: int = 0

    def __post_init__(self):
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url={self.base_url!r}: must start with http:// or https://")
        if not 0 < self.duration <= 7 * 24 * 3600:
            raise ValueError(f"--duration={self.duration}: must be in (0, 1 week] seconds")
        if not 1 <= self.concurrency <= 4096:
            raise ValueError(f"--concurrency={self.concurrency}: must be in [1, 4096]")
        if not 1 <= self.max_tokens <= 4096:
            raise ValueError(f"--max-tokens={self.max_tokens}: must be in [1, 4096]")
        if not 1 <= self.max_prompt_words <= 100_000:
            raise ValueError(f"--max-prompt-words={self.max_prompt_words}: must be in [1, 100000]")
        if self.sample_every <= 0 or self.request_timeout <= 0:
            raise ValueError("--sample-every and --request-timeout must be > 0")


@dataclasses.dataclass
class Stats:
    latencies: list[float] = dataclasses.field(default_factory=list)
    ttfts: list[float] = dataclasses.field(default_factory=list)
    ok: int = 0
    errors: dict[str, int] = dataclasses.field(default_factory=dict)
    tokens: int = 0
    rss: list[tuple[float, int]] = dataclasses.field(default_factory=list)

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


def percentiles(values: list[float], ps=(50, 90, 99)) -> dict[str, float]:
    if not values:
        return {f"p{p}": float("nan") for p in ps}
    ordered = sorted(values)
    return {f"p{p}": ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))] for p in ps}


def make_request(rng: random.Random, cfg: SoakConfig) -> tuple[str, dict]:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, cfg.max_prompt_words)))
    body = dict(max_tokens=rng.randint(1, cfg.max_tokens), stream=rng.random() < 0.7,
                temperature=rng.choice([0.0, 0.7, 1.0]), top_p=rng.choice([1.0, 0.9]), n=rng.choice([1, 1, 1, 2]))
    if cfg.model:
        body["model"] = cfg.model
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": prompt}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}


async def one_request(client: httpx.AsyncClient, path: str, body: dict, stats: Stats) -> None:
    start = time.monotonic()
    try:
        if body["stream"]:
            await _streamed(client, path, body, stats, start)
        else:
            response = await client.post(path, json=body)
            if response.status_code != 200:
                stats.error(f"http_{response.status_code}")
                return
            stats.tokens += response.json()["usage"]["completion_tokens"]
            stats.ttfts.append(time.monotonic() - start)
        stats.ok += 1
        stats.latencies.append(time.monotonic() - start)
    except httpx.HTTPStatusError as err:
        stats.error(f"http_{err.response.status_code}")
    except (httpx.HTTPError, ValueError, KeyError) as err:
        stats.error(type(err).__name__)


async def _streamed(client, path, body, stats: Stats, start: float) -> None:
    first = None
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise httpx.HTTPStatusError(f"status {response.status_code}", request=response.request,
                                        response=response)
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise ValueError(f"error chunk: {chunk['error'].get('message')}")
            first = first or time.monotonic()
            if chunk.get("usage"):
                stats.tokens += chunk["usage"]["completion_tokens"]
    stats.ttfts.append((first or time.monotonic()) - start)


async def worker(client: httpx.AsyncClient, cfg: SoakConfig, stats: Stats, deadline: float, seed: int) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        path, body = make_request(rng, cfg)
        await one_request(client, path, body, stats)


async def sample_rss(client: httpx.AsyncClient, cfg: SoakConfig, stats: Stats, deadline: float, t0: float) -> None:
    process = None
    if cfg.server_pid is not None:
        import psutil
        process = psutil.Process(cfg.server_pid)
    while True:
        rss = None
        if process is not None:
            rss = process.memory_info().rss
        else:
            try:
                match = _RSS.search((await client.get("/metrics")).text)
                rss = int(float(match.group(1))) if match else None
            except httpx.HTTPError:
                pass
        if rss is not None:
            stats.rss.append((round(time.monotonic() - t0, 1), rss))
        if time.monotonic() >= deadline:
            return
        await asyncio.sleep(min(cfg.sample_every, max(0.0, deadline - time.monotonic())))


async def soak(cfg: SoakConfig) -> dict:
    stats = Stats()
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency + 4)
    async with httpx.AsyncClient(base_url=cfg.base_url, headers=headers, timeout=cfg.request_timeout,
                                 limits=limits) as client:
        t0 = time.monotonic()
        deadline = t0 + cfg.duration
        await asyncio.gather(sample_rss(client, cfg, stats, deadline, t0),
                             *(worker(client, cfg, stats, deadline, cfg.seed + i) for i in range(cfg.concurrency)))
        elapsed = time.monotonic() - t0
    return report(cfg, stats, elapsed)


def report(cfg: SoakConfig, stats: Stats, elapsed: float) -> dict:
    mib = [rss / 2**20 for _, rss in stats.rss]
    return {
        "duration_s": round(elapsed, 1), "concurrency": cfg.concurrency, "requests_ok": stats.ok,
        "errors": stats.errors, "requests_per_s": round(stats.ok / elapsed, 2),
        "output_tokens_per_s": round(stats.tokens / elapsed, 1),
        "latency_s": {k: round(v, 3) for k, v in percentiles(stats.latencies).items()},
        "ttft_s": {k: round(v, 3) for k, v in percentiles(stats.ttfts).items()},
        "rss_mib_over_time": [(t, round(rss / 2**20, 1)) for t, rss in stats.rss],
        "rss_growth_mib": round(mib[-1] - mib[0], 1) if len(mib) > 1 else None,
    }


def parse_args(argv: list[str] | None) -> tuple[SoakConfig, str | None]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=16, help="clients sending back to back")
    p.add_argument("--api-key", default=None)
    p.add_argument("--server-pid", type=int, default=None, help="read RSS with psutil (else from /metrics)")
    p.add_argument("--model", default=None, help="`model` to send (default: the server's first name)")
    p.add_argument("--max-tokens", type=int, default=16, help="largest max_tokens a request asks for")
    p.add_argument("--max-prompt-words", type=int, default=40, help="longest prompt, in words")
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--json", default=None, help="also write the report here")
    ns = p.parse_args(argv)
    cfg = SoakConfig(base_url=ns.base_url.rstrip("/"), duration=ns.duration, concurrency=ns.concurrency,
                     api_key=ns.api_key, server_pid=ns.server_pid, model=ns.model, max_tokens=ns.max_tokens,
                     max_prompt_words=ns.max_prompt_words, sample_every=ns.sample_every)
    return cfg, ns.json


def main(argv: list[str] | None = None) -> int:
    try:
        cfg, out = parse_args(argv)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    result = asyncio.run(soak(cfg))
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
