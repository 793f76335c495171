#!/usr/bin/env python3
"""Where one CPU decode step goes: matmuls, attention, the rest of the forward, sampler, host. SmolLM2-135M.

Real weights (the smollm2-135m-instruct GGUF, float32), the engine's own runner and sampler.
B requests with chat-length prompts are run to context ~CTX, all in decode; then each part is
timed on that same batch: the fastest of --steps rounds, each round calling every part once in turn
(interleaved, so a busy machine slows all parts alike; the fastest round is the least disturbed):

  step        LLMEngine.step(): everything, as served (greedy)
  forward     ModelRunner.execute on the step's input (the runner's compiled step)
  matmuls     the step's dots alone: the same weights, layout (scanned stack or per-layer list) and
              shapes through the same layer math (`llama.linear` where it exists), with attention,
              norms, RoPE and the activation left out (h + o @ wo and gate * up are the only other ops)
  attention   forward - (the same forward with attention reduced to its KV write, q passed through)
  kv write    (that forward) - (the same forward with neither attention nor KV write, q passed through)
  rest        forward - matmuls - attention - kv write: embedding, norms, RoPE, activation, loop
  sampler     sample_jit on the step's logits (greedy; --sampling adds top_p, top_k, temperature-only)
  prepare     ModelRunner.prepare (host packing of the step input)
  sampling batch  make_sampling_batch (host: the sampler's per-row arrays)
  host other  step - forward - sampler - prepare - sampling batch: scheduler, output processing,
              detokenizer, dispatch
--prefill N [N ...] adds prefill steps: N // 128 fresh 128-token prompts (distinct, so no prefix is
shared) scheduled as one step of N tokens; only the forward's parts are timed there (the engine is
not stepped, the same step input is run each round: it rewrites the same KV slots).
All jitted parts are compiled with the engine's XLA:CPU options (`runner_config.cpu_compiler_options`).
Parts are separate programs timed alone, so they need not add up exactly on a busy machine.

At batch 1 the weight-read roofline (benchmarks/micro.py roofline: a read-bandwidth probe in the same
process, weight bytes / bandwidth) is printed next to the step's tok/s (1000 / step ms).

--before-tree PATH runs the same measurement on another checkout (a subprocess importing that
tree's jaxpaged) and prints before / after side by side.

    python benchmarks/micro.py step --batch 1 32 [--prefill 256 512] [--steps 5] [--before-tree /tmp/main]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import subprocess
import sys
import time


def _tree(argv: list[str]) -> pathlib.Path:
    """The checkout whose jaxpaged is measured (--tree, internal), default this script's."""
    if "--tree" in argv:
        return pathlib.Path(argv[argv.index("--tree") + 1]).resolve()
    return pathlib.Path(__file__).resolve().parents[1]


HERE = pathlib.Path(__file__).resolve().parent  # benchmarks/: micro.py (the roofline)
sys.path.insert(0, str(_tree(sys.argv)))
sys.path.insert(1, str(HERE))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxpaged.worker import runner_config, step_program  # noqa: E402
from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine  # noqa: E402
from jaxpaged.models import llama  # noqa: E402
try:  # the weight dots' forms (a --before-tree may hold them in llama.py)
    from jaxpaged.models import weight_dots  # noqa: E402
except ImportError:
    weight_dots = llama
from jaxpaged.sample.sampling_batch import RowInfo, make_sampling_batch
from jaxpaged.sample.sampler import sample_jit  # noqa: E402
from jaxpaged.sampling_params import SamplingParams  # noqa: E402

SETTINGS = {"greedy": SamplingParams(temperature=0.0), "t0.8 top_p0.95": SamplingParams(temperature=0.8, top_p=0.95),
            "top_k40": SamplingParams(temperature=1.0, top_k=40), "t0.8": SamplingParams(temperature=0.8)}
PROMPT = ("You are a helpful assistant. Explain, step by step and with a short example, how a hash map handles "
          "collisions, and when a balanced tree would be the better choice for a given workload. ")
PARTS = ("step", "forward", "matmuls", "attention", "kv write", "rest", "sampler greedy", "prepare", "sampling batch",
         "host other")


def _write_only(q, k, v, k_pool, v_pool, step, layer, *args, **kwargs):
    kp, vp = step_program.write_kv_inner(k_pool, v_pool, k, v, step.slot_mapping, layer=layer)
    return q, kp, vp


def _no_kv(q, k, v, k_pool, v_pool, step, layer, *args, **kwargs):
    """No attention and no KV write; k and v stay live (their projections are not cut)."""
    return q + 0 * (jnp.sum(k) + jnp.sum(v)), k_pool, v_pool


def _patched_forward(attend, *args):
    saved = step_program._attend_paged
    step_program._attend_paged = attend  # read by paged_forward at trace time
    try:
        return step_program.paged_forward(*args)
    finally:
        step_program._attend_paged = saved


def _dot(x, w):
    """One 2-D dot: x [T, E] times a weight [E, ...] (an input projection), or x [T, H, D] times wo [H, D, E].
    A weight the runner holds packed (the native CPU matmul's blocks) goes through its own product."""
    if isinstance(w, getattr(weight_dots, "PackedWeight", ())):  # (a --before-tree may predate it)
        return weight_dots.dot_weight(x.reshape(x.shape[0], -1), w, None, "")
    if x.ndim == 2:
        return (x @ w.reshape(x.shape[1], -1)).reshape(x.shape[0], *w.shape[1:])
    return x.reshape(x.shape[0], -1) @ w.reshape(-1, w.shape[-1])


def matmuls_only(config, params, token_ids, logits_indices):
    """The step's dots alone (see the module docstring), over the params' own layout (stacked or a list of
    layers; q/k/v and gate/up separate or fused)."""
    c = config

    def layer(h, p):
        t = h.shape[0]
        if "wqkv" in p:  # fused [E, K, G + 2, D]: q is the first G of each kv head's G + 2
            qkv = _dot(h, p["wqkv"])
            o, kv = qkv[:, :, :c.num_queries_per_kv], qkv[:, :, c.num_queries_per_kv:]
        else:
            o, kv = _dot(h, p["wq"]), _dot(h, p["wk"]) + _dot(h, p["wv"])
        h = h + _dot(o.reshape(t, c.num_attention_heads, c.head_dim), p["wo"]) + jnp.sum(kv)
        if "w_gate_up" in p:
            gu = _dot(h, p["w_gate_up"]).reshape(t, 2, -1)
            gate, up = gu[:, 0], gu[:, 1]
        else:
            gate, up = _dot(h, p["w_gate"]), _dot(h, p["w_up"])
        return h + _dot(gate * up, p["w_down"]), None

    h = jnp.take(params["embed"], token_ids, axis=0)
    if isinstance(params["layers"], (list, tuple)):
        for p in params["layers"]:
            h, _ = layer(h, p)
    else:  # packed stacks are read at each layer's index in place, as the step does (a scanned slice is a copy)
        packed_type = getattr(weight_dots, "PackedWeight", ())
        packed = {n: w for n, w in params["layers"].items() if isinstance(w, packed_type)}
        sliced = {n: w for n, w in params["layers"].items() if n not in packed}
        num_layers = config.num_hidden_layers

        def scanned(h, xs):
            p, i = xs
            return layer(h, {**p, **{n: w.at_layer(i) for n, w in packed.items()}})

        h, _ = jax.lax.scan(scanned, h, (sliced, jnp.arange(num_layers, dtype=jnp.int32)))
    x = h[logits_indices]
    head = params.get("lm_head")
    return _dot(x, head) if head is not None else jnp.einsum("se,ve->sv", x, params["embed"])


def _options(runner=None, step=None):
    """The XLA options the engine compiles `step` with (its T bucket's, where the runner has them)."""
    if runner is not None and step is not None and hasattr(runner.config, "compiler_options"):
        try:
            return runner.config.compiler_options(num_tokens=len(step.token_ids))
        except TypeError:  # a runner before per-size options
            return runner.config.compiler_options()
    return getattr(runner_config, "cpu_compiler_options", dict)()


def decode_batch(engine: LLMEngine, batch: int, context: int):
    """Add `batch` requests and step until all decode at ~context."""
    prompt = engine.tokenizer.encode(PROMPT * max(1, context // 40))[:context - 8]
    for i in range(batch):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True))
    while True:
        engine.step()
        reqs = list(engine.scheduler.running)
        if len(reqs) == batch and all(r.num_computed_tokens >= len(r.prompt_token_ids) for r in reqs) \
                and min(r.num_computed_tokens for r in reqs) >= context:
            return


def _num_output_tokens(engine, entry) -> int:
    if hasattr(entry, "num_output_tokens"):
        return entry.num_output_tokens
    return engine._child_to_parent[entry.request_id][1].request.num_output_tokens  # before the runner seam


def _rows(engine, entries, params):
    rows = []
    for i, e in enumerate(entries):
        rows.append(RowInfo(params=params, seed=i, step=_num_output_tokens(engine, e)))
    return rows


def forward_parts(runner, step) -> dict:
    """{part: fn} timing the runner's forward on `step`, and its variants without attention (KV write
    kept), without attention nor KV write, and its dots alone (see the module docstring)."""
    cfg, att = runner.model_config, runner.config.attention

    def donating(compiled):  # the pool is donated, as in the runner: thread it through
        def call():
            res = compiled(runner.params, runner.kv, step)
            runner.kv = res[-1]
            return res[0]
        return call

    def compile_forward(attend):
        forward = functools.partial(_patched_forward, attend)
        return jax.jit(forward, static_argnums=(0, 1), donate_argnums=(3,), compiler_options=_options(runner, step)) \
            .lower(cfg, att, runner.params, runner.kv, step).compile()

    dots = jax.jit(matmuls_only, static_argnums=0, compiler_options=_options(runner, step)) \
        .lower(cfg, runner.params, step.token_ids, step.logits_indices).compile()
    return {
        "forward": lambda: runner.execute(step),
        "no attention": donating(compile_forward(_write_only)),
        "no kv": donating(compile_forward(_no_kv)),
        "matmuls": lambda: dots(runner.params, step.token_ids, step.logits_indices),
    }


def split_forward(out: dict[str, float]) -> dict[str, float]:
    """Derives attention, kv write and rest from the timed forward variants (removed from `out`)."""
    out["attention"] = out["forward"] - out.pop("no attention")
    out["kv write"] = out["forward"] - out["attention"] - out.pop("no kv")
    out["rest"] = out["forward"] - out["matmuls"] - out["attention"] - out["kv write"]
    return out


def measure(engine: LLMEngine, steps: int, sampling: bool) -> dict[str, float]:
    """{part: ms} for the engine's current decode batch (see the module docstring): the fastest of
    `steps` rounds; within a round every part (but the whole step, timed first) runs once, in turn."""
    step_times = _rounds({"step": engine.step}, steps)
    runner = engine.runner
    entries = engine.scheduler.schedule().scheduled_requests  # from here on the engine is not stepped
    step = runner.prepare(entries)
    logits = runner.execute(step)
    rows = _rows(engine, entries, SETTINGS["greedy"])
    greedy = make_sampling_batch(rows, logits.shape[0], logits.shape[1])
    parts = {
        "prepare": lambda: runner.prepare(entries),
        **forward_parts(runner, step),
        "sampling batch": lambda: make_sampling_batch(rows, logits.shape[0], logits.shape[1]),
        "sampler greedy": lambda: sample_jit(logits, greedy, num_top_logprobs=0),
    }
    for name, params in SETTINGS.items():  # the batch's real logits, each row with its own seed and step
        if name != "greedy" and sampling:
            sb = make_sampling_batch(_rows(engine, entries, params), logits.shape[0], logits.shape[1])
            parts[f"sampler {name}"] = functools.partial(sample_jit, logits, sb, num_top_logprobs=0)
    out = split_forward({**step_times, **_rounds(parts, steps)})
    out["host other"] = out["step"] - out["forward"] - out["sampler greedy"] - out["prepare"] - out["sampling batch"]
    return out


def prefill_step(engine: LLMEngine, tokens: int, prompt_len: int = 128):
    """Adds tokens // prompt_len fresh prompts (each starting with its own token: no shared prefix) and
    returns the scheduled entries of the one step that prefills them all."""
    base = engine.tokenizer.encode(PROMPT * (1 + prompt_len // 30))[:prompt_len - 1]
    for i in range(tokens // prompt_len):
        engine.add_request(f"prefill{tokens}-{i}", [1000 + i] + base,
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    entries = engine.scheduler.schedule().scheduled_requests
    fed = sum(e.num_tokens for e in entries)
    if fed != tokens // prompt_len * prompt_len:
        raise SystemExit(f"the scheduler fed {fed} tokens, not {tokens}: raise max_num_batched_tokens")
    return entries


def measure_prefill(engine: LLMEngine, steps: int, tokens: int) -> dict[str, float]:
    """{part: ms} of the forward of one step prefilling `tokens` prompt tokens (see the docstring)."""
    runner = engine.runner
    return split_forward(_rounds(forward_parts(runner, runner.prepare(prefill_step(engine, tokens))), steps))


def _rounds(fns: dict, rounds: int) -> dict[str, float]:
    """{name: fastest ms} over `rounds` rounds, each calling every fn once in turn (after one warm call each)."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(1e3 * (time.perf_counter() - start))
    return {name: min(t) for name, t in times.items()}


# ------------------------------------------------------------------------------------------ main


def run_here(args) -> dict[str, dict[str, float]]:
    """{batch: {part: ms}} measured in this process (this --tree's jaxpaged)."""
    results = {}
    for batch in args.batch:
        engine = LLMEngine(EngineArgs(model="smollm2-135m-instruct", dtype=args.dtype, max_num_seqs=max(batch, 4),
                                      max_model_len=512, warmup=False, quantization=args.quantization,
                                      kv_cache_dtype=args.kv_cache_dtype))
        decode_batch(engine, batch, args.context)
        results[str(batch)] = measure(engine, args.steps, args.sampling)
        print(f"  [{_tree(sys.argv).name}] batch {batch}: " +
              ", ".join(f"{k} {v:.1f}" for k, v in results[str(batch)].items()), flush=True)
        del engine
    for tokens in args.prefill:
        engine = LLMEngine(EngineArgs(model="smollm2-135m-instruct", dtype=args.dtype, max_num_seqs=32,
                                      max_model_len=512, max_num_batched_tokens=max(512, tokens), warmup=False,
                                      quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype))
        key = f"prefill {tokens}"
        results[key] = measure_prefill(engine, args.steps, tokens)
        print(f"  [{_tree(sys.argv).name}] {key}: " +
              ", ".join(f"{k} {v:.1f}" for k, v in results[key].items()), flush=True)
        del engine
    if 1 in args.batch and not args.no_roofline:
        import micro  # pylint: disable=import-outside-toplevel  (benchmarks/micro.py, beside this file)
        results["roofline"] = micro.roofline(dtype=args.dtype)
    return results


def run_tree(tree: str, args) -> dict:
    """run_here in a subprocess importing `tree`'s jaxpaged; its JSON result."""
    argv = [sys.executable, str(pathlib.Path(__file__).resolve()), "--tree", tree, "--json", "--no-roofline",
            "--batch", *map(str, args.batch), "--prefill", *map(str, args.prefill),
            "--context", str(args.context), "--steps", str(args.steps), "--dtype", args.dtype,
            "--kv-cache-dtype", args.kv_cache_dtype]
    argv += ["--quantization", args.quantization] if args.quantization else []
    argv += ["--sampling"] if args.sampling else []
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": tree})
    sys.stderr.write(proc.stderr[-2000:] if proc.returncode else "")
    print(proc.stdout.rsplit("\n{", 1)[0], flush=True)
    if proc.returncode:
        raise SystemExit(f"measuring {tree} failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(columns: dict[str, dict], batches) -> list[str]:
    names = list(columns)
    head = "| batch | part | " + " | ".join(f"{n} ms" for n in names)
    head += " | after / before |" if len(names) == 2 else " |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for batch in batches:
        parts = sorted(columns[names[-1]][str(batch)], key=lambda p: PARTS.index(p) if p in PARTS else len(PARTS))
        for part in parts:
            vals = [columns[n].get(str(batch), {}).get(part) for n in names]
            cells = [f"{v:.1f}" if v is not None else "-" for v in vals]
            ratio = (f" | {vals[1] / vals[0]:.2f}" if len(vals) == 2 and vals[0] and vals[1]
                     else (" | -" if len(names) == 2 else ""))
            lines.append(f"| {batch} | {part} | " + " | ".join(cells) + ratio + " |")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="micro.py step", description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="*", default=[1, 32])
    parser.add_argument("--prefill", type=int, nargs="*", default=[],
                        help="also time the forward of a step prefilling this many tokens (multiples of 128)")
    parser.add_argument("--context", type=int, default=170)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--sampling", action="store_true", help="also time the sampler at top_p, top_k, temperature")
    parser.add_argument("--before-tree", default=None, help="another checkout to measure first (before / after)")
    parser.add_argument("--quantization", choices=["int8", "w8a8"], default=None,
                        help="quantisation of the engine measured (EngineArgs.quantization)")
    parser.add_argument("--dtype", default="float32", help="the weights' dtype (EngineArgs.dtype; on CPU a bf16 "
                        "model's weights are upcast for every dot)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="EngineArgs.kv_cache_dtype (auto: a float32 pool "
                        "for a bf16 model on CPU, whose bf16 pool is converted around every layer's write)")
    parser.add_argument("--no-roofline", action="store_true")
    parser.add_argument("--tree", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    here = str(_tree(sys.argv))
    if args.json:  # a child of --before-tree: measure, print JSON last
        print(json.dumps(run_here(args)), flush=True)
        return 0
    print(f"jax {jax.__version__}, {jax.default_backend()}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}; SmolLM2-135M {args.dtype} (KV {args.kv_cache_dtype}), decode at context "
          f"~{args.context}, "
          f"fastest of {args.steps} rounds; "
          f"engine compiler options {_options()}", flush=True)
    columns = {}
    if args.before_tree:
        columns[f"before ({_commit(args.before_tree)})"] = run_tree(args.before_tree, args)
        columns[f"after ({_commit(here)})"] = run_tree(here, args)
        if 1 in args.batch and not args.no_roofline:
            import micro  # pylint: disable=import-outside-toplevel
            columns[list(columns)[-1]]["roofline"] = micro.roofline(dtype=args.dtype)
    else:
        columns[f"{pathlib.Path(here).name} ({_commit(here)})"] = run_here(args)
    rows = [*args.batch, *(f"prefill {n}" for n in args.prefill)]
    print("\n" + "\n".join(table(columns, rows)))
    roof = next((c["roofline"] for c in reversed(list(columns.values())) if "roofline" in c), None)
    if roof:
        import micro  # pylint: disable=import-outside-toplevel
        print("\n" + micro.describe(roof))
        for name, col in columns.items():
            if "1" in col:
                rate = 1000.0 / col["1"]["step"]
                print(f"  {name}: batch-1 step {col['1']['step']:.1f} ms = {rate:.1f} tok/s = "
                      f"{100 * rate / roof['tok_s']:.0f}% of the roofline "
                      f"(forward alone: {100 * 1000.0 / col['1']['forward'] / roof['tok_s']:.0f}%)")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    return 0


def _commit(tree: str) -> str:
    proc = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return proc.stdout.strip() + ("+dirty" if dirty else "")


if __name__ == "__main__":
    sys.exit(main())
