"""The engine end to end on a GPU, Llama-3-8B-shaped random bf16 weights (no download): issue 15's profile of the
step, then issue 17's n-gram speculative decoding at batch 1, on / off side by side.

    python benchmarks/gpu_engine.py              # on the GPU machine (part of scripts/gpu_check.sh)
    python benchmarks/gpu_engine.py --smoke      # tiny shapes, any device: checks the script runs
    python benchmarks/gpu_engine.py --spec-only  # issue 17's rows alone (random weights, three small engines)

Issue 15 (batch-1 decode >= 80% of the weight-read roofline, >= 6,000 / 12,000 output tok/s at 64 / 256
concurrent, host time not hidden by the device < 5% of a step at 256): start-up (cold, then from the persistent
compilation cache); batch-1 decode tok/s against the roofline (weight bytes / the copy bandwidth measured here);
64 and 256 concurrent (128 in / 128 out, EOS ignored); per batch, over its steady decode steps, the step's wall
ms, the forward's and the sampler's device ms (`replay_ms`), the reads' share of the forward, the host ms the
device did not hide, a launch's host time and the program's op counts; the dispatches per step.
Issue 17 (on / off: grounded >= 1.8x, open >= 0.95x; in a mixed batch the requests without drafts not slowed):
random weights copy nothing, so these rows zero every attention output projection (`copying_model`: a bigram
model, whose greedy continuation O of a random prompt P follows P + ... + P again, at full attention cost); the
workloads are in `speculative_decoding`. "off", "on" and "sync" (on, verification steps synchronous: the engine
before the overlap) differ only in speculative_config and overlap_verification, so their tokens compare. The
copying workloads run again seeded at a near-greedy --spec-temperature; then a mixed batch (2 grounded + 2 open).
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

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]  # benchmarks/, root
from attention import LLAMA3_8B, copy_bandwidth  # noqa: E402  (one definition for both GPU benchmarks)
from jaxpaged.config import EngineArgs  # noqa: E402
from jaxpaged.engine.llm_engine import LLMEngine  # noqa: E402
from jaxpaged.models.llama import LlamaConfig  # noqa: E402
from jaxpaged.models.params import WeightLayout, init_params  # noqa: E402
from jaxpaged.models.loader import LoadedModel  # noqa: E402
from jaxpaged.sample.sampler import sample_jit  # noqa: E402
from jaxpaged.sample.sampling_batch import RowInfo, make_sampling_batch  # noqa: E402
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams  # noqa: E402
from jaxpaged.tokenizer import GenerationConfig  # noqa: E402
from jaxpaged.worker import hlo_stats  # noqa: E402
from jaxpaged.worker.dispatch_count import count_dispatches  # noqa: E402
from jaxpaged.worker.weight_layout import resolve_weight_layout, to_weight_layout  # noqa: E402

SMOKE = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024)
# issue 17's batch-1 setting: k = 3, so 1 + 3 tokens fit the S = 4 logits rows of the fused GPU step (the CPU
# benchmark, benchmarks/latency.py, uses k = 7: its unfused verify buckets take T logits rows)
SPEC_CONFIG = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
COPYING = "random weights, every wo = 0: a bigram model, it copies"  # the spec rows' model, in a few words

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
    """Random bf16 weights in the step's layout (the source deleted as it goes: never two copies on the device)."""
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
    """Generate num_seqs x (prompt_len in, output_len out): (seconds, output tokens, [(step wall s, StepInput)]);
    dispatches: a list that gets each step's {program: calls}."""
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
        del engine.runner.pack  # the instance attribute: back to the class's method
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
    """`runner.step_program(step)`'s arguments after (params, kv); a fused program's (forward + sampler) greedy."""
    return runner.fused_program_args(step) if runner.fuse_sampler else (step,)


def replay_ms(engine: LLMEngine, steps, rounds: int = 3) -> tuple[float, float, float]:
    """(forward, greedy sampler, sampled sampler) device ms per step: the recorded step inputs run back to back
    through the warm compiled programs (dispatch hidden; the same K/V rewritten into the same slots), then the
    sampler alone on their logits, every row greedy, then every row at temperature 0.8, top_p 0.95."""
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
    """(host us per call with the inputs as the host builds them, with them already on the device, the number of
    host arrays): each host input is a transfer of its own; the difference is what one buffer could save a step."""
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

def warm_cache_warmup(engine: LLMEngine) -> float:
    """Seconds of the runner's warm-up again from the persistent compilation cache (in-memory caches dropped)."""
    engine.runner.forget_compiled()
    jax.clear_caches()
    start = time.perf_counter()
    engine.runner.warmup(engine.async_scheduling)
    return time.perf_counter() - start


# ---- issue 17: speculative decoding -------------------------------------------------------------------------

def copying_model(loaded: LoadedModel) -> LoadedModel:
    """`loaded` with every layer's wo [H, D, E] zero (the other arrays shared): the residual stream depends on the
    current token only. bf16 weights are plain arrays in any layout (only float32 on CPU is packed)."""
    layers = loaded.params["layers"]
    if isinstance(layers, (list, tuple)):  # per-layer: L dicts of {name: [...]}
        layers = [dict(layer, wo=jnp.zeros_like(layer["wo"])) for layer in layers]
    else:  # stacked: {name: [L, ...]}
        layers = dict(layers, wo=jnp.zeros_like(layers["wo"]))
    return dataclasses.replace(loaded, params=dict(loaded.params, layers=layers),
                               source=Path(f"{loaded.source}-wo-zero"))


def spec_sizes(args) -> tuple[int, int]:
    """(half, n): P's and O's lengths; at least 16 out, so the smoke run's acceptance counts say something."""
    return max(4, args.prompt_len // 2), max(16, args.output_len // 2)


def spec_engine(loaded: LoadedModel, args, speculative: bool, overlap: bool = True) -> LLMEngine:
    """A batch-1 sized engine over `loaded` (already in the step's layout): few step shapes to compile, a small KV
    pool beside the bench engine's; speculating or not, all else the same, so greedy tokens compare."""
    half, n = spec_sizes(args)
    small = engine_args(args, max_model_len=2 * half + 2 * n + 16, max_num_seqs=4, max_num_batched_tokens=64,
                        kv_cache_memory=(64 << 20) if args.smoke else (1 << 30),
                        speculative_config=SPEC_CONFIG if speculative else None, overlap_verification=overlap)
    engine = LLMEngine(small, loaded=loaded)
    if args.emulate_step_ms:  # a GPU's timeline on any device: its step programs take this long (micro.py's model)
        from micro import emulate_device  # noqa: PLC0415  (only for this mode)
        emulate_device(engine.runner, args.emulate_step_ms, args.emulate_row_ms)
    return engine


def edited(tokens: list[int], rng, vocab: int, every: int = 8) -> list[int]:
    """tokens with every `every`-th one (positions every - 1, 2 * every - 1, ...) replaced by another token."""
    return [(t + int(rng.integers(1, vocab))) % vocab if i % every == every - 1 else t for i, t in enumerate(tokens)]


def timed_decode(engine: LLMEngine, prompt: list[int], max_tokens: int, dispatches=None,
                 temperature: float = 0.0) -> tuple[float, list[int]]:
    """(decode tok/s after the first token, the output ids) of one request alone, greedy or seeded at `temperature`;
    dispatches: a list that gets each step's {program: calls}."""
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
    """Issue 17's rows (module docstring): engines off, on and sync over `loaded` with wo zeroed, built here and
    freed when done; per workload each side's best of --spec-rounds interleaved runs, the acceptance beside."""
    print("\n== issue 17: n-gram speculation at batch 1, small engines (off / on / sync) over the random weights "
          "with every attention output projection zeroed (a bigram model: it copies)")
    copying, sides, rounds = copying_model(loaded), {}, args.spec_rounds
    for side in ("off", "on", "sync"):
        start = time.perf_counter()
        sides[side] = spec_engine(copying, args, speculative=side != "off", overlap=side == "on")
        report.row("spec engine", f"{time.perf_counter() - start:.1f} s",
                   f"speculation {side}: built and warmed up (max_num_seqs 4, 64 tokens a step"
                   f"{f'; {SPEC_CONFIG}' if side != 'off' else ''}; {COPYING})",
                   side=side, seconds=time.perf_counter() - start)
    off, on = sides["off"], sides["on"]
    half, n = spec_sizes(args)
    rng = np.random.default_rng(17)
    p = rng.integers(0, vocab, half).tolist()
    _, o = timed_decode(off, p, n)  # the first run: o, the greedy continuation of p (so of p + ... + p)
    workloads = {  # name: (prompt, the continuation a bigram model gives (None: unknown), what)
        "grounded": (p + edited(o, rng, vocab) + p, o, "prompt = P + O' + P, O the greedy output after P, O' = O "
                     "with every 8th token replaced (drafts copied from the prompt are wrong there, as in an edit)"),
        "grounded-exact": (p + o + p, o, "prompt = P + O + P: the whole continuation is in the prompt (the ceiling)"),
        "open": (rng.integers(0, vocab, 2 * half + n).tolist(), None, "a random prompt: nothing to copy")}
    for engine in sides.values():
        timed_decode(engine, p[:8], 4)  # first calls of its programs
    for name, (prompt, expected, what) in workloads.items():
        best, same, copied, counts = race(sides, prompt, expected, n, rounds)
        (accepted, drafted), sync = counts["on"], counts["sync"]
        rate, ratio, sync_ratio = accepted / max(drafted, 1), best["on"] / best["off"], best["sync"] / best["off"]
        emitted = "" if expected is None else f"; off emitted O: {'yes' if copied else 'NO'}"
        report.row("spec decode", f"{ratio:.2f}x (verifying synchronously: {sync_ratio:.2f}x, {sync[0]}/{sync[1]} "
                   f"drafts accepted)", f"{name}: on {best['on']:.1f} / off {best['off']:.1f} tok/s, "
                   f"acceptance {rate:.0%} ({accepted}/{drafted} draft tokens); same tokens: "
                   f"{'yes' if same else 'NO'}{emitted}; workload: {what}; {len(prompt)} in, {n} out, best of "
                   f"{rounds}; {COPYING}",
                   workload=name, ratio=ratio, on_tok_s=best["on"], off_tok_s=best["off"], acceptance=rate,
                   draft_tokens=drafted, accepted_tokens=accepted, same=same,
                   emitted_o=None if expected is None else copied, sync_tok_s=best["sync"], sync_ratio=sync_ratio,
                   sync_accepted_tokens=sync[0], sync_draft_tokens=sync[1])
    if args.spec_temperature:
        seeded_rows(sides, report, {k: workloads[k] for k in ("grounded", "grounded-exact")}, n, rounds,
                    args.spec_temperature)
    other_open = rng.integers(0, vocab, 2 * half + n).tolist()  # a second random prompt: nothing to copy either
    mixed = [workloads["grounded"][0]] * 2 + [workloads["open"][0], other_open]
    mixed_batch(off, on, report, mixed, n)
    mixed_batch(off, sides["sync"], report, mixed, n, label="spec mixed batch, verifying synchronously")
    dispatches = []
    timed_decode(on, workloads["grounded"][0], n, dispatches)
    report_dispatches(report, "b=1 spec decode (grounded)", on, dispatches)
    del sides, off, on, copying
    gc.collect()  # the engines' KV pools and the zeroed wo go back before what follows


def race(sides: dict[str, LLMEngine], prompt: list[int], expected: list[int] | None, n: int, rounds: int,
         temperature: float = 0.0) -> tuple[dict[str, float], bool, bool, dict[str, list[int]]]:
    """`prompt` alone on each side in turn, `rounds` times: (each side's best tok/s, whether every side emitted the
    same tokens every time, whether "off" emitted `expected` every time (None: not checked), each speculating
    side's [accepted, drafted] tokens over the rounds)."""
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
    """The copying workloads seeded at a `temperature` so low that the model samples (nearly) its greedy tokens,
    through the random rows' machinery (the candidate pass, its flags read back before the next dispatch, key
    steps moved back by drafts rejected in flight): on / off and sync / off; same tokens on every side."""
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
    """All prompts at once, greedy: (each one's decode tok/s after its first token, the output ids)."""
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
    """Issue 17's "in a mixed batch, requests without drafts are not slowed": 2 grounded and 2 open requests at
    once, each one's decode tok/s with speculation on / off (best of 2 a side)."""
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

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    # A few thousand tokens a step, as the engine's GPU default (8192) but with fewer shapes to compile.
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.7)
    parser.add_argument("--kv-cache-memory", type=int, default=None)
    parser.add_argument("--concurrency", default="64,256")
    parser.add_argument("--json", default=None, help="append one JSON object per measurement here")
    parser.add_argument("--skip-spec", action="store_true", help="leave out issue 17's speculative decoding rows")
    parser.add_argument("--spec-only", action="store_true",
                        help="only issue 17's rows: random weights and the small engines, nothing else")
    parser.add_argument("--spec-rounds", type=int, default=2, help="issue 17's rows: best of this many runs a side")
    parser.add_argument("--spec-temperature", type=float, default=1e-5,
                        help="issue 17's copying workloads again, seeded at this temperature (0: not)")
    parser.add_argument("--quantization", default=None, choices=["fp8"],
                        help="the engine's weight dots (EngineArgs.quantization; gpu_check.sh --fp8 runs both sides)")
    parser.add_argument("--fuse-sampler", default="auto", choices=["auto", "on", "off"],
                        help="the engine's fuse_sampler (auto: on with a GPU)")
    parser.add_argument("--emulate-step-ms", type=float, default=0.0,
                        help="issue 17's rows on an emulated device timeline (with --smoke --spec-only, any device): "
                             "each step program takes this many ms (benchmarks/micro.py emulate_device)")
    parser.add_argument("--emulate-row-ms", type=float, default=0.0,
                        help="with --emulate-step-ms: ms a token past the first a step adds")
    args = parser.parse_args(argv)
    if not args.smoke and jax.default_backend() != "gpu":
        parser.error(f"needs a GPU (backend is {jax.default_backend()!r}); use --smoke elsewhere")
    config = SMOKE if args.smoke else LLAMA3_8B
    if args.emulate_step_ms:  # as a GPU runs it: fused, and a vocabulary in which a random prompt copies little
        config, args.fuse_sampler = dataclasses.replace(SMOKE, vocab_size=16384), "on"
    if args.emulate_step_ms and not (args.smoke and args.spec_only):
        parser.error("--emulate-step-ms runs issue 17's rows on the tiny model: with --smoke --spec-only")
    if args.smoke:
        if not args.emulate_step_ms:  # emulated: the prompt and output lengths asked for (defaults 128)
            args.prompt_len, args.output_len = 16, 8
        args.max_num_seqs, args.max_num_batched_tokens = 16, 64
        args.kv_cache_memory, args.concurrency = args.kv_cache_memory or (64 << 20), "4,16"
    report = Report(args.json)
    print(f"device: {jax.devices()[0]} | jax {jax.__version__}")
    if args.spec_only:
        start = time.perf_counter()
        loaded = random_model(config)
        report.row("random weights", f"{time.perf_counter() - start:.1f} s", f"layout {WeightLayout.of(loaded.params)}",
                   seconds=time.perf_counter() - start)
        speculative_decoding(loaded, report, args, config.vocab_size)
        return 0
    bandwidth = copy_bandwidth(1 << (24 if args.smoke else 30), rounds=5, inner=20)
    start = time.perf_counter()
    engine = LLMEngine(engine_args(args), loaded=random_model(config))
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
        speculative_decoding(engine.model, report, args, config.vocab_size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
