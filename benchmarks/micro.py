"""Micro-benchmarks of one part of the engine, each a subcommand, each printing ours beside its baseline.

    python benchmarks/micro.py roofline [--model smollm2-135m-instruct] [--dtype float32] [--json]
    python benchmarks/micro.py host-loop [--tree OTHER_CHECKOUT] [--served] [--phases]
    python benchmarks/micro.py startup [--tree OTHER_CHECKOUT --tree .] [--warm-runs 3] [-- SERVER FLAGS]
    python benchmarks/micro.py step ...   # benchmarks/cpu_step.py: where one CPU decode step goes
    python benchmarks/micro.py load [--tree OTHER_CHECKOUT --tree .] [--model M] [--rounds 3]

roofline   batch-1 decode's weight-read roofline on this machine: a read-bandwidth probe and the weight bytes
host-loop  the engine's host work per step at high concurrency, this checkout beside another
startup    `python -m server` to /health 200, cold then warm, per phase, checkouts side by side (its code is in
           servers.py, beside the server launcher it uses)
step       the parts of one CPU decode step (forward, dots, attention, sampler, host), cpu_step.py's flags
load       a GGUF model's in-process load (open_gguf, then load_model without the model cache), checkouts side by
           side, a fresh process per start, the checkouts alternating

`micro.py <command> -h` prints the command's full description. Nothing here imports jaxpaged at the top: a
host-loop worker imports the checkout it measures, and startup runs each checkout's server as a subprocess.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

ROOFLINE_DOC = """Batch-1 decode's weight-read roofline on this machine: a memory-bandwidth probe and the model's weight bytes.

A decode step at batch 1 reads every weight once (a tied embedding once, as the LM head; the embedding
row lookup and the KV cache are left out: a few MB against ~540 MB for SmolLM2-135M in float32), so no
engine decodes faster than  roofline tok/s = read bandwidth / weight bytes.

The bandwidth is the best of these read probes on one --probe-mib float32 array (far above the caches),
each timed --rounds times in this process (fastest round per probe: the roofline is an upper bound):
  numpy sum, 1 thread        np.add.reduce over the array
  numpy sum, N threads       one np.add.reduce per thread over 1/N of it (numpy drops the GIL), N = cores
  numpy matvec               the array as [R, 1024] times a vector (numpy's BLAS gemv, its threads)
  jax matvec                 the same on the default device (XLA:CPU's dot, its threads)
  jax sum                    a jitted jnp.sum
A sum is often bound by its adds, a matrix-vector product by its reads; the largest rate is the
roofline's bandwidth: the highest read rate this process reached.

    python benchmarks/micro.py roofline [--model smollm2-135m-instruct] [--dtype float32] [--json]

`benchmarks/serve.py peers --roofline` runs this (as a subprocess, --json) and prints each server's
concurrency-1 decode rate (1000 / median TPOT) as a share of the roofline; `benchmarks/cpu_step.py`
prints it next to the engine's batch-1 step."""
HOST_LOOP_DOC = """The engine's host work per step at high concurrency, on any machine (issue 15's misses at 256 concurrent).

    python benchmarks/micro.py host-loop                          # 64 and 256 concurrent decodes, this tree
    python benchmarks/micro.py host-loop --tree /tmp/jp-base      # ... and another checkout, in one run
    python benchmarks/micro.py host-loop --served --phases        # DELTA outputs, detokenized; where the time goes

On the H200 (2026-12-04 run) a 256-row decode step took 22.3 ms against an 11.6 ms forward: the Python host loop
(schedule, step inputs, launch, outputs for 256 requests) outran the device, so async scheduling could not hide
it. This measures that host work on a CPU with a model so small (2 layers of width 64, random weights) that the
device's part is about a ms: the GPU's engine (async scheduling with every step kept in flight, the sampler fused
into the step program), N requests of --prompt-len random tokens, --output-len out each (EOS ignored, greedy), all
added at once, a KV pool that holds them all. Per steady decode step (every request feeding one token): the
step's wall ms, the ms the host was blocked reading the device's tokens (the waits of `jax.device_get` and of the
engine's `fetch` timed), and the host's ms (wall - blocked), also per row, and the CPU time of the engine's thread
in the step (steadier than wall time on a shared machine). The host
figure is what a device whose step is longer hides (async scheduling) and what one whose step is shorter waits
for. --served: outputs as the server asks for them (DELTA, detokenized with the default model's tokenizer; the
model's vocabulary is then that tokenizer's). --phases: this tree's host ms split by engine method (its timers add
a little host time to this side only: leave it out when comparing trees). --emulate-step-ms: each step program
takes that long on an emulated device (`emulate_device`); the rows then add the share of the whole run that device
sat idle (host time it did not hide, prefill and ramp included). Each worker runs a batch --repeats
times after a warm run and keeps its best run (least host ms): on a shared machine interference only adds time.

--tree runs the same measurement with another checkout's jaxpaged (its own process, the same arguments), rounds
alternating which side goes first, and prints both sides and this tree's speed-up (the other's host ms / ours)."""


# ---- roofline ------------------------------------------------------------------------------------------------

def _best_seconds(fn, rounds: int) -> float:
    fn()  # first touch / compile
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def read_bandwidth(probe_mib: int = 512, rounds: int = 5, threads: int | None = None) -> dict[str, float]:
    """{probe name: bytes read per second} for the read probes of the module docstring, and "best"."""
    n = probe_mib * (1 << 20) // 4
    x = np.random.default_rng(0).random(n, dtype=np.float32)
    nbytes = x.nbytes
    out = {"numpy sum, 1 thread": nbytes / _best_seconds(lambda: np.add.reduce(x), rounds)}
    threads = threads or os.cpu_count() or 1
    chunks = np.array_split(x, threads)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        out[f"numpy sum, {threads} threads"] = nbytes / _best_seconds(
            lambda: list(pool.map(np.add.reduce, chunks)), rounds)
    matrix, vector = x[:n - n % 1024].reshape(-1, 1024), np.ones(1024, np.float32)
    out["numpy matvec"] = matrix.nbytes / _best_seconds(lambda: matrix @ vector, rounds)
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    md, vd = jnp.asarray(matrix), jnp.asarray(vector)
    matvec = jax.jit(jnp.matmul)
    out["jax matvec"] = matrix.nbytes / _best_seconds(lambda: matvec(md, vd).block_until_ready(), rounds)
    xd = jnp.asarray(x)
    total = jax.jit(jnp.sum)
    out["jax sum"] = nbytes / _best_seconds(lambda: total(xd).block_until_ready(), rounds)
    out["best"] = max(out.values())
    return out


def weight_bytes(model: str = "smollm2-135m-instruct", dtype: str = "float32") -> int:
    """Bytes of weights a batch-1 decode step reads: every param of the model at `dtype` (the
    GGUF's config, no weights loaded; a tied embedding counted once)."""
    from jaxpaged.models.gguf_loader import gguf_config, open_gguf  # pylint: disable=import-outside-toplevel
    from jaxpaged.models.loader import parse_dtype, resolve_model_path  # pylint: disable=import-outside-toplevel
    from jaxpaged.models.params import param_shapes  # pylint: disable=import-outside-toplevel
    config = gguf_config(open_gguf(resolve_model_path(model)))
    shapes = param_shapes(config)
    leaves = [shapes["embed"], shapes["final_norm"], *shapes["layers"].values()]
    if "lm_head" in shapes:
        leaves.append(shapes["lm_head"])
    itemsize = (parse_dtype(dtype) or np.dtype(np.float32)).itemsize
    return itemsize * sum(math.prod(s) for s in leaves)


def roofline(model: str = "smollm2-135m-instruct", dtype: str = "float32", probe_mib: int = 512,
             rounds: int = 5) -> dict:
    """{"bandwidth": {probe: B/s}, "weight_bytes": int, "tok_s": best bandwidth / weight bytes, ...}."""
    bandwidth = read_bandwidth(probe_mib, rounds)
    nbytes = weight_bytes(model, dtype)
    return {"model": model, "dtype": dtype, "bandwidth": bandwidth, "weight_bytes": nbytes,
            "tok_s": bandwidth["best"] / nbytes, "probe_mib": probe_mib, "cpu_count": os.cpu_count(),
            "loadavg": os.getloadavg()}


def describe(r: dict) -> str:
    """One line: the probes, the weight bytes and the roofline."""
    probes = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in r["bandwidth"].items() if k != "best")
    return (f"weight-read roofline (batch 1): {r['model']} {r['dtype']} weights {r['weight_bytes'] / 1e6:.0f} MB, "
            f"read bandwidth {r['bandwidth']['best'] / 1e9:.1f} GB/s (best of: {probes} GB/s) -> "
            f"{r['tok_s']:.1f} tok/s (load average {r['loadavg'][0]:.1f})")


def roofline_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="micro.py roofline", description=ROOFLINE_DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--probe-mib", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = p.parse_args(argv)
    r = roofline(args.model, args.dtype, args.probe_mib, args.rounds)
    print(json.dumps(r) if args.json else describe(r), flush=True)
    return 0


# ---- host-loop -----------------------------------------------------------------------------------------------

# (object attribute path from the engine, method) timed by --phases; a name a tree lacks is skipped
PHASES = (("scheduler", "schedule"), ("scheduler", "update_from_output"), ("runner", "prepare"), ("runner", "pack"),
          ("runner", "_sampling_batch"), ("runner", "_step_sampling"), ("runner", "_run_fused"),
          ("runner", "dispatch"), ("", "_emit"), ("", "_emit_step"), ("", "_outputs"))


def host_loop_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="micro.py host-loop", description=HOST_LOOP_DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="64,256", help="concurrent requests, comma-separated")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--served", action="store_true", help="DELTA outputs, detokenized (the default model's tokenizer)")
    ap.add_argument("--phases", action="store_true", help="split this tree's host ms by engine method")
    ap.add_argument("--tree", default=None, help="another checkout to measure beside this one")
    ap.add_argument("--rounds", type=int, default=3, help="with --tree: runs a side, alternating the order")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs a batch in each worker: the best is kept")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sample at this temperature, seeded (random rows: the sampler's flags are read back)")
    ap.add_argument("--emulate-step-ms", type=float, default=0.0,
                    help="time each step as a device's of this many ms (emulate_device)")
    ap.add_argument("--emulate-row-ms", type=float, default=0.0, help="with --emulate-step-ms: ms a token past the first")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # the checkout a worker process imports
    return ap.parse_args(argv)


# ---- one side: a worker process importing one checkout's jaxpaged ---------------------------------------


def tiny_model(served: bool):
    """A 2-layer width-64 Llama of random bf16 weights (gpu_engine.py's layout); --served: with the default
    model's tokenizer and its vocabulary. gpu_engine.random_model's recipe, not imported: a worker may run an
    older checkout, whose jaxpaged may lack names that script imports."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jaxpaged.models.llama import LlamaConfig
    try:
        from jaxpaged.models.params import init_params
    except ImportError:  # a checkout from before models/params.py
        from jaxpaged.models.llama import init_params
    from jaxpaged.models.loader import DEFAULT_MODEL, LoadedModel, load_model
    from jaxpaged.tokenizer import GenerationConfig
    from jaxpaged.worker.weight_layout import resolve_weight_layout, to_weight_layout
    tokenizer = load_model(DEFAULT_MODEL).tokenizer if served else None
    vocab = len(tokenizer) if tokenizer is not None else 2048
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192)
    layout = resolve_weight_layout("auto", True, jax.default_backend())
    params = to_weight_layout(config, init_params(config, jax.random.PRNGKey(0), jnp.bfloat16), layout, consume=True)
    return LoadedModel(config=config, params=params, tokenizer=tokenizer, generation_config=GenerationConfig(),
                       source=Path("random-tiny"), dtype=np.dtype(jnp.bfloat16), load_seconds=0.0)


class Clock:
    """Accumulates the host's blocked time (the wait for the device in jax.device_get, and in the engine's own
    `fetch` where a checkout has one) and, with phases, the time in each PHASES method."""

    def __init__(self):
        self.blocked, self.phases = 0.0, collections.Counter()
        self.device_busy = 0.0  # --emulate-step-ms: the emulated device's busy seconds (emulate_device)

    def watch_device_get(self):
        import jax
        jax.device_get = self._blocking(jax.device_get)
        # jaxpaged/sample/sampler.py's `fetch` (device_get without its Python work on CPU), under every name a
        # loaded module imported it by
        fetch = getattr(sys.modules.get("jaxpaged.sample.sampler"), "fetch", None)
        if fetch is not None:
            timed_fetch = self._blocking(fetch)
            for name, module in list(sys.modules.items()):
                if name.startswith("jaxpaged") and getattr(module, "fetch", None) is fetch:
                    module.fetch = timed_fetch

    def _blocking(self, get):
        """`get` (a device-to-host read), its wait for the device added to the blocked time."""
        import jax

        def timed(x):
            t0 = time.perf_counter()
            jax.block_until_ready(x)
            self.blocked += time.perf_counter() - t0
            return get(x)
        return timed

    def watch_phases(self, engine) -> None:
        for path, name in PHASES:
            owner = getattr(engine, path) if path else engine
            method = getattr(owner, name, None)
            if method is not None:
                setattr(owner, name, self._timed(method, f"{path}.{name}" if path else name))

    def _timed(self, method, label: str):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.phases[label] += time.perf_counter() - t0
        return timed


def run_batch(engine, clock: Clock, batch: int, args, vocab: int, tag: str) -> dict:
    """Generate batch x (prompt_len in, output_len out); the steady decode steps' medians and the run's tok/s."""
    import numpy as np
    from jaxpaged.sampling_params import RequestOutputKind, SamplingParams
    kind = RequestOutputKind.DELTA if args.served else RequestOutputKind.CUMULATIVE
    rng = np.random.default_rng(batch)
    for i in range(batch):
        params = SamplingParams(temperature=args.temperature, seed=i if args.temperature else None,
                                max_tokens=args.output_len, ignore_eos=True, detokenize=args.served, output_kind=kind)
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": rng.integers(0, vocab, args.prompt_len).tolist()},
                           params)
    steps, start, produced, busy = [], time.perf_counter(), 0, clock.device_busy
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        steady = len(running) == batch and all(r.num_output_tokens >= 2 for r in running)
        blocked, phases = clock.blocked, dict(clock.phases)
        t0, cpu0 = time.perf_counter(), time.thread_time()
        outputs = engine.step()
        wall, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
        produced += sum(len(c.token_ids) for o in outputs for c in o.outputs) if args.served else \
            sum(len(o.outputs[0].token_ids) for o in outputs if o.finished)
        if steady:
            steps.append((wall, clock.blocked - blocked, {k: v - phases.get(k, 0.0) for k, v in clock.phases.items()},
                          cpu))
    seconds = time.perf_counter() - start
    busy = clock.device_busy - busy
    steps = steps[2:-2]  # the first steady steps and the last (a request may finish there)
    if not steps:
        raise SystemExit(f"b={batch}: no steady decode steps (every request decoding at once); raise --output-len")
    wall = statistics.median(s[0] for s in steps)
    blocked = statistics.median(s[1] for s in steps)
    host = statistics.median(s[0] - s[1] for s in steps)
    cpu = statistics.median(s[3] for s in steps)
    phases = {k: statistics.median(s[2].get(k, 0.0) for s in steps) for k in clock.phases}
    return dict(batch=batch, steps=len(steps), wall_ms=1e3 * wall, blocked_ms=1e3 * blocked, host_ms=1e3 * host,
                host_cpu_ms=1e3 * cpu, host_us_per_row=1e6 * host / batch, tok_s=produced / seconds,
                not_hidden=1 - busy / seconds if busy else None, phases_ms={k: 1e3 * v for k, v in phases.items()})


def host_loop_worker(args) -> None:
    """Measure every batch with the checkout at args.worker; one JSON line per batch on stdout."""
    sys.path.insert(0, args.worker)
    from jaxpaged import EngineArgs, LLMEngine  # the public names: a worker may import an older checkout
    loaded = tiny_model(args.served)
    batches = [int(b) for b in args.batches.split(",")]
    max_model_len = args.prompt_len + args.output_len + 16
    num_pages = max(batches) * -(-max_model_len // 16) + 64  # every request at once: no preemption
    engine = LLMEngine(EngineArgs(model="random", max_model_len=max_model_len, max_num_seqs=max(batches),
                                  max_num_batched_tokens=2048, num_pages=num_pages,
                                  fuse_sampler="on", async_scheduling=True, async_scheduling_max_tokens=2048,
                                  # the GPU's default (the CPU's is 4): prompts are admitted at a GPU's pace
                                  max_num_partial_prefills=16),
                       loaded=loaded)
    clock = Clock()
    if args.emulate_step_ms:
        emulate_device(engine.runner, args.emulate_step_ms, args.emulate_row_ms, clock)
    clock.watch_device_get()
    if args.phases:
        clock.watch_phases(engine)
    vocab = loaded.config.vocab_size
    for batch in batches:
        run_batch(engine, clock, batch, args, vocab, f"warm-{batch}")  # compiles what warm-up left, fills caches
        runs = [run_batch(engine, clock, batch, args, vocab, f"run-{batch}-{i}") for i in range(args.repeats)]
        print(json.dumps(min(runs, key=lambda r: r["host_ms"])), flush=True)


def emulate_device(runner, step_ms: float, row_ms: float, clock: Clock | None = None) -> None:
    """--emulate-step-ms: give `runner` a device timeline. A step program (`_run_fused`, `_run`) occupies the
    device from its launch, or the end of the step before if later, for step_ms + row_ms per token the step feeds
    past the first; reading the step's tokens (`PendingStep.result`, the end of `execute_model`) waits for its end,
    and so does reading a fused step's sampler flags when it has random rows (its `finish_sample`: the next step's
    dispatch reads them, `PendingStep.carry`; other reads of a verification's random rows are not modelled).
    The host's work before the launch (inputs) and after the read (outputs) stays exposed, as on a device; the real
    forward (a 2-layer model) runs meanwhile, well within a step."""
    free_at, fed, ends = [0.0], [1], {}  # ends: {id(pending step): when its program ends}, until dispatch_sample

    def launch(program):
        def launched(*args, **kwargs):
            out = program(*args, **kwargs)
            busy = (step_ms + row_ms * max(fed[0] - 1, 0)) / 1e3
            free_at[0] = max(time.perf_counter(), free_at[0]) + busy
            if clock is not None:
                clock.device_busy += busy
            return out
        return launched

    def wait(until: float) -> None:
        time.sleep(max(0.0, until - time.perf_counter()))

    dispatch, execute, dispatch_sample = runner.dispatch, runner.execute_model, runner.dispatch_sample

    def dispatched(out, *rest):
        fed[0] = out.num_scheduled_tokens
        pending = dispatch(out, *rest)
        result, end = pending.result, free_at[0]
        pending.result = lambda: wait(end) or result()
        ends[id(pending)] = end
        return pending

    def sample_dispatched(pending, *rest):  # a fused step with random rows: its finish reads the sampler's flags
        dispatch_sample(pending, *rest)
        finish, end = pending.finish_sample, ends.pop(id(pending), 0.0)
        if _sampler_flags(pending) is not None:
            pending.finish_sample = lambda: wait(end) or finish()

    def executed(out, *rest):
        fed[0] = out.num_scheduled_tokens
        output = execute(out, *rest)
        wait(free_at[0])
        return output

    runner._run_fused, runner._run = launch(runner._run_fused), launch(runner._run)
    runner.dispatch, runner.execute_model, runner.dispatch_sample = dispatched, executed, sample_dispatched


def _sampler_flags(pending):
    """A fused step's sampler flags (None: no random row), wherever the checkout keeps them: `fused_sample`, or
    (before issue 61's trims) `fused.sample`."""
    sample = getattr(pending, "fused_sample", None)
    if sample is None and getattr(pending, "fused", None) is not None:
        sample = pending.fused.sample
    return None if sample is None else sample.flags


# ---- the driver: sides in their own processes ---------------------------------------------------------------


def measure_tree(root: str, args) -> list[dict]:
    """One worker process over the checkout at `root`: its per-batch rows."""
    argv = [sys.executable, str(Path(__file__).resolve()), "host-loop", "--worker", root, "--batches", args.batches,
            "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len), "--repeats", str(args.repeats),
            "--temperature", str(args.temperature), "--emulate-step-ms", str(args.emulate_step_ms),
            "--emulate-row-ms", str(args.emulate_row_ms)]
    argv += ["--served"] * args.served + ["--phases"] * args.phases
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"the worker over {root} failed:\n{done.stderr[-4000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _not_hidden(row: dict) -> str:
    """--emulate-step-ms: the share of the whole run the emulated device was idle (the host's time it did not
    hide: prefill and ramp steps included)."""
    return "" if row.get("not_hidden") is None else f"  host not hidden {100 * row['not_hidden']:.1f}% of the run"


def print_rows(label: str, rows: list[dict], phases: bool) -> None:
    for r in rows:
        print(f"{label:6s} b={r['batch']:<4d} step {r['wall_ms']:6.2f} ms  blocked {r['blocked_ms']:6.2f} ms  "
              f"host {r['host_ms']:6.2f} ms ({r['host_us_per_row']:5.1f} us/row; its thread's CPU {r['host_cpu_ms']:6.2f} "
              f"ms)  {r['tok_s']:8.0f} output tok/s "
              f"(whole run)  [{r['steps']} steady steps]{_not_hidden(r)}", flush=True)
        if phases and r["phases_ms"]:
            print("         " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["phases_ms"].items(),
                                                                          key=lambda kv: -kv[1])), flush=True)


def host_loop_main(argv=None) -> int:
    args = host_loop_args(argv)
    if args.worker:
        host_loop_worker(args)
        return 0
    sides = [("this", str(ROOT))] + ([("other", str(Path(args.tree).resolve()))] if args.tree else [])
    rounds = args.rounds if args.tree else 1
    results: dict[str, list[list[dict]]] = {label: [] for label, _ in sides}
    for i in range(rounds):
        for label, root in (sides if i % 2 == 0 else sides[::-1]):
            rows = measure_tree(root, args)
            results[label].append(rows)
            print_rows(label, rows, args.phases and label == "this")
    if args.tree:
        print(f"\nmedian over {rounds} rounds: host ms per steady decode step (other = {args.tree})")
        for j, batch in enumerate(int(b) for b in args.batches.split(",")):
            med = {key: {label: statistics.median(run[j][key] for run in runs) for label, runs in results.items()}
                   for key in ("host_ms", "host_cpu_ms", "tok_s")}
            hidden = {label: [run[j].get("not_hidden") for run in runs] for label, runs in results.items()}
            host, cpu, tok = med["host_ms"], med["host_cpu_ms"], med["tok_s"]
            print(f"b={batch:<4d} host this {host['this']:6.2f} ms, other {host['other']:6.2f} ms: "
                  f"{host['other'] / host['this']:.2f}x; the thread's CPU this {cpu['this']:6.2f} ms, other "
                  f"{cpu['other']:6.2f} ms: {cpu['other'] / cpu['this']:.2f}x; output tok/s this {tok['this']:.0f}, "
                  f"other {tok['other']:.0f}: {tok['this'] / tok['other']:.2f}x"
                  + ("" if None in hidden["this"] + hidden["other"] else
                     f"; host not hidden this {100 * statistics.median(hidden['this']):.1f}%, other "
                     f"{100 * statistics.median(hidden['other']):.1f}% of the run"))
    return 0


def load_worker(tree: str, model: str) -> None:
    """In a fresh process importing `tree`: one JSON line, `open_gguf` then `load_model` (no model cache) seconds."""
    sys.path.insert(0, tree)
    import jax  # pylint: disable=import-outside-toplevel
    jax.devices()  # JAX starts before either is timed
    from jaxpaged.models import gguf_loader  # pylint: disable=import-outside-toplevel
    from jaxpaged.models.loader import load_model, resolve_model_path  # pylint: disable=import-outside-toplevel
    path = resolve_model_path(model)
    start = time.perf_counter()
    gguf_loader.open_gguf(path)
    opened = time.perf_counter()
    load_model(str(path), cache_dir=None)
    print(json.dumps({"open_gguf": opened - start, "load_model": time.perf_counter() - opened}))


def load_main(argv=None) -> int:
    """`micro.py load`: the model cache left out, so the GGUF file is read as on a cold start. Prints each
    checkout's median and range and the first checkout's median over each other's (> 1: the other is faster)."""
    p = argparse.ArgumentParser(prog="micro.py load", description=load_main.__doc__)
    p.add_argument("--tree", type=Path, action="append", help="a checkout (repeat to compare; default: this one)")
    p.add_argument("--model", default="smollm2-135m-instruct", help="a built-in GGUF model or a .gguf path")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        load_worker(args.worker, args.model)
        return 0
    trees = [t.resolve() for t in args.tree or [Path(__file__).resolve().parents[1]]]
    runs: list[list[dict[str, float]]] = [[] for _ in trees]
    for i in range(args.rounds):
        for n in range(len(trees)) if i % 2 == 0 else reversed(range(len(trees))):
            out = subprocess.run([sys.executable, __file__, "load", "--worker", str(trees[n]), "--model", args.model],
                                 check=True, capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": str(trees[n]), "TQDM_DISABLE": "1"})
            runs[n].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {i + 1} {trees[n]}: " + ", ".join(f"{k} {v:.2f} s" for k, v in runs[n][-1].items()),
                  flush=True)
    for key in ("open_gguf", "load_model"):
        times = [[r[key] for r in tree_runs] for tree_runs in runs]
        medians = [statistics.median(t) for t in times]
        cells = [f"{tree}: {m:.2f} s ({min(t):.2f}-{max(t):.2f})" for tree, m, t in zip(trees, medians, times)]
        ratios = [f"{medians[0] / m:.2f}x" for m in medians[1:]]
        print(f"{key}, median (range) of {args.rounds}: " + "; ".join(cells)
              + (f"; the first / each other: {', '.join(ratios)}" if ratios else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"roofline": roofline_main, "host-loop": host_loop_main, "startup": _startup_main, "load": load_main}
    if argv and argv[0] == "step":  # its own file (its imports pick the checkout from --tree before jax loads)
        return subprocess.call([sys.executable, str(Path(__file__).with_name("cpu_step.py")), *argv[1:]])
    if not argv or argv[0] not in commands:
        print(__doc__, file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


def _startup_main(argv: list[str]) -> int:
    import servers  # benchmarks/servers.py, the one server launcher (it imports httpx: only this command needs it)
    return servers.startup_main(argv)


if __name__ == "__main__":
    sys.exit(main())
