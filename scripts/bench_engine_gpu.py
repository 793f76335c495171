"""The engine end to end on a GPU with a Llama-3-8B-shaped model of random bf16 weights (no download).

    python scripts/bench_engine_gpu.py            # on the GPU machine (part of scripts/gpu_check.sh)
    python scripts/bench_engine_gpu.py --smoke    # tiny shapes, any device: checks the script runs
    python scripts/bench_engine_gpu.py --spec-only  # issue 17's rows alone (random weights, three small engines)
    python scripts/bench_engine_gpu.py --host-bound --spec-rounds 7  # those rows on a CPU, a host-bound model
    python scripts/bench_engine_gpu.py --host-bound --emulate-step-ms 4.4  # ... steps timed as an H200's (below)

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
  - issue 17, n-gram speculative decoding at batch 1 (k = 3, prompt lookup 2..4): output tok/s with
    speculation on and off and their ratio, the acceptance rate beside it, per workload. Random weights copy
    nothing, so these rows run them with every layer's attention output projection (wo) zeroed: the residual
    stream then depends on the current token only (a bigram model: its greedy continuation from a token is
    the same whatever came before), while each step still computes attention and reads the KV cache at full
    cost. With O the greedy output after a random prompt P, the continuation of P + ... + P is O again:
    "grounded" is P + O' + P, O' = O with every 8th token replaced by another (drafts copied from the prompt
    are wrong there, so acceptance is well below 100%, as in real edits and rewrites); "grounded-exact" is
    P + O + P (everything to copy: the ceiling); "open" is a random prompt (nothing to copy: drafts, when the
    proposer finds any, are rejected, the cost of speculating for nothing). Off and on are two small engines
    (max_num_seqs 4, 64 tokens a step, the same KV pool size, the same weights) that differ only in
    speculative_config (both the default loop, async scheduling; on overlaps its greedy verification steps with the
    next step, as any other), so they compile the same step buckets (on, unfused, adds its verify shapes) and their
    greedy tokens compare token for token ("same tokens"). A third, "sync", is on with its verification steps run
    synchronously (overlap_verification=False: session 35's engine, the overlap's baseline); its ratio is
    printed beside on's. The two copying workloads then run again seeded at a temperature so low that the model
    samples (nearly) its greedy tokens (--spec-temperature, 1e-5: random weights' logits are close, and at 1e-3
    the host-bound model's seeded continuation left O at 43 of 64 tokens), through the random rows' machinery:
    what seeded requests' overlapped verification gains. Then a mixed batch, 2 grounded + 2 open requests
    at once: each one's decode tok/s on / off (are those with nothing to copy slowed by the others'
    verifications?), and the programs per step of a speculative decode. --spec-only builds just the weights and these two engines and prints these rows;
  - the batch-1 forward in other builds of the step: XLA command buffers off / XLA's default set
    (the launch overhead the runner's "full" command buffers save) and the stacked layer scan the
    engine ran before issue 15 (alone and with dynamic-slice fusion).
--emulate-step-ms (with --host-bound; a projection, not a measurement): issue 17's greedy rows on a 2-layer model
whose steps are timed as a device's: each engine's runner gets a timeline (`emulate_device`) on which a step
program starts at its launch or when the step before it ends, whichever is later, and lasts the given ms plus
--emulate-row-ms per token fed past the first; reading a step's tokens waits for its end. The host's work (this
machine's Python: schedule, propose, inputs, outputs) is real, so the rows say how much of it the overlap hides
behind steps of an H200's length (session 35: 4.4 ms a batch-1 decode at the Llama-3-8B shape, ~4.6 ms a 4-row
verification). The sampler is fused into the step program, as on a GPU (unless --fuse-sampler off). The
outcome read is timed, and a plain step's read of its sampler flags, but not every read a seeded verification
makes: the seeded rows are left out. A 2-layer bigram
model falls into loops, so its "open" prompts copy its own output: the open and mixed-batch rows say nothing there.
--json appends one JSON object per measurement (scripts/gpu_check.sh decides the targets from it).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import copy_bandwidth  # noqa: E402  (one definition for both GPU scripts)
from jaxpaged.worker import hlo_stats  # noqa: E402
from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine  # noqa: E402
from jaxpaged.worker.runner_config import command_buffer_options
from jaxpaged.worker.model_runner import count_dispatches
from jaxpaged.worker.step_program import paged_forward  # noqa: E402
from jaxpaged.models.llama import LlamaConfig, WeightLayout, init_params  # noqa: E402
from jaxpaged.models.loader import LoadedModel  # noqa: E402
from jaxpaged.sample.sampling_batch import RowInfo, make_sampling_batch
from jaxpaged.sample.sampler import sample_jit  # noqa: E402
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
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
    """Wraps the runner's `prepare` so each engine step's StepInput is kept (bench instrumentation)."""
    steps, prepare = [], engine.runner.prepare

    def recording(entries):
        step = prepare(entries)
        steps.append(step)
        return step
    engine.runner.prepare = recording
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


# issue 17's batch-1 setting: k = 3, so 1 + 3 tokens fit the S = 4 logits rows of the fused GPU step (the CPU
# benchmark, scripts/benchmark_latency.py, uses k = 7: its unfused verify buckets take T logits rows)
SPEC_CONFIG = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
COPYING = "random weights, every wo = 0: a bigram model, it copies"  # the spec rows' model, in a few words


def copying_model(loaded: LoadedModel) -> LoadedModel:
    """`loaded` with every layer's attention output projection wo [H, D, E] zero (fresh zeros; the other arrays
    shared, no copy). The residual stream then depends on the current token only: a bigram model, whose greedy
    continuation from a token is the same whatever came before (so after P + O + P it is O), while each step
    still computes attention and reads the KV cache at full cost (same shapes, same programs). bf16 weights
    are plain arrays in any layout (only float32 on CPU is packed)."""
    layers = loaded.params["layers"]
    if isinstance(layers, (list, tuple)):  # per-layer: L dicts of {name: [...]}
        layers = [dict(layer, wo=jnp.zeros_like(layer["wo"])) for layer in layers]
    else:  # stacked: {name: [L, ...]}
        layers = dict(layers, wo=jnp.zeros_like(layers["wo"]))
    return dataclasses.replace(loaded, params=dict(loaded.params, layers=layers),
                               source=Path(f"{loaded.source}-wo-zero"))


def emulate_device(runner, step_ms: float, row_ms: float) -> None:
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
            free_at[0] = max(time.perf_counter(), free_at[0]) + (step_ms + row_ms * max(fed[0] - 1, 0)) / 1e3
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
        if pending.fused is not None and pending.fused.sample.flags is not None:
            pending.finish_sample = lambda: wait(end) or finish()

    def executed(out, *rest):
        fed[0] = out.num_scheduled_tokens
        output = execute(out, *rest)
        wait(free_at[0])
        return output

    runner._run_fused, runner._run = launch(runner._run_fused), launch(runner._run)
    runner.dispatch, runner.execute_model, runner.dispatch_sample = dispatched, executed, sample_dispatched


def spec_sizes(args) -> tuple[int, int]:
    """(half, n): the spec rows' P and O lengths (prompts up to 2 * half + n tokens, n out); at least 16 out, so
    the smoke run's acceptance counts say something."""
    return max(4, args.prompt_len // 2), max(16, args.output_len // 2)


def spec_engine(loaded: LoadedModel, args, speculative: bool, overlap: bool = True) -> LLMEngine:
    """A batch-1 sized engine over `loaded` (already in the step's layout: no copy): few step shapes to compile,
    a small KV pool beside the bench engine's. With and without n-gram speculation, all else the same: both
    compile the same step buckets (with the sampler unfused, on adds its verify shapes), so their greedy tokens
    compare token for token."""
    half, n = spec_sizes(args)
    small = engine_args(args, max_model_len=2 * half + 2 * n + 16, max_num_seqs=4, max_num_batched_tokens=64,
                        kv_cache_memory=(64 << 20) if args.smoke or args.host_bound else (1 << 30),
                        speculative_config=SPEC_CONFIG if speculative else None, overlap_verification=overlap)
    engine = LLMEngine(small, loaded=loaded)
    if args.emulate_step_ms:
        emulate_device(engine.runner, args.emulate_step_ms, args.emulate_row_ms)
    return engine


def edited(tokens: list[int], rng, vocab: int, every: int = 8) -> list[int]:
    """tokens with every `every`-th one (positions every - 1, 2 * every - 1, ...) replaced by another token."""
    return [(t + int(rng.integers(1, vocab))) % vocab if i % every == every - 1 else t for i, t in enumerate(tokens)]


def timed_decode(engine: LLMEngine, prompt: list[int], max_tokens: int, dispatches=None,
                 temperature: float = 0.0) -> tuple[float, list[int]]:
    """(decode tok/s: the tokens after the first over the time after it, the output ids) of one request alone,
    greedy, or seeded (seed 0) at `temperature`. dispatches: a list that gets each step's {program: calls}."""
    params = SamplingParams(temperature=temperature, seed=0 if temperature else None, max_tokens=max_tokens,
                            ignore_eos=True, detokenize=False, output_kind=RequestOutputKind.CUMULATIVE)
    engine.add_request(f"b1-{time.monotonic_ns()}", {"prompt_token_ids": prompt}, params)
    first, ids = None, []
    while engine.has_unfinished_requests():
        outputs = counted_step(engine, dispatches)
        now = time.perf_counter()
        for out in outputs:
            ids = list(out.outputs[0].token_ids)
        if first is None and ids:
            first = (now, len(ids))
    return (len(ids) - first[1]) / max(time.perf_counter() - first[0], 1e-9), ids


def speculative_decoding(loaded: LoadedModel, report: Report, args, vocab: int) -> None:
    """Issue 17's GPU rows (module docstring) on `loaded`'s weights with wo zeroed (`copying_model`): three small
    engines, speculation off, on, and on with its verification steps run synchronously (`spec_engine`;
    overlap_verification False), built here and freed when done."""
    copying = copying_model(loaded)
    engines = {}
    for side in ("off", "on", "sync"):
        start = time.perf_counter()
        engines[side] = spec_engine(copying, args, speculative=side != "off", overlap=side == "on")
        report.row("spec engine", f"{time.perf_counter() - start:.1f} s",
                   f"speculation {side}: built and warmed up (max_num_seqs 4, 64 tokens a step"
                   f"{f'; {SPEC_CONFIG}' if side != 'off' else ''}; {COPYING})",
                   side=side, seconds=time.perf_counter() - start)
    spec_rows(engines["off"], engines["on"], report, args, vocab, rounds=args.spec_rounds, sync=engines["sync"])
    del engines, copying
    gc.collect()  # the engines' KV pools and the zeroed wo go back before what follows


def spec_rows(off: LLMEngine, on: LLMEngine, report: Report, args, vocab: int, rounds: int = 2,
              sync: LLMEngine | None = None) -> None:
    """Batch-1 output tok/s with n-gram speculation on / off per workload, best of `rounds` interleaved runs a
    side, the acceptance rate beside the ratio (and, given `sync`, that engine's ratio: verification steps run
    synchronously); the mixed batch; a spec decode's dispatches per step."""
    half, n = spec_sizes(args)
    rng = np.random.default_rng(17)
    p = rng.integers(0, vocab, half).tolist()
    _, o = timed_decode(off, p, n)  # the first run: o, the greedy continuation of p (so of p + ... + p)
    o_edited = edited(o, rng, vocab)
    workloads = {  # name: (prompt, the continuation a bigram model gives (None: unknown), what)
        "grounded": (p + o_edited + p, o, "prompt = P + O' + P, O the greedy output after P, O' = O with every 8th "
                     "token replaced (drafts copied from the prompt are wrong there, as in an edit)"),
        "grounded-exact": (p + o + p, o, "prompt = P + O + P: the whole continuation is in the prompt (the ceiling)"),
        "open": (rng.integers(0, vocab, 2 * half + n).tolist(), None, "a random prompt: nothing to copy")}
    sides = {"off": off, "on": on, **({"sync": sync} if sync is not None else {})}
    for engine in sides.values():
        timed_decode(engine, p[:8], 4)  # first calls of its programs
    for name, (prompt, expected, what) in workloads.items():
        best, same, copied, counts = race(sides, prompt, expected, n, rounds)
        accepted, drafted = counts["on"]
        rate, ratio = accepted / max(drafted, 1), best["on"] / best["off"]
        emitted = "" if expected is None else f"; off emitted O: {'yes' if copied else 'NO'}"
        synced = {} if sync is None else {"sync_tok_s": best["sync"], "sync_ratio": best["sync"] / best["off"],
                                          "sync_accepted_tokens": counts["sync"][0],
                                          "sync_draft_tokens": counts["sync"][1]}
        was = "" if sync is None else f" (verifying synchronously: {synced['sync_ratio']:.2f}x, " \
            f"{counts['sync'][0]}/{counts['sync'][1]} drafts accepted)"
        report.row("spec decode", f"{ratio:.2f}x{was}", f"{name}: on {best['on']:.1f} / off {best['off']:.1f} tok/s, "
                   f"acceptance {rate:.0%} ({accepted}/{drafted} draft tokens); same tokens: "
                   f"{'yes' if same else 'NO'}{emitted}; workload: {what}; {len(prompt)} in, {n} out, best of "
                   f"{rounds}; {COPYING}",
                   workload=name, ratio=ratio, on_tok_s=best["on"], off_tok_s=best["off"], acceptance=rate,
                   draft_tokens=drafted, accepted_tokens=accepted, same=same,
                   emitted_o=None if expected is None else copied, **synced)
    if args.spec_temperature:
        seeded_rows(sides, report, {k: workloads[k] for k in ("grounded", "grounded-exact")}, n, rounds,
                    args.spec_temperature)
    other_open = rng.integers(0, vocab, 2 * half + n).tolist()  # a second random prompt: nothing to copy either
    mixed = [workloads["grounded"][0]] * 2 + [workloads["open"][0], other_open]
    mixed_batch(off, on, report, mixed, n)
    if sync is not None:
        mixed_batch(off, sync, report, mixed, n, label="spec mixed batch, verifying synchronously")
    dispatches = []
    timed_decode(on, workloads["grounded"][0], n, dispatches)
    report_dispatches(report, "b=1 spec decode (grounded)", on, dispatches)


def race(sides: dict[str, LLMEngine], prompt: list[int], expected: list[int] | None, n: int, rounds: int,
         temperature: float = 0.0) -> tuple[dict[str, float], bool, bool, dict[str, list[int]]]:
    """`prompt` alone on each side in turn, `rounds` times (`timed_decode`, greedy or seeded at `temperature`):
    (each side's best tok/s, whether every side emitted the same tokens every time, whether "off" emitted
    `expected` every time (None: not checked; bf16 ties aside, the copying model continues with O), each
    speculating side's [accepted, drafted] tokens over the rounds)."""
    best, same, copied = dict.fromkeys(sides, 0.0), True, True
    before = {side: engine.stats() for side, engine in sides.items() if side != "off"}
    for _ in range(rounds):
        ids = {}
        for side, engine in sides.items():
            tok_s, ids[side] = timed_decode(engine, prompt, n, temperature=temperature)
            best[side] = max(best[side], tok_s)
        same &= all(x == ids["off"] for x in ids.values())
        copied &= expected is None or ids["off"] == expected
    counts = {side: [engine.stats()[key] - before[side][key] for key in
                     ("spec_decode_num_accepted_tokens", "spec_decode_num_draft_tokens")]
              for side, engine in sides.items() if side != "off"}
    return best, same, copied, counts


def seeded_rows(sides: dict[str, LLMEngine], report: Report, workloads: dict, n: int, rounds: int,
                temperature: float) -> None:
    """The copying workloads again with seeded sampling at a `temperature` so low that the copying model samples
    its greedy tokens (or nearly: a near-tie may go the other way, the same on every side), through the random rows'
    machinery: the candidate pass and its flags, read back before the next step is dispatched, and key steps moved
    back by the drafts rejected in flight (seeded rows verify overlapped since session 38). On / off and, verifying
    synchronously, sync / off, best of `rounds`; same tokens on every side (seeded: batch-independent)."""
    for name, (prompt, expected, _) in workloads.items():
        best, same, copied, counts = race(sides, prompt, expected, n, rounds, temperature)
        ratios = {side: best[side] / best["off"] for side in sides if side != "off"}
        shown = ", ".join(f"{side} {ratios[side]:.2f}x ({counts[side][0]}/{counts[side][1]} drafts accepted)"
                          for side in ratios)
        report.row("spec decode, seeded", f"{ratios['on']:.2f}x", f"{name}, seeded at temperature {temperature:g}: "
                   f"{shown}; on {best['on']:.1f} / off {best['off']:.1f} tok/s; same tokens: "
                   f"{'yes' if same else 'NO'}; off emitted O: {'yes' if copied else 'NO'}; best of {rounds}",
                   workload=name, temperature=temperature, ratio=ratios["on"], sync_ratio=ratios.get("sync"),
                   on_tok_s=best["on"], off_tok_s=best["off"], accepted_tokens=counts["on"][0],
                   draft_tokens=counts["on"][1], same=same, emitted_o=copied)


def timed_batch(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], list[list[int]]]:
    """All prompts at once, greedy: (each request's decode tok/s after its first token, the output ids)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.CUMULATIVE)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"mix{i}-{time.monotonic_ns()}", {"prompt_token_ids": prompt}, params)
    first, last, ids = {}, {}, {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            rid, ids[out.request_id] = out.request_id, list(out.outputs[0].token_ids)
            first.setdefault(rid, (now, len(ids[rid])))
            last[rid] = now
    rids = sorted(ids, key=lambda r: int(r[3:r.index("-")]))
    return [(len(ids[r]) - first[r][1]) / max(last[r] - first[r][0], 1e-9) for r in rids], [ids[r] for r in rids]


def mixed_batch(off: LLMEngine, on: LLMEngine, report: Report, prompts: list[list[int]], n: int,
                label: str = "spec mixed batch") -> None:
    """Issue 17's "in a mixed batch, requests without drafts are not slowed": 2 copying ("grounded") and 2
    non-copying ("open") requests at once, each request's decode tok/s with speculation on / off (best of 2 a side)."""
    best = {"off": [0.0] * len(prompts), "on": [0.0] * len(prompts)}
    same = True
    for _ in range(2):
        off_tok_s, ids_off = timed_batch(off, prompts, n)
        on_tok_s, ids_on = timed_batch(on, prompts, n)
        best = {"off": list(map(max, best["off"], off_tok_s)), "on": list(map(max, best["on"], on_tok_s))}
        same &= ids_on == ids_off
    ratios = [a / b for a, b in zip(best["on"], best["off"])]
    report.row(label, f"{min(ratios[2:]):.2f}x", f"the slower non-copying request's decode tok/s on / off "
               f"(>= 1 = not slowed); copying (grounded): {ratios[0]:.2f}x, {ratios[1]:.2f}x; non-copying (open): "
               f"{ratios[2]:.2f}x, {ratios[3]:.2f}x; same tokens: {'yes' if same else 'NO'}; 4 requests at once, "
               f"{n} out, best of 2; {COPYING}", ratios=ratios, same=same)


def warm_cache_warmup(engine: LLMEngine) -> float:
    """Seconds of the runner's warm-up again with JAX's in-memory caches dropped: every program comes back
    from the persistent compilation cache (what a restart on this machine pays)."""
    engine.runner.forget_compiled()
    jax.clear_caches()
    start = time.perf_counter()
    engine.runner.warmup(engine.async_scheduling)
    return time.perf_counter() - start


SPEC_HEADER = ("\n== issue 17: n-gram speculation at batch 1, two small engines (off / on) over the random weights "
               "with every attention output projection zeroed (a bigram model: it copies)")


def spec_only(config: LlamaConfig, report: Report, args) -> int:
    """--spec-only: the random weights, then issue 17's rows alone (no bench engine, profile or variants)."""
    start = time.perf_counter()
    loaded = random_model(config)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(loaded.params))
    report.row("random weights", f"{time.perf_counter() - start:.1f} s", f"{weight_bytes / 2**30:.2f} GiB, "
               f"layout {WeightLayout.of(loaded.params)}", seconds=time.perf_counter() - start,
               weight_bytes=weight_bytes)
    print(SPEC_HEADER)
    speculative_decoding(loaded, report, args, config.vocab_size)
    return 0


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
    if args.spec_only or args.host_bound:
        return spec_only(config, report, args)
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
        print(SPEC_HEADER)
        speculative_decoding(engine.model, report, args, config.vocab_size)
    if not args.skip_variants:
        forward_variants(engine, report, args.prompt_len, 5 if args.smoke else 30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
