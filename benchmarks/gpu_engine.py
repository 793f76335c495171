"""The engine end to end on a GPU with a Llama-3-8B-shaped model of random bf16 weights (no download).

    python benchmarks/gpu_engine.py            # on the GPU machine (part of scripts/gpu_check.sh)
    python benchmarks/gpu_engine.py --smoke    # tiny shapes, any device: checks the script runs
    python benchmarks/gpu_engine.py --spec-only  # issue 17's rows alone (random weights, three small engines)
    python benchmarks/gpu_engine.py --host-bound --spec-rounds 7  # those rows on a CPU, a host-bound model
    python benchmarks/gpu_engine.py --host-bound --emulate-step-ms 4.4  # ... steps timed as an H200's (below)

A profile of the step, for issue 15's targets (batch-1 decode at >= 80% of the weight-read roofline,
>= 6,000 / 12,000 output tok/s at 64 / 256 concurrent, host time not hidden by the device < 5% of a
step at 256). Prints, each line as soon as it is measured:
  - start-up: warm-up seconds (every step shape compiled: cold on a fresh machine), and again on the
    warm compilation cache (in-memory caches dropped, the persistent cache read back);
  - batch-1 decode tokens/s (its decode steps' wall time) against the roofline (weight bytes / the copy
    bandwidth measured here);
  - 64 and 256 concurrent (128 in / 128 out, EOS ignored): output tokens/s;
  - per batch (1, 64, 256), over its steady decode steps: the engine step's wall ms; the forward's
    device ms (the same step inputs replayed back to back through the compiled program, so dispatch
    is hidden) and the sampler's; the weight read at the copy bandwidth, the K/V read, % of that
    roofline; the host ms per step the device did not hide (step wall - forward - sampler); the
    compiled program's counts of copies, dynamic slices, gemms, fusions and loops;
  - dispatches per step: the device programs (executables) a batch-1 decode step launches; with the
    fused sampler (the GPU default) the forward and the sampler are one program;
  - issue 17, n-gram speculative decoding at batch 1: benchmarks/gpu_spec.py (its docstring says how);
  - the batch-1 forward in other builds of the step: XLA command buffers off / XLA's default set
    (the launch overhead the runner's "full" command buffers save) and the stacked layer scan the
    engine ran before issue 15 (alone and with dynamic-slice fusion).
--json appends one JSON object per measurement (scripts/gpu_check.sh decides the targets from it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import copy_bandwidth  # noqa: E402  (one definition for both GPU benchmarks)
from jaxpaged.worker import hlo_stats  # noqa: E402
from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine  # noqa: E402
from jaxpaged.worker.runner_config import command_buffer_options
from jaxpaged.worker.dispatch_count import count_dispatches
from jaxpaged.worker.step_program import paged_forward  # noqa: E402
from jaxpaged.models.llama import LlamaConfig, init_params  # noqa: E402
from jaxpaged.models.loader import LoadedModel  # noqa: E402
from jaxpaged.sample.sampling_batch import RowInfo, make_sampling_batch
from jaxpaged.sample.sampler import sample_jit  # noqa: E402
from jaxpaged.sampling_params import SamplingParams  # noqa: E402
from jaxpaged.core.scheduler_output import ScheduledRequest  # noqa: E402
from jaxpaged.tokenizer import GenerationConfig  # noqa: E402
from jaxpaged.worker.weight_layout import resolve_weight_layout, to_weight_layout  # noqa: E402

LLAMA3_8B = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                        rope_theta=500000.0, max_position_embeddings=8192)
SMOKE = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024)
# --host-bound: issue 17's rows on any device (a CPU) with steps of ~1 ms, 32 layers of width 64: the host's share
# of a step is large there, as on a GPU (a proxy for overlapping verification steps; the forward of a few rows
# costs more than one row's here, unlike the memory-bound 8B step)
HOST_BOUND = dataclasses.replace(SMOKE, vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=32,
                                 head_dim=16, max_position_embeddings=2048)
# Lets a cuBLAS gemm read a layer's weights in place from the stacked params a layer scan slices.
DSF = {"xla_gpu_enable_dynamic_slice_fusion": True}


class Report:
    """Prints rows and appends them as JSON objects to --json (gpu_check.sh reads them)."""

    def __init__(self, path: str | None):
        self.path = path

    def row(self, name: str, value: str, note: str, **data) -> None:
        print(f"{name:18s} {value:>24s}   {note}", flush=True)
        if self.path:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"name": name, **data}) + "\n")


def random_model(config: LlamaConfig) -> LoadedModel:
    """Random bf16 weights, converted to the step's layout here (the source deleted as it goes), so the
    device never holds two copies while the KV pool is sized."""
    layout = resolve_weight_layout("auto", True, jax.default_backend())
    params = to_weight_layout(config, init_params(config, jax.random.PRNGKey(0), jnp.bfloat16), layout,
                              consume=True)
    return LoadedModel(config=config, params=params, tokenizer=None, generation_config=GenerationConfig(),
                       source=Path("random-llama3-8b-shape"), dtype=np.dtype(jnp.bfloat16), load_seconds=0.0)


def engine_args(args, **overrides) -> EngineArgs:
    """The bench's EngineArgs (from the command line), with `overrides` (EngineArgs fields) on top."""
    return EngineArgs(**{**dict(model="random", max_model_len=args.prompt_len + args.output_len + 16,
                                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                gpu_memory_utilization=args.gpu_memory_utilization,
                                kv_cache_memory=args.kv_cache_memory, fuse_sampler=args.fuse_sampler,
                                quantization=args.quantization), **overrides})


def build_engine(config: LlamaConfig, args) -> LLMEngine:
    """The bench engine on random bf16 weights (`random_model`)."""
    return LLMEngine(engine_args(args), loaded=random_model(config))


def record_steps(engine: LLMEngine) -> list:
    """Wraps the runner's `pack` so each engine step's StepInput is kept (bench instrumentation)."""
    steps, pack = [], engine.runner.pack

    def recording(entries):
        step, rows = pack(entries)
        steps.append(step)
        return step, rows
    engine.runner.pack = recording
    return steps


def counted_step(engine: LLMEngine, dispatches: list | None):
    """engine.step()'s outputs; with a `dispatches` list, the step's program calls are appended to it."""
    if dispatches is None:
        return engine.step()
    with count_dispatches(engine.runner) as counts:
        outputs = engine.step()
    dispatches.append(dict(counts))
    return outputs


def run(engine: LLMEngine, num_seqs: int, prompt_len: int, output_len: int, vocab: int, dispatches=None):
    """Generate num_seqs x (prompt_len in, output_len out); (seconds, output tokens, [(step wall s, StepInput)]).
    dispatches: a list that gets each step's {program: calls} (count_dispatches; a little host time each)."""
    rng = np.random.default_rng(num_seqs)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    for i in range(num_seqs):
        engine.add_request(f"{num_seqs}-{i}-{time.monotonic_ns()}",
                           {"prompt_token_ids": rng.integers(0, vocab, prompt_len).tolist()}, params)
    steps = record_steps(engine)
    timed, produced, start = [], 0, time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outputs = counted_step(engine, dispatches)
            produced += sum(len(o.outputs[0].token_ids) for o in outputs if o.finished)
            timed.append((time.perf_counter() - t0, steps[-1]))
    finally:
        del engine.runner.prepare  # the instance attribute: back to the class's method
    return time.perf_counter() - start, produced, timed


def report_dispatches(report: Report, label: str, engine: LLMEngine, dispatches: list) -> None:
    """The programs per step of a run's steady steps (the last half: decode), from `run`'s dispatches."""
    steady = [d for d in dispatches[len(dispatches) // 2:] if d]
    if not steady:
        return
    mean = float(np.mean([sum(d.values()) for d in steady]))
    programs = sorted({name for d in steady for name in d})
    breakdown = ", ".join(f"{p} {np.mean([d.get(p, 0) for d in steady]):.2f}" for p in programs)
    report.row("dispatches/step", f"{mean:.2f}", f"{label}: fuse_sampler={engine.runner.fuse_sampler}; {breakdown}",
               label=label, dispatches_per_step=mean, fused=engine.runner.fuse_sampler,
               programs={p: float(np.mean([d.get(p, 0) for d in steady])) for p in programs})


def decode_steps(timed, num_seqs: int, limit: int):
    """The last `limit` steps that decode exactly num_seqs sequences one token each."""
    decodes = [(s, step) for s, step in timed
               if int(step.num_seqs) == num_seqs and int(step.cu_q_lens[-1]) == num_seqs]
    return decodes[-limit:]


def program_args(runner, step) -> tuple:
    """What `runner.step_program(step)` takes after (params, kv): the step, and for the fused program (the GPU
    default, which samples too) its greedy sampler inputs, so its time is forward + sampler."""
    return (step, runner.neutral_sampling(step)) if runner.fuse_sampler else (step,)


def replay_ms(engine: LLMEngine, steps, rounds: int = 3) -> tuple[float, float, float]:
    """(forward, greedy sampler, sampled sampler) device ms per step: the recorded step inputs run back to
    back through the warm compiled programs (dispatch hidden), then the sampler alone on their logits with
    every row greedy, and with every row at temperature 0.8, top_p 0.95 (what clients send: the sampler's
    cost must not depend on it). The steps rewrite the same K/V into the same slots (same tokens and
    positions); the pool goes back to the runner each call, as in `execute`."""
    runner = engine.runner
    programs = [runner.step_program(step) for step in steps]
    rows = [int(step.num_seqs) for step in steps]
    settings = (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.95))
    logits = [None] * len(steps)
    best_fwd, best_sample = float("inf"), [float("inf")] * len(settings)
    args = [program_args(runner, step) for step in steps]
    for _ in range(rounds):
        t0 = time.perf_counter()
        for i, program in enumerate(programs):
            logits[i], _, runner.kv = program(runner.params, runner.kv, *args[i])
        jax.block_until_ready(logits)
        best_fwd = min(best_fwd, (time.perf_counter() - t0) / len(steps))
        if runner.fuse_sampler:
            logits = [out.sample.logits for out in logits]
        for j, params in enumerate(settings):
            batches = [make_sampling_batch([RowInfo(params=params, seed=r) for r in range(n)], *x.shape)
                       for n, x in zip(rows, logits)]
            t0 = time.perf_counter()
            jax.block_until_ready([sample_jit(x, b) for x, b in zip(logits, batches)])
            best_sample[j] = min(best_sample[j], (time.perf_counter() - t0) / len(steps))
    return 1e3 * best_fwd, 1e3 * best_sample[0], 1e3 * best_sample[1]


def launch_us(engine: LLMEngine, steps, rounds: int = 3) -> tuple[float, float, int]:
    """(host us per call with the inputs as the host builds them, with the same inputs already on the device,
    the number of host arrays): the step programs of `steps` called one at a time on an idle device, timed
    until each call returns (enqueued). Each host (numpy) input is a transfer of its own; the difference is
    what sending them as one buffer could save a step (the `packed-inputs` branch)."""
    runner = engine.runner
    programs = [runner.step_program(step) for step in steps]
    host = [program_args(runner, step) for step in steps]
    on_device = [jax.device_put(args) for args in host]
    num_host = sum(isinstance(x, (np.ndarray, np.generic)) for x in jax.tree_util.tree_leaves(host[0]))
    best = {}
    for name, inputs in (("host", host), ("device", on_device)):
        for _ in range(rounds):
            total = 0.0
            for program, args in zip(programs, inputs):
                t0 = time.perf_counter()
                out, _, runner.kv = program(runner.params, runner.kv, *args)
                total += time.perf_counter() - t0
                jax.block_until_ready(out)
            best[name] = min(best.get(name, float("inf")), 1e6 * total / len(steps))
    return best["host"], best["device"], num_host


def profile(engine: LLMEngine, report: Report, num_seqs: int, timed, bandwidth: float, weight_bytes: int) -> None:
    """One batch size's steady decode: step wall, replayed forward and sampler, roofline, unhidden host."""
    steps = decode_steps(timed, num_seqs, limit=16)
    if not steps:
        report.row(f"profile b={num_seqs}", "no decode steps", "(scheduler never ran this batch alone)")
        return
    wall = 1e3 * float(np.median([s for s, _ in steps]))
    fwd, sample, sample_top_p = replay_ms(engine, [step for _, step in steps])
    launch_host, launch_device, num_host = launch_us(engine, [step for _, step in steps])
    c = engine.model.config
    kv_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * engine.runner.kv.k.dtype.itemsize
    kv_bytes = float(np.mean([int(np.sum(step.kv_lens)) for _, step in steps])) * kv_token
    weight_ms, kv_ms = 1e3 * weight_bytes / bandwidth, 1e3 * kv_bytes / bandwidth
    unhidden = max(0.0, wall - fwd - (0.0 if engine.runner.fuse_sampler else sample))
    counts = hlo_stats.op_counts(engine.runner.step_program(steps[-1][1]).as_text())
    fused = " (fused step: forward + sampler)" if engine.runner.fuse_sampler else ""
    report.row(f"profile b={num_seqs}", f"forward {fwd:.2f} ms",
               f"step {wall:.2f} ms{fused}; sampler alone {sample:.2f} ms greedy, {sample_top_p:.2f} ms "
               f"t0.8/top_p0.95 ({sample_top_p / sample:.2f}x); "
               f"weight read {weight_ms:.2f} ms + KV {kv_ms:.2f} ms "
               f"= {(weight_ms + kv_ms) / fwd:.0%} of roofline; host not hidden {unhidden:.2f} ms "
               f"({unhidden / wall:.1%} of the step); launch {launch_host:.0f} us with {num_host} host arrays, "
               f"{launch_device:.0f} us with them on the device; HLO " + " ".join(f"{k}={v}" for k, v in counts.items()),
               batch=num_seqs, forward_ms=fwd, step_ms=wall, sampler_ms=sample, sampler_top_p_ms=sample_top_p, weight_ms=weight_ms, kv_ms=kv_ms,
               roofline_pct=100 * (weight_ms + kv_ms) / fwd, unhidden_host_ms=unhidden,
               unhidden_host_pct=100 * unhidden / wall, launch_host_us=launch_host, launch_device_us=launch_device,
               launch_host_arrays=num_host, hlo=counts)


def forward_ms(engine: LLMEngine, lowered, params, step, options: dict | None, iters: int) -> float:
    """Device ms per call of the step `lowered` (at `step`'s shape) compiled with XLA `options`, run on
    `params` back to back (the pool donated and handed back, as in `execute`)."""
    runner = engine.runner
    program = lowered.compile(compiler_options=options)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            logits, _, runner.kv = program(params, runner.kv, step)
        jax.block_until_ready(logits)
        best = min(best, (time.perf_counter() - t0) / iters)
    return 1e3 * best


def probe_step(engine: LLMEngine, context: int):
    """A batch-1 decode at `context` tokens whose page table is all null page (touches no live page)."""
    pages = (0,) * (context // engine.runner_config.page_size + 1)
    return engine.runner.prepare([ScheduledRequest("probe", (1,), context, pages, True, SamplingParams(), context)])


def plain_lowering(engine: LLMEngine, params, step):
    """The step lowered by a jit without the runner's XLA options (XLA's defaults, command buffers included)."""
    runner = engine.runner
    return jax.jit(paged_forward, static_argnums=(0, 1), donate_argnums=(3,)).lower(
        runner.model_config, runner.config.attention, params, runner.kv, step)


def stacked_copy(engine: LLMEngine):
    """The runner's layer weights restacked ({name: [L, ...]}, fused): the scan's layout, a transient copy."""
    layers = engine.runner.params["layers"]
    if not isinstance(layers, list):
        return engine.runner.params
    return dict(engine.runner.params, layers={name: jnp.stack([layer[name] for layer in layers])
                                              for name in layers[0]})


def forward_variants(engine: LLMEngine, report: Report, context: int, iters: int) -> None:
    """The batch-1 forward under other command-buffer settings and as the stacked scan, each printed when done."""
    runner = engine.runner
    step = probe_step(engine, context)
    default = forward_ms(engine, runner.lower(step), runner.params, step, None, iters)
    report.row("b=1 forward", f"{default:.2f} ms", f"the runner's forward, unfused (command_buffers="
               f"{engine.runner_config.command_buffers}, layout {runner.layout})",
               variant="default", forward_ms=default)
    variants = [  # (name, layout, lowering, options)
        ("command buffers off", None, plain_lowering, command_buffer_options("off")),
        ("command buffers xla", None, plain_lowering, None),
        ("stacked scan", "stacked", lambda e, p, s: e.runner.lower(s, p), None),
        ("stacked scan + dsf", "stacked", lambda e, p, s: e.runner.lower(s, p),
         {**runner.config.compiler_options(), **DSF})]
    stacked = None
    for name, layout, lower, options in variants:
        try:
            if layout == "stacked" and stacked is None:
                stacked = stacked_copy(engine)
            params = stacked if layout == "stacked" else runner.params
            ms = forward_ms(engine, lower(engine, params, step), params, step, options, iters)
            report.row("b=1 forward", f"{ms:.2f} ms", f"{name} ({ms / default:.2f}x the runner's build)",
                       variant=name, forward_ms=ms)
        except Exception as e:  # pylint: disable=broad-except  (an XLA without the option; memory)
            report.row("b=1 forward", "failed", f"{name}: {type(e).__name__}: {str(e)[:160]}", variant=name)
    if stacked is not None and stacked is not runner.params:
        for x in jax.tree.leaves(stacked["layers"]):
            x.delete()


def warm_cache_warmup(engine: LLMEngine) -> float:
    """Seconds of the runner's warm-up again with JAX's in-memory caches dropped: every program comes back
    from the persistent compilation cache (what a restart on this machine pays)."""
    engine.runner.forget_compiled()
    jax.clear_caches()
    start = time.perf_counter()
    engine.runner.warmup(engine.async_scheduling)
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    # A few thousand tokens a step, as the engine's GPU default (8192) but with fewer shapes to compile.
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.7)  # room for the variants' copy
    parser.add_argument("--kv-cache-memory", type=int, default=None)
    parser.add_argument("--concurrency", default="64,256")
    parser.add_argument("--json", default=None, help="append one JSON object per measurement here")
    parser.add_argument("--skip-variants", action="store_true")
    parser.add_argument("--skip-spec", action="store_true", help="leave out issue 17's speculative decoding rows")
    parser.add_argument("--spec-only", action="store_true",
                        help="only issue 17's rows: random weights and the two small engines, nothing else")
    parser.add_argument("--host-bound", action="store_true",
                        help="issue 17's rows alone on any device, a 32-layer model of width 64 (HOST_BOUND)")
    parser.add_argument("--spec-rounds", type=int, default=2, help="issue 17's rows: best of this many runs a side")
    parser.add_argument("--spec-temperature", type=float, default=1e-5,
                        help="issue 17's copying workloads again, seeded at this temperature (0: not)")
    parser.add_argument("--quantization", default=None, choices=["fp8"],
                        help="the engine's weight dots (EngineArgs.quantization; gpu_check.sh --fp8 runs both sides)")
    parser.add_argument("--fuse-sampler", default="auto", choices=["auto", "on", "off"],
                        help="the engine's fuse_sampler (auto: on with a GPU)")
    parser.add_argument("--emulate-step-ms", type=float, default=0.0,
                        help="with --host-bound: steps timed as a device's of this many ms (module docstring)")
    parser.add_argument("--emulate-row-ms", type=float, default=0.05,
                        help="with --emulate-step-ms: ms more a step per token fed past the first")
    args = parser.parse_args(argv)
    if args.emulate_step_ms and not args.host_bound:
        parser.error("--emulate-step-ms needs --host-bound")
    if not (args.smoke or args.host_bound) and jax.default_backend() != "gpu":
        parser.error(f"needs a GPU (backend is {jax.default_backend()!r}); use --smoke or --host-bound elsewhere")
    config = SMOKE if args.smoke else HOST_BOUND if args.host_bound else LLAMA3_8B
    if args.emulate_step_ms:  # real forwards well within a step; not every read of seeded verifications is timed
        config, args.spec_temperature = dataclasses.replace(HOST_BOUND, num_hidden_layers=2), 0.0
        args.fuse_sampler = "on" if args.fuse_sampler == "auto" else args.fuse_sampler  # a GPU's step program
    if args.smoke:
        args.prompt_len, args.output_len, args.max_num_seqs, args.max_num_batched_tokens = 16, 8, 16, 64
        args.kv_cache_memory, args.concurrency = args.kv_cache_memory or (64 << 20), "4,16"
    report = Report(args.json)
    print(f"device: {jax.devices()[0]} | jax {jax.__version__}")
    import gpu_spec  # issue 17's rows (it imports this module's helpers back)
    if args.spec_only or args.host_bound:
        return gpu_spec.spec_only(config, report, args)
    bandwidth = copy_bandwidth(1 << (24 if args.smoke else 30), rounds=5, inner=20)
    start = time.perf_counter()
    engine = build_engine(config, args)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.model.params))
    rc = engine.runner_config
    programs = " x 2 fused programs" if engine.runner.fuse_sampler else ""
    report.row("start-up", f"{time.perf_counter() - start:.1f} s",
               f"warm-up {sum(engine.startup_phases.get(k, 0.0) for k in ('compile', 'sampler')):.1f} s "
               f"({len(rc.buckets)} step shapes{programs}); weights {weight_bytes / 2**30:.2f} GiB, layout "
               f"{engine.runner.layout}; KV pool {rc.num_pages - 1} pages ({(rc.num_pages - 1) * rc.page_size} "
               f"tokens); copy bandwidth {bandwidth / 1e9:.0f} GB/s",
               seconds=time.perf_counter() - start, phases=engine.startup_phases, bandwidth=bandwidth,
               weight_bytes=weight_bytes, layout=dataclasses.asdict(engine.runner.layout))
    print("\n== engine on device (Llama-3-8B shape, random bf16 weights)" if not args.smoke else "\n== smoke")
    dispatches = []
    run(engine, 1, args.prompt_len, 8, config.vocab_size, dispatches)  # untimed: counts the programs per step
    report_dispatches(report, "b=1 decode", engine, dispatches)
    _, _, timed = run(engine, 1, args.prompt_len, args.output_len, config.vocab_size)
    decodes = decode_steps(timed, 1, limit=args.output_len)  # every step after the prefill's
    rate, roofline = len(decodes) / sum(s for s, _ in decodes), bandwidth / weight_bytes
    report.row("batch-1 decode", f"{rate:.1f} tok/s", f"roofline {roofline:.1f} tok/s ({rate / roofline:.0%})",
               tok_s=rate, roofline_tok_s=roofline, roofline_pct=100 * rate / roofline)
    profile(engine, report, 1, timed, bandwidth, weight_bytes)
    for n in (int(c) for c in args.concurrency.split(",")):
        seconds, produced, timed = run(engine, n, args.prompt_len, args.output_len, config.vocab_size)
        report.row(f"{n} concurrent", f"{produced / seconds:.0f} output tok/s",
                   f"{n} x ({args.prompt_len} in, {args.output_len} out) in {seconds:.1f} s",
                   concurrency=n, out_tok_s=produced / seconds)
        profile(engine, report, n, timed, bandwidth, weight_bytes)
    warm = warm_cache_warmup(engine)
    report.row("warm-up, warm", f"{warm:.1f} s", f"{len(rc.buckets)} step shapes and the sampler from the "
               "persistent compilation cache", warm_warmup_s=warm)
    if not args.skip_spec:
        print(gpu_spec.SPEC_HEADER)
        gpu_spec.speculative_decoding(engine.model, report, args, config.vocab_size)
    if not args.skip_variants:
        forward_variants(engine, report, args.prompt_len, 5 if args.smoke else 30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
