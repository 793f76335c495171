"""The soak (scripts/soak.py) against two jaxpaged checkouts in one run: a before tree and this one.

    python scripts/compare_soak.py --before-tree /tmp/jp-base [--rounds 2] [--duration 120] [--concurrency 64]
                                   [--max-tokens 128] [--jaxpaged-args "..."] [--before-args "..."] [--json out.json]

Each server is started fresh (compare_servers.py's launcher: the same model and flags, the before tree's
code on its PYTHONPATH), soaked with the same clients and seeds, and stopped. Rounds alternate the order
(before first, then this checkout first, ...) so that a machine that speeds up or slows down during the run
favours neither side. Prints every run, then each round's ratios: p50 latency before / this and output tok/s
this / before (the soak's target in issue 21 is the p50 ratio against the issue's code).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import compare_servers
import soak

# the soak's server flags (docs/performance.md)
SOAK_SERVER_ARGS = "--max-model-len 1024 --max-num-seqs 32 --max-num-batched-tokens 256"
SIDES = ("before", "this")


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
    spec = (compare_servers.jaxpaged_before_spec(args, port) if side == "before"
            else compare_servers.jaxpaged_spec(args, port))
    print(f"[compare_soak] round {index + 1}: starting {side}, code of {spec.cwd or compare_servers.REPO}", flush=True)
    try:
        with compare_servers.running_server(spec, out_dir / f"{side}-{index + 1}.log", args.startup_timeout):
            report = asyncio.run(soak.soak(args.soak))
    except RuntimeError as err:
        return SoakRun(index, side, None, f"failed: {err}"[:200])
    (out_dir / f"{side}-{index + 1}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"[compare_soak] round {index + 1} {side}: {report['output_tokens_per_s']} tok/s, "
          f"p50 {report['latency_s']['p50']} s, errors {report['errors']}", flush=True)
    return SoakRun(index, side, report)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
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
        args.soak = soak.SoakConfig(base_url=f"http://127.0.0.1:{args.base_port}", duration=args.duration,
                                    concurrency=args.concurrency, max_tokens=args.max_tokens, seed=args.seed)
    except ValueError as err:
        p.error(str(err))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(args.out_dir or Path.home() / ".cache" / "jaxpaged" / "bench" / f"soak-{stamp}")
    out_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, compare_servers._on_signal)  # stop the server running, then exit
    signal.signal(signal.SIGINT, compare_servers._on_signal)
    runs = []
    try:
        for index in range(args.rounds):
            for side in round_order(index):
                runs.append(run_side(args, side, index, out_dir))
    finally:
        compare_servers.stop_all()
    labels = {"before": f"before ({args.before_tree} @ {compare_servers.commit_of(Path(args.before_tree))})",
              "this": f"this checkout ({compare_servers.commit_of(compare_servers.REPO)})"}
    table = format_table(runs, labels)
    print(f"\n## compare_soak {stamp} (logs and JSON in {out_dir})\n\n{table}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": [dataclasses.asdict(r) for r in runs],
                                               "ratios": round_ratios(runs)}, indent=2) + "\n")
    return 1 if any(r.report is None or r.report["errors"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
