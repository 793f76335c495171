#!/usr/bin/env python3
"""Where one CPU decode step goes: matmuls, attention, the rest of the forward, sampler, host. SmolLM2-135M.

Real weights (the smollm2-135m-instruct GGUF, float32), the engine's own runner and sampler.
B requests with chat-length prompts are run to context ~CTX, all in decode; then each part is
timed on that same batch (median of --steps calls, the parts one after another):

  step        LLMEngine.step(): everything, as served (greedy)
  forward     ModelRunner.execute on the step's input (the runner's compiled step)
  matmuls     the step's dots alone: the same weights, layout (scanned stack or per-layer list) and
              shapes through the same layer math (`llama.linear` where it exists), with attention,
              norms, RoPE and the activation left out (h + o @ wo and gate * up are the only other ops)
  attention   forward - (the same forward with attention reduced to its KV write, q passed through)
  rest        forward - matmuls - attention: embedding, norms, RoPE, activation, KV write, loop
  sampler     sample_jit on the step's logits (greedy; --sampling adds top_p, top_k, temperature-only)
  prepare     ModelRunner.prepare (host packing of the step input)
  sampling batch  make_sampling_batch (host: the sampler's per-row arrays)
  host other  step - forward - sampler - prepare - sampling batch: scheduler, output processing,
              detokenizer, dispatch
All jitted parts are compiled with the engine's XLA:CPU options (`model_runner.cpu_compiler_options`).
Parts are separate programs timed alone, so they need not add up exactly on a busy machine.

At batch 1 the weight-read roofline (scripts/roofline.py: a read-bandwidth probe in the same
process, weight bytes / bandwidth) is printed next to the step's tok/s (1000 / step ms).

--before-tree PATH runs the same measurement on another checkout (a subprocess importing that
tree's jaxpaged) and prints before / after side by side; --hlo DIR writes each batch's compiled step
HLO and prints which dots run as XLA:CPU library (YNNPACK) fusions and which stay XLA's own.

    python scripts/bench_cpu_step.py --batch 1 32 [--steps 5] [--before-tree /tmp/main] [--hlo /tmp/hlo]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import re
import subprocess
import sys
import time


def _tree(argv: list[str]) -> pathlib.Path:
    """The checkout whose jaxpaged is measured (--tree, internal), default this script's."""
    if "--tree" in argv:
        return pathlib.Path(argv[argv.index("--tree") + 1]).resolve()
    return pathlib.Path(__file__).resolve().parents[1]


SCRIPTS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(_tree(sys.argv)))
sys.path.insert(1, str(SCRIPTS))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxpaged import model_runner  # noqa: E402
from jaxpaged.engine import EngineArgs, LLMEngine  # noqa: E402
from jaxpaged.models import llama  # noqa: E402
from jaxpaged.sampler import RowInfo, make_sampling_batch, sample_jit  # noqa: E402
from jaxpaged.sampling_params import SamplingParams  # noqa: E402

SETTINGS = {"greedy": SamplingParams(temperature=0.0), "t0.8 top_p0.95": SamplingParams(temperature=0.8, top_p=0.95),
            "top_k40": SamplingParams(temperature=1.0, top_k=40), "t0.8": SamplingParams(temperature=0.8)}
OPTION_SETS = {
    "default": {},
    "ynn dot": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"},
}
PROMPT = ("You are a helpful assistant. Explain, step by step and with a short example, how a hash map handles "
          "collisions, and when a balanced tree would be the better choice for a given workload. ")
PARTS = ("step", "forward", "matmuls", "attention", "rest", "sampler greedy", "prepare", "sampling batch",
         "host other")


def median_ms(fn, steps: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def _write_only(q, k, v, k_pool, v_pool, step, layer, *args, **kwargs):
    kp, vp = model_runner.write_kv_inner(k_pool, v_pool, k, v, step.slot_mapping, layer=layer)
    return q, kp, vp


def _patched_forward(attend, *args):
    saved = model_runner._attend_paged
    model_runner._attend_paged = attend  # read by paged_forward at trace time
    try:
        return model_runner.paged_forward(*args)
    finally:
        model_runner._attend_paged = saved


def _dot(x, w):
    """x [T, E] times a weight of the layer (llama.linear where the tree has it, else its einsum form)."""
    linear = getattr(llama, "linear", None)
    if linear is not None:
        return linear(x, w)
    if w.ndim == 3 and w.shape[0] == x.shape[-1]:  # [E, N, D]
        return jnp.einsum("te,end->tnd", x, w)
    if w.ndim == 3:  # [H, D, E]
        return jnp.einsum("thd,hde->te", x, w)
    return jnp.einsum("te,ef->tf", x, w)


def _qkv(p, x):
    """q, k, v of a layer: from a fused weight when the layout has one, else three dots."""
    if "wqkv" in p:  # a fused q/k/v layout (if the tree has it): one dot, split after
        return (_dot(x, p["wqkv"]),)
    return _dot(x, p["wq"]), _dot(x, p["wk"]), _dot(x, p["wv"])


def matmuls_only(config, params, token_ids, logits_indices):
    """The step's dots alone (see the module docstring), over the params' own layout."""
    def layer(h, p):
        outs = _qkv(p, h)
        o = outs[0] if outs[0].ndim == 3 else outs[0][..., :config.num_attention_heads * config.head_dim]
        o = o.reshape(h.shape[0], config.num_attention_heads, config.head_dim)
        h = h + _dot(o, p["wo"]) + sum(jnp.sum(x) for x in outs[1:])
        if "w_gate_up" in p:
            gu = _dot(h, p["w_gate_up"])
            gate, up = jnp.split(gu, 2, axis=-1)
        else:
            gate, up = _dot(h, p["w_gate"]), _dot(h, p["w_up"])
        return h + _dot(gate * up, p["w_down"]), None

    h = jnp.take(params["embed"], token_ids, axis=0)
    if isinstance(params["layers"], (list, tuple)):
        for p in params["layers"]:
            h, _ = layer(h, p)
    else:
        h, _ = jax.lax.scan(layer, h, params["layers"])
    head = params.get("lm_head")
    x = h[logits_indices]
    return x @ head if head is not None else jnp.einsum("se,ve->sv", x, params["embed"])


def _options():
    return getattr(model_runner, "cpu_compiler_options", dict)()


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


def measure(engine: LLMEngine, steps: int, sampling: bool, xla_options: bool, hlo_dir: str | None,
            batch: int) -> dict[str, float]:
    """{part: ms} for the engine's current decode batch (see the module docstring)."""
    out = {"step": median_ms(lambda: engine.step(), steps)}
    runner = engine.runner
    entries = engine.scheduler.schedule().scheduled_requests
    out["prepare"] = median_ms(lambda: runner.prepare(entries), steps)
    step = runner.prepare(entries)
    out["forward"] = median_ms(lambda: runner.execute(step), steps)
    cfg, att = runner.model_config, runner.config.attention

    def timed(compiled) -> float:  # the pool is donated, as in the runner: thread it through
        def call():
            res = compiled(runner.params, runner.kv, step)
            runner.kv = res[-1]
            return res[0]
        return median_ms(call, steps)

    def compile_forward(forward, opts):
        return jax.jit(forward, static_argnums=(0, 1), donate_argnums=(3,), compiler_options=opts) \
            .lower(cfg, att, runner.params, runner.kv, step).compile()

    no_attention = timed(compile_forward(functools.partial(_patched_forward, _write_only), _options()))
    out["attention"] = out["forward"] - no_attention
    dots = jax.jit(matmuls_only, static_argnums=0, compiler_options=_options()) \
        .lower(cfg, runner.params, step.token_ids, step.logits_indices).compile()
    out["matmuls"] = median_ms(lambda: dots(runner.params, step.token_ids, step.logits_indices), steps)
    out["rest"] = out["forward"] - out["matmuls"] - out["attention"]
    if xla_options:
        for name, opts in OPTION_SETS.items():
            out[f"forward[{name}]"] = timed(compile_forward(model_runner.paged_forward, opts))
    if hlo_dir:
        text = runner.lower(step).compile().as_text()
        path = pathlib.Path(hlo_dir) / f"step-b{batch}.hlo.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"  compiled step HLO: {path}\n" + "\n".join("  " + line for line in hlo_summary(text)), flush=True)
    logits = runner.execute(step)
    for name, params in SETTINGS.items():  # the batch's real logits, each row with its own seed and step
        if name != "greedy" and not sampling:
            continue
        rows = _rows(engine, entries, params)
        sb = make_sampling_batch(rows, logits.shape[0], logits.shape[1])
        if name == "greedy":
            out["sampling batch"] = median_ms(lambda: make_sampling_batch(rows, logits.shape[0], logits.shape[1]),
                                              steps)
        out[f"sampler {name}"] = median_ms(lambda: sample_jit(logits, sb, num_top_logprobs=0), steps)
    out["host other"] = out["step"] - out["forward"] - out["sampler greedy"] - out["prepare"] - out["sampling batch"]
    return out  # the step scheduled here is dropped: the engine is not stepped again


# ------------------------------------------------------------------------------------------ HLO


def hlo_summary(text: str) -> list[str]:
    """Which dots of a compiled XLA:CPU module run in a library fusion (YNNPACK/oneDNN) and which stay
    XLA's own (its emitter or Eigen), with their shapes; plus the copies, transposes and dynamic
    slices the module holds."""
    comps, current = {}, None
    for line in text.splitlines():
        m = re.match(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if m and "=" not in line.split("{")[0]:
            current = m.group(1)
            comps[current] = []
        elif current is not None and "=" in line:
            comps[current].append(line.strip())
    library = set()
    for lines in comps.values():
        for line in lines:
            if re.search(r"__(ynn|onednn|xnn)_fusion", line):
                library.update(re.findall(r"calls=%?([\w.\-]+)", line))
    dots = {"library": [], "xla": []}
    counts = {"copy": 0, "transpose": 0, "dynamic-slice": 0, "while": 0, "gather": 0, "scatter": 0}
    for name, lines in comps.items():
        for line in lines:
            op = re.search(r"=\s*(\S+)\s+([\w\-]+)\(", line)
            if not op:
                continue
            shape, opcode = op.group(1), op.group(2)
            if opcode == "dot":
                operands = re.findall(r"\b[fsu]\d+\[[\d,]*\]", line.split("dot(", 1)[1])
                contract = re.findall(r"(lhs|rhs)_contracting_dims=\{([\d,]*)\}", line)
                desc = f"{' x '.join(operands[:2])} -> {shape} ({', '.join(f'{s} {d}' for s, d in contract)})"
                dots["library" if name in library else "xla"].append(desc)
            elif opcode in counts:
                counts[opcode] += 1
    lines = [f"library fusions: {len(library)}, dots in them: {len(dots['library'])}, dots left to XLA: "
             f"{len(dots['xla'])}; " + ", ".join(f"{k} {v}" for k, v in counts.items())]
    for kind in ("library", "xla"):
        for desc, n in sorted(_count(dots[kind]).items()):
            lines.append(f"  {kind:7s} dot x{n}: {desc}")
    return lines


def _count(items):
    out = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return out


# ------------------------------------------------------------------------------------------ main


def run_here(args) -> dict[str, dict[str, float]]:
    """{batch: {part: ms}} measured in this process (this --tree's jaxpaged)."""
    results = {}
    for batch in args.batch:
        engine = LLMEngine(EngineArgs(model="smollm2-135m-instruct", dtype="float32", max_num_seqs=max(batch, 4),
                                      max_model_len=512, warmup=False))
        decode_batch(engine, batch, args.context)
        results[str(batch)] = measure(engine, args.steps, args.sampling, args.xla_options, args.hlo, batch)
        print(f"  [{_tree(sys.argv).name}] batch {batch}: " +
              ", ".join(f"{k} {v:.1f}" for k, v in results[str(batch)].items()), flush=True)
        del engine
    if 1 in args.batch and not args.no_roofline:
        import roofline  # pylint: disable=import-outside-toplevel  (scripts/roofline.py)
        results["roofline"] = roofline.roofline()
    return results


def run_tree(tree: str, args) -> dict:
    """run_here in a subprocess importing `tree`'s jaxpaged; its JSON result."""
    argv = [sys.executable, str(pathlib.Path(__file__).resolve()), "--tree", tree, "--json", "--no-roofline",
            "--batch", *map(str, args.batch), "--context", str(args.context), "--steps", str(args.steps)]
    argv += ["--sampling"] if args.sampling else []
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": tree})
    sys.stderr.write(proc.stderr[-2000:] if proc.returncode else "")
    print(proc.stdout.rsplit("\n{", 1)[0], flush=True)
    if proc.returncode:
        raise SystemExit(f"measuring {tree} failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(columns: dict[str, dict], batches) -> list[str]:
    names = list(columns)
    head = "| batch | part | " + " | ".join(f"{n} ms" for n in names) + (" | after / before |" if len(names) == 2 else " |")
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=170)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--sampling", action="store_true", help="also time the sampler at top_p, top_k, temperature")
    parser.add_argument("--xla-options", action="store_true", help="also time the forward per XLA option set")
    parser.add_argument("--hlo", default=None, help="write the compiled step HLO here and summarise its dots")
    parser.add_argument("--before-tree", default=None, help="another checkout to measure first (before / after)")
    parser.add_argument("--no-roofline", action="store_true")
    parser.add_argument("--tree", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    here = str(_tree(sys.argv))
    if args.json:  # a child of --before-tree: measure, print JSON last
        print(json.dumps(run_here(args)), flush=True)
        return 0
    print(f"jax {jax.__version__}, {jax.default_backend()}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}; SmolLM2-135M f32, decode at context ~{args.context}, median of {args.steps}; "
          f"engine compiler options {_options()}", flush=True)
    columns = {}
    if args.before_tree:
        columns[f"before ({_commit(args.before_tree)})"] = run_tree(args.before_tree, args)
        columns[f"after ({_commit(here)})"] = run_tree(here, args)
        if 1 in args.batch and not args.no_roofline:
            import roofline  # pylint: disable=import-outside-toplevel
            columns[list(columns)[-1]]["roofline"] = roofline.roofline()
    else:
        columns[f"{pathlib.Path(here).name} ({_commit(here)})"] = run_here(args)
    print("\n" + "\n".join(table(columns, args.batch)))
    roof = next((c["roofline"] for c in reversed(list(columns.values())) if "roofline" in c), None)
    if roof:
        import roofline  # pylint: disable=import-outside-toplevel
        print("\n" + roofline.describe(roof))
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
