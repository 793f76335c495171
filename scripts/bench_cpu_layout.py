#!/usr/bin/env python3
"""CPU: the step's weight layout and XLA:CPU dot options, measured two ways, variants interleaved.

  --stack   a bare stack of SmolLM2-135M's dots (30 layers, fused q/k/v and gate/up, f32, random
            weights, LM head on every row; no attention, norms or RoPE), h [rows, E] through all layers:
            `lax.scan` over stacked weights vs a Python loop over per-layer arrays, each compiled with
            each XLA option set (YNNPACK dot fusions, + 512-bit vectors, no YNNPACK at all).
  --engine  the engine's own step (the smollm2-135m-instruct GGUF dequantised to f32, the 32-slot server's
            shapes): decode with 1, 4, 16 and 32 requests in flight (prompts of 160 tokens) and the
            256-token prefill chunks of 32 prompts, per engine variant: weight layout x the largest step
            (T) compiled without YNNPACK (`runner_config.CPU_SMALL_STEP_TOKENS`; 0: none).

Each round runs every variant once in turn (a busy machine slows all alike); the fastest round is
printed, with each engine's start-up (compile) time. The figures behind docs/performance.md,
"Session 8: per-layer weights on CPU".

    python scripts/bench_cpu_layout.py --stack --rows 1 4 32 256
    python scripts/bench_cpu_layout.py --engine --layouts stacked per_layer --small-steps 0 16
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

YNN_DOT = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}
OPTION_SETS = {"ynn dot": YNN_DOT, "ynn dot, 512-bit": {**YNN_DOT, "xla_cpu_prefer_vector_width": "512"},
               "no ynn, 512-bit": {"xla_cpu_experimental_ynn_fusion_type": "", "xla_cpu_prefer_vector_width": "512"}}
L, E, F, QKV, V = 30, 576, 1536, 960, 49152  # SmolLM2-135M: layers, hidden, MLP, fused q/k/v width, vocabulary


def stack_weights(seed: int = 0) -> tuple[dict, list[dict], jax.Array]:
    """(stacked {name: [L, ...]}, the same as L per-layer dicts, LM head [E, V]), random f32."""
    rng = np.random.default_rng(seed)
    shapes = {"wqkv": (E, QKV), "wo": (E, E), "w_gate_up": (E, 2 * F), "w_down": (F, E)}
    stacked = {n: rng.standard_normal((L, *s), dtype=np.float32) * 0.02 for n, s in shapes.items()}
    layers = [{n: jnp.asarray(w[i]) for n, w in stacked.items()} for i in range(L)]
    head = jnp.asarray(rng.standard_normal((E, V), dtype=np.float32) * 0.02)
    return {n: jnp.asarray(w) for n, w in stacked.items()}, layers, head


def dots(h: jax.Array, p: dict) -> jax.Array:
    """One layer's dots, h [R, E] -> [R, E] (o reads q's first E columns; gate * up between gate/up and down)."""
    qkv = h @ p["wqkv"]  # [R, QKV]
    h = h + qkv[:, :E] @ p["wo"]
    gate_up = h @ p["w_gate_up"]  # [R, 2F]
    return h + (jax.nn.silu(gate_up[:, :F]) * gate_up[:, F:]) @ p["w_down"]


def scanned(h, stacked, head):
    h, _ = jax.lax.scan(lambda h, p: (dots(h, p), None), h, stacked)
    return h @ head


def per_layer(h, layers, head):
    for p in layers:
        h = dots(h, p)
    return h @ head


def run_stack(args) -> None:
    stacked, layers, head = stack_weights()
    for rows in args.rows:
        h = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, E), dtype=np.float32))
        programs = {}
        for (fn, weights), (name, options) in itertools.product(
                ((scanned, stacked), (per_layer, layers)), OPTION_SETS.items()):
            compiled = jax.jit(fn).lower(h, weights, head).compile(compiler_options=options)
            programs[f"{fn.__name__:9s} {name}"] = (compiled, weights)
        best = {k: float("inf") for k in programs}
        for _ in range(args.rounds):
            for key, (compiled, weights) in programs.items():
                jax.block_until_ready(compiled(h, weights, head))
                start = time.perf_counter()
                for _ in range(args.inner):
                    out = compiled(h, weights, head)
                jax.block_until_ready(out)
                best[key] = min(best[key], (time.perf_counter() - start) / args.inner)
        for key, seconds in best.items():
            print(f"rows {rows:4d}  {key:32s} {seconds * 1e3:8.2f} ms", flush=True)


def make_engine(loaded, layout: str, small_steps: int):
    from jaxpaged.worker import runner_config
    from jaxpaged.config import EngineArgs
    from jaxpaged.engine.llm_engine import LLMEngine

    saved = runner_config.CPU_SMALL_STEP_TOKENS
    runner_config.CPU_SMALL_STEP_TOKENS = small_steps  # read by warm-up (cpu_compiler_options), restored below
    runner_config.cpu_compiler_options.cache_clear()
    try:
        start = time.perf_counter()
        engine = LLMEngine(EngineArgs(model="smollm2-135m-instruct", dtype="float32", max_model_len=1024,
                                      max_num_seqs=32, max_num_batched_tokens=256, weight_layout=layout),
                           loaded=loaded)
        return engine, time.perf_counter() - start
    finally:
        runner_config.CPU_SMALL_STEP_TOKENS = saved
        runner_config.cpu_compiler_options.cache_clear()


def time_round(engine, prompts, tag: str) -> dict[str, float]:
    """Median step seconds: decode with 1, 4, 16, 32 requests in flight; prefill chunks of 32 prompts."""
    from jaxpaged.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    out = {}
    for batch in (1, 4, 16, 32):
        ids = [f"{tag}-{batch}-{i}" for i in range(batch)]
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        prefill = []
        while engine.scheduler.waiting or any(r.num_computed_tokens < len(r.prompt_token_ids)
                                              for r in engine.scheduler.running):
            start = time.perf_counter()
            engine.step()
            prefill.append(time.perf_counter() - start)
        engine.step()
        decode = []
        for _ in range(8):
            start = time.perf_counter()
            engine.step()
            decode.append(time.perf_counter() - start)
        out[f"decode {batch}"] = float(np.median(decode))
        if batch == 32 and len(prefill) > 2:
            out["prefill 256"] = float(np.median(prefill[1:-1]))  # full chunks only
        engine.abort_request(ids)
    return out


def run_engine(args) -> None:
    from jaxpaged.models.loader import load_model

    loaded = load_model("smollm2-135m-instruct", dtype="float32")
    engines = {}
    for layout, small in itertools.product(args.layouts, args.small_steps):
        engines[f"{layout}, no ynn up to T={small}"], seconds = make_engine(loaded, layout, small)
        print(f"{layout}, no ynn up to T={small}: start-up {seconds:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1000, 40000, size=160).tolist() for _ in range(32)]
    best: dict[str, dict[str, float]] = {name: {} for name in engines}
    for r in range(args.rounds):
        for name, engine in engines.items():
            for part, seconds in time_round(engine, prompts, f"r{r}").items():
                best[name][part] = min(best[name].get(part, float("inf")), seconds)
    for name, parts in best.items():
        print(f"{name:32s} " + "  ".join(f"{p} {s * 1e3:6.1f} ms" for p, s in parts.items()), flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--stack", action="store_true")
    mode.add_argument("--engine", action="store_true")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 256])
    ap.add_argument("--layouts", nargs="+", default=["stacked", "per_layer"])
    ap.add_argument("--small-steps", type=int, nargs="+", default=[0, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--inner", type=int, default=5)
    args = ap.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.default_backend()}, load average {__import__('os').getloadavg()[0]:.1f}")
    run_stack(args) if args.stack else run_engine(args)


if __name__ == "__main__":
    main()
