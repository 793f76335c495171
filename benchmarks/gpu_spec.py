"""Issue 17 on a GPU: n-gram speculative decoding at batch 1 on random weights made to copy, on / off side by side.

    python benchmarks/gpu_engine.py --spec-only  # these rows alone (random weights, three small engines)
    python benchmarks/gpu_engine.py --host-bound --spec-rounds 7  # these rows on a CPU, a host-bound model
    python benchmarks/gpu_engine.py --host-bound --emulate-step-ms 4.4  # ... steps timed as an H200's (below)

gpu_engine.py runs these after its profile (unless --skip-spec); this file holds them.

N-gram speculative decoding at batch 1 (k = 3, prompt lookup 2..4): output tok/s with
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
synchronously (overlap_verification=False: the engine before the overlap, its baseline); its ratio is
printed beside on's. The two copying workloads then run again seeded at a temperature so low that the model
samples (nearly) its greedy tokens (--spec-temperature, 1e-5: random weights' logits are close, and at 1e-3
the host-bound model's seeded continuation left O at 43 of 64 tokens), through the random rows' machinery:
what seeded requests' overlapped verification gains. Then a mixed batch, 2 grounded + 2 open requests
at once: each one's decode tok/s on / off (are those with nothing to copy slowed by the others'
verifications?), and the programs per step of a speculative decode. --spec-only builds just the weights and these engines and
prints these rows.

--emulate-step-ms (with --host-bound; a projection, not a measurement): issue 17's greedy rows on a 2-layer model
whose steps are timed as a device's: each engine's runner gets a timeline (`emulate_device`) on which a step
program starts at its launch or when the step before it ends, whichever is later, and lasts the given ms plus
--emulate-row-ms per token fed past the first; reading a step's tokens waits for its end. The host's work (this
machine's Python: schedule, propose, inputs, outputs) is real, so the rows say how much of it the overlap hides
behind steps of an H200's length (measured there: 4.4 ms a batch-1 decode at the Llama-3-8B shape, ~4.6 ms a 4-row
verification). The sampler is fused into the step program, as on a GPU (unless --fuse-sampler off). The
outcome read is timed, and a plain step's read of its sampler flags, but not every read a seeded verification
makes: the seeded rows are left out. A 2-layer bigram
model falls into loops, so its "open" prompts copy its own output: the open and mixed-batch rows say nothing there.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gpu_engine import Report, counted_step, engine_args, random_model, report_dispatches
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.models.llama import LlamaConfig, WeightLayout
from jaxpaged.models.loader import LoadedModel
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams

# issue 17's batch-1 setting: k = 3, so 1 + 3 tokens fit the S = 4 logits rows of the fused GPU step (the CPU
# benchmark, benchmarks/latency.py, uses k = 7: its unfused verify buckets take T logits rows)
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
        if pending.fused_sample is not None and pending.fused_sample.flags is not None:
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
    back by the drafts rejected in flight. On / off and, verifying
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


