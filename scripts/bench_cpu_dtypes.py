#!/usr/bin/env python3
"""Batch-1 decode step time on CPU by weight and KV cache dtype, SmolLM2-135M shapes.

Random weights (no download), the engine's default CPU KV budget (1 GiB), the
XLA attention path. Each row times `ModelRunner.execute` on one decode token
at context 64, median of a few steps after a warm-up, and its ratio to the
f32/f32 row. "auto" is what `--kv-cache-dtype auto` picks for that model.

    python scripts/bench_cpu_dtypes.py [--kv-cache-memory BYTES] [--steps N]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from jaxpaged.worker.model_runner import ModelRunner  # noqa: E402
from jaxpaged.worker.runner_config import RunnerConfig, resolve_kv_cache_dtype  # noqa: E402
from jaxpaged.worker.step_input import kv_bytes_per_page  # noqa: E402
from jaxpaged.models.llama import LlamaConfig, init_params  # noqa: E402
from jaxpaged.sampling_params import SamplingParams  # noqa: E402
from jaxpaged.core.scheduler_output import ScheduledRequest  # noqa: E402

SMOLLM2_135M = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                           num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                           max_position_embeddings=2048, tie_word_embeddings=True)
ROWS = [("float32", "auto"), ("bfloat16", "bfloat16"), ("bfloat16", "auto")]  # (weights, kv_cache_dtype)


def step_ms(weights: str, kv_cache_dtype: str, budget: int, steps: int) -> tuple[float, str, int]:
    """(median ms a decode step, the pool's dtype, pages) for one configuration."""
    params = init_params(SMOLLM2_135M, jax.random.PRNGKey(0), jnp.dtype(weights))
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, params["embed"].dtype, jax.default_backend())
    pages = budget // kv_bytes_per_page(SMOLLM2_135M, 16, kv_dtype)
    runner = ModelRunner(SMOLLM2_135M, params, RunnerConfig(
        max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256, page_size=16, num_pages=pages,
        attention_backend="xla", kv_cache_dtype=kv_cache_dtype))
    entry = ScheduledRequest("r", (1,), 64, tuple(range(1, 6)), True, SamplingParams(), 64)
    step = runner.prepare([entry])
    jax.block_until_ready(runner.execute(step))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(runner.execute(step))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times)), np.dtype(kv_dtype).name, pages


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30, help="KV pool bytes (engine's CPU default)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}; SmolLM2-135M shapes, random weights, "
          f"KV budget {args.kv_cache_memory / 2**30:.2f} GiB, batch-1 decode at context 64")
    print(f"{'weights':9s} {'kv_cache_dtype':15s} {'pool dtype':10s} {'pages':>6s} {'ms/step':>9s} {'x f32':>7s}")
    base = None
    for weights, kv in ROWS:
        ms, pool, pages = step_ms(weights, kv, args.kv_cache_memory, args.steps)
        base = base or ms
        print(f"{weights:9s} {kv:15s} {pool:10s} {pages:6d} {ms:9.1f} {ms / base:7.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
