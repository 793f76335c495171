#!/usr/bin/env python3
"""The step's weight layouts side by side: compile seconds and decode-step ms (SmolLM2-135M by default).

Layouts (jaxpaged/worker/weight_layout.py): the stacked scan or per-layer arrays, each with the checkpoint's
separate projections or fused ones (wqkv, w_gate_up). For each batch size, every layout's runner
compiles the same decode step (T = S = batch bucket, context ~--context) and the forwards are timed
interleaved, round after round (one machine load for all), best and median of --rounds.
--warmup also starts an engine per layout (fused) twice on a fresh compilation cache: warm-up seconds
cold, then warm (the persistent cache read back).

    python scripts/bench_weight_layout.py [--batch 1 32] [--rounds 15] [--warmup]
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from jaxpaged.config import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine  # noqa: E402
from jaxpaged.worker.model_runner import ModelRunner
from jaxpaged.worker.runner_config import RunnerConfig  # noqa: E402
from jaxpaged.models.loader import load_model  # noqa: E402
from jaxpaged.sampling_params import SamplingParams  # noqa: E402
from jaxpaged.core.scheduler_output import ScheduledRequest  # noqa: E402

LAYOUTS = {"stacked": ("stacked", False), "stacked+fused": ("stacked", True),
           "per_layer": ("per_layer", False), "per_layer+fused": ("per_layer", True)}


def decode_step(runner: ModelRunner, batch: int, context: int):
    """A decode step of `batch` sequences at `context` tokens, each on its own pages (contents irrelevant)."""
    ps = runner.config.page_size
    per_seq = context // ps + 1
    entries = [ScheduledRequest(str(i), (7,), context, tuple(range(1 + i * per_seq, 1 + (i + 1) * per_seq)), True,
                                SamplingParams(), context) for i in range(batch)]
    return runner.prepare(entries)


def time_layouts(model, batch: int, context: int, rounds: int) -> None:
    config = RunnerConfig(max_num_seqs=max(batch, 4), max_num_batched_tokens=max(batch, 16), max_model_len=512,
                          page_size=16, num_pages=batch * (context // 16 + 1) + 2, min_token_bucket=1)
    programs = {}
    for name, (layout, fused) in LAYOUTS.items():
        runner = ModelRunner(model.config, model.params,
                             dataclasses.replace(config, weight_layout=layout, fuse_projections=fused))
        step = decode_step(runner, batch, context)
        start = time.perf_counter()
        compiled = runner.lower(step).compile()
        programs[name] = (runner, step, compiled, time.perf_counter() - start)
    times = {name: [] for name in programs}
    for _ in range(rounds):
        for name, (runner, step, compiled, _) in programs.items():
            start = time.perf_counter()
            logits, _, runner.kv = compiled(runner.params, runner.kv, step)
            jax.block_until_ready(logits)
            times[name].append(1e3 * (time.perf_counter() - start))
    base = np.median(times["stacked"])
    for name, (_, _, _, seconds) in programs.items():
        t = np.asarray(times[name])
        print(f"batch {batch:3d}  {name:16s} compile {seconds:6.2f} s   forward best {t.min():7.2f} ms  "
              f"median {np.median(t):7.2f} ms  ({base / np.median(t):.2f}x stacked)", flush=True)


def time_warmups(model_name: str) -> None:
    for layout in ("stacked", "per_layer"):
        with tempfile.TemporaryDirectory() as cache:
            for label in ("cold", "warm"):
                args = EngineArgs(model=model_name, dtype="float32", weight_layout=layout,
                                  compilation_cache_dir=cache, model_cache_dir=None)
                start = time.perf_counter()
                engine = LLMEngine(args)
                phases = engine.startup_phases
                print(f"warm-up {layout:10s} {label}: compile {phases['compile']:.1f} s, sampler "
                      f"{phases['sampler']:.1f} s ({len(engine.runner_config.buckets)} step shapes); start-up "
                      f"{time.perf_counter() - start:.1f} s", flush=True)
                del engine
                jax.clear_caches()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--context", type=int, default=170)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", action="store_true", help="also time engine warm-ups, cold and warm cache")
    args = parser.parse_args(argv)
    model = load_model(args.model, dtype="float32")
    print(f"jax {jax.__version__}, {jax.default_backend()}; {args.model} f32, {model.config.num_hidden_layers} "
          f"layers; decode at context {args.context}; {args.rounds} interleaved rounds")
    for batch in args.batch:
        time_layouts(model, batch, args.context, args.rounds)
    if args.warmup:
        time_warmups(args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
