"""Soak: a mixed streaming / non-streaming load against a jaxpaged server for a given time, or two checkouts
soaked in alternating rounds; errors, latency percentiles and the server's RSS over time.

    python benchmarks/serve.py soak --base-url http://127.0.0.1:8000 --duration 60 --concurrency 16 [--api-key K]
                                    [--server-pid PID] [--model NAME] [--max-tokens 16] [--json out.json]
    python benchmarks/serve.py soak --before-tree /tmp/jp-base [--rounds 2] [--duration 120] [--concurrency 64]
                                    [--max-tokens 128] [--jaxpaged-args "..."] [--before-args "..."] [--json out.json]

One server (--base-url): the load runs against it. Streamed requests go through the serving benchmark's client
(serving_client.send_request: TTFT is the first chunk with text); RSS comes from psutil with --server-pid, else
from the server's /metrics `process_resident_memory_bytes`. Exit status 1 when any request failed (a 5xx, a
transport error or an error chunk).

--before-tree: each side's server is started fresh (benchmarks/servers.py: the same model and flags, the before
tree's code on its PYTHONPATH), soaked with the same clients and seeds, and stopped. Rounds alternate the order
(before first, then this checkout first, ...) so that a machine that speeds up or slows down during the run
favours neither side. Prints every run, then each round's ratios: p50 latency before / this and output tok/s
this / before.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import re
import signal
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import httpx

import servers
import serving_client as sc

WORDS = ["paged", "attention", "kernel", "cache", "prefix", "token", "stream", "batch", "jax", "model"]
_RSS = re.compile(r"^process_resident_memory_bytes\s+([0-9.e+]+)$", re.M)
# the soak's server flags (docs/performance.md)
SOAK_SERVER_ARGS = "--max-model-len 1024 --max-num-seqs 32 --max-num-batched-tokens 256"
SIDES = ("before", "this")


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
    if body["stream"]:
        req = sc.SampleRequest(body.get("prompt") or body["messages"][0]["content"], 0, body["max_tokens"])
        endpoint = "chat" if path.endswith("chat/completions") else "completions"
        res = await sc.send_request(client, path, body, endpoint, req, time.perf_counter(), {})
        if not res.success and res.error != sc.NO_TEXT:  # an answer of no text (EOS first) is still an answer
            stats.error(res.error.split(":")[0])
            return
        stats.tokens += res.usage_completion_tokens or 0
        stats.ttfts.append(res.ttft if res.success else res.latency)
    else:
        try:
            response = await client.post(path, json=body)
            if response.status_code != 200:
                stats.error(f"HTTP {response.status_code}")
                return
            stats.tokens += response.json()["usage"]["completion_tokens"]
        except (httpx.HTTPError, ValueError, KeyError) as err:
            stats.error(type(err).__name__)
            return
        stats.ttfts.append(time.monotonic() - start)
    stats.ok += 1
    stats.latencies.append(time.monotonic() - start)


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


def soak_parse_args(argv: list[str] | None) -> tuple[SoakConfig, str | None]:
    p = argparse.ArgumentParser(prog="serve.py soak", description="a mixed load against one server",
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



def soak_main(argv: list[str]) -> int:
    try:
        cfg, out = soak_parse_args(argv)
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


# ---------------------------------------------------------------------------------------------
# --before-tree: two checkouts, alternating rounds
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class SoakRun:
    index: int              # the round, from 0
    side: str               # "before" or "this"
    report: dict | None     # soak.report(), None when the server did not come up
    status: str = "ok"


def round_order(index: int) -> tuple[str, str]:
    """The sides of round `index` in the order they run: before first in even rounds, this first in odd."""
    return SIDES if index % 2 == 0 else SIDES[::-1]


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def round_ratios(runs: list[SoakRun]) -> dict[int, dict[str, float | None]]:
    """Per round: p50 latency before / this and output tok/s this / before (None where a side has no report)."""
    by_round: dict[int, dict[str, dict]] = {}
    for run in runs:
        if run.report is not None:
            by_round.setdefault(run.index, {})[run.side] = run.report
    ratios = {}
    for index, sides in sorted(by_round.items()):
        before, this = sides.get("before"), sides.get("this")
        ratios[index] = {
            "p50_before_over_this": _ratio(before and before["latency_s"]["p50"], this and this["latency_s"]["p50"]),
            "tok_s_this_over_before": _ratio(this and this["output_tokens_per_s"],
                                             before and before["output_tokens_per_s"]),
        }
    return ratios


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else format(value, spec) + suffix


def format_table(runs: list[SoakRun], labels: dict[str, str]) -> str:
    """Every run (a markdown table), then each round's ratios and their median."""
    lines = ["| round | code | requests ok | errors | output tok/s | p50 s | p90 s | p99 s | p50 TTFT s "
             "| RSS growth MiB |", "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        r = run.report
        if r is None:
            lines.append(f"| {run.index + 1} | {labels[run.side]} | {run.status} | | | | | | | |")
            continue
        errors = sum(r["errors"].values())
        lines.append(f"| {run.index + 1} | {labels[run.side]} | {r['requests_ok']} | {errors} | "
                     f"{r['output_tokens_per_s']:.1f} | {r['latency_s']['p50']:.2f} | {r['latency_s']['p90']:.2f} | "
                     f"{r['latency_s']['p99']:.2f} | {r['ttft_s']['p50']:.2f} | {_fmt(r['rss_growth_mib'], '.1f')} |")
    ratios = round_ratios(runs)
    lines.append("")
    for index, ratio in ratios.items():
        lines.append(f"round {index + 1}: p50 latency before / this {_fmt(ratio['p50_before_over_this'], '.2f', 'x')}, "
                     f"output tok/s this / before {_fmt(ratio['tok_s_this_over_before'], '.2f', 'x')}")
    p50s = [r["p50_before_over_this"] for r in ratios.values() if r["p50_before_over_this"] is not None]
    if p50s:
        lines.append(f"median over {len(p50s)} round(s): p50 latency before / this {statistics.median(p50s):.2f}x")
    return "\n".join(lines)


def run_side(args: argparse.Namespace, side: str, index: int, out_dir: Path) -> SoakRun:
    """Start one side's server, soak it, stop it; a server that fails to start is reported, not raised."""
    port = args.base_port
    spec = (servers.jaxpaged_before_spec(args, port) if side == "before"
            else servers.jaxpaged_spec(args, port))
    print(f"[soak] round {index + 1}: starting {side}, code of {spec.cwd or servers.REPO}", flush=True)
    try:
        with servers.running_server(spec, out_dir / f"{side}-{index + 1}.log", args.startup_timeout):
            report = asyncio.run(soak(args.soak))
    except RuntimeError as err:
        return SoakRun(index, side, None, f"failed: {err}"[:200])
    (out_dir / f"{side}-{index + 1}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"[soak] round {index + 1} {side}: {report['output_tokens_per_s']} tok/s, "
          f"p50 {report['latency_s']['p50']} s, errors {report['errors']}", flush=True)
    return SoakRun(index, side, report)


def trees_parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="serve.py soak --before-tree", description="two checkouts soaked in alternating rounds",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--before-tree", required=True, help="the jaxpaged checkout to run as 'before'")
    p.add_argument("--rounds", type=int, default=2, help="rounds of (before, this), the order alternating")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load per run")
    p.add_argument("--concurrency", type=int, default=64, help="soak clients")
    p.add_argument("--max-tokens", type=int, default=128, help="largest max_tokens a request asks for")
    p.add_argument("--seed", type=int, default=0, help="the clients' seeds (the same for every run)")
    p.add_argument("--jaxpaged-args", default=SOAK_SERVER_ARGS, help="flags for python -m server")
    p.add_argument("--before-args", default=None, help="flags for the before server (default: --jaxpaged-args)")
    p.add_argument("--base-port", type=int, default=18390)
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for each server")
    p.add_argument("--out-dir", default=None, help="server logs and soak JSON (default: a new folder under "
                                                   "~/.cache/jaxpaged/bench)")
    p.add_argument("--json", default=None, help="also write every run and the ratios here")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds={args.rounds}: must be >= 1")
    if not (Path(args.before_tree) / "server").is_dir():
        p.error(f"--before-tree={args.before_tree!r}: not a jaxpaged checkout (no server/ folder)")
    try:  # the soak's own checks, before any server starts; every run soaks with this config
        args.soak = SoakConfig(base_url=f"http://127.0.0.1:{args.base_port}", duration=args.duration,
                                    concurrency=args.concurrency, max_tokens=args.max_tokens, seed=args.seed)
    except ValueError as err:
        p.error(str(err))
    return args


def trees_main(argv: Sequence[str]) -> int:
    args = trees_parse_args(argv)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(args.out_dir or Path.home() / ".cache" / "jaxpaged" / "bench" / f"soak-{stamp}")
    out_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, servers._on_signal)  # stop the server running, then exit
    signal.signal(signal.SIGINT, servers._on_signal)
    runs = []
    try:
        for index in range(args.rounds):
            for side in round_order(index):
                runs.append(run_side(args, side, index, out_dir))
    finally:
        servers.stop_all()
    labels = {"before": f"before ({args.before_tree} @ {servers.commit_of(Path(args.before_tree))})",
              "this": f"this checkout ({servers.commit_of(servers.REPO)})"}
    table = format_table(runs, labels)
    print(f"\n## serve.py soak --before-tree {stamp} (logs and JSON in {out_dir})\n\n{table}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": [dataclasses.asdict(r) for r in runs],
                                               "ratios": round_ratios(runs)}, indent=2) + "\n")
    return 1 if any(r.report is None or r.report["errors"] for r in runs) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """One server, or two checkouts when --before-tree is given."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--before-tree" or a.startswith("--before-tree=") for a in argv):
        return trees_main(argv)
    return soak_main(argv)


if __name__ == "__main__":
    sys.exit(main())
