"""fp8 KV cache against bf16 on a GPU, in one run: the pool's token capacity and decode attention at 8k context.

    python scripts/bench_kv_fp8.py                # H200/H100: Llama-3-8B's attention shape, 64 x 8,192 tokens
    python scripts/bench_kv_fp8.py --smoke        # any machine: tiny sizes, the kernel in interpret mode
    python scripts/bench_kv_fp8.py --json rows.jsonl

capacity  the engine's pool sizing (jaxpaged/config.py: pages from the bytes a token takes) for a Llama-3-8B
          config on this device's free memory (gpu_memory_utilization 0.9, 16 GB of bf16 weights set aside), with
          kv_cache_dtype bf16 and fp8: tokens each, their ratio (target 2x); the fp8 pool is then allocated to
          show it fits.
decode    the Pallas attention kernel over one layer's pool, 64 sequences decoding at 8,192 tokens of context
          (32 query / 8 KV heads, D = 128, bf16 queries), bf16 pages against fp8 pages (e4m3 bytes with
          per-head scales): median microseconds per call of each from interleaved rounds, and bf16 / fp8
          (target >= 1.3x; decode at this context is bound by reading the pool, which fp8 halves). This is the
          attention part of a decode step only: the whole step adds the weights' read, the same on both sides.
One line per target, ours and the baseline side by side from this run.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_kernels import make_step, time_interleaved  # noqa: E402  (scripts/, beside this one)

from jaxpaged.models.llama import LlamaConfig  # noqa: E402
from jaxpaged.worker.runner_config import resolve_kv_cache_dtype  # noqa: E402
from jaxpaged.worker.step_input import allocate_kv_pool, kv_bytes_per_page  # noqa: E402
from pallas_kernels import ragged_paged_attention  # noqa: E402
from pallas_kernels.kv_quant import quantize  # noqa: E402

LLAMA3_8B = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192)
WEIGHT_BYTES = 16 << 30  # Llama-3-8B's bf16 weights, set aside from the device's memory


def capacity(smoke: bool) -> dict:
    """Pool tokens with bf16 and fp8 pages on this device's free memory (the engine's sizing rule)."""
    if smoke:
        budget = 64 << 20
    else:
        stats = jax.local_devices()[0].memory_stats() or {}
        budget = int(stats.get("bytes_limit", 0) * 0.9) - stats.get("bytes_in_use", 0) - WEIGHT_BYTES
    tokens = {}
    for name in ("bfloat16", "fp8"):
        per_page = kv_bytes_per_page(LLAMA3_8B, 16, resolve_kv_cache_dtype(name, jnp.bfloat16, "gpu"))
        tokens[name] = (budget // per_page - 1) * 16
    pages = tokens["fp8"] // 16 + 1
    ones = np.ones((LLAMA3_8B.num_hidden_layers, LLAMA3_8B.num_key_value_heads), np.float32)
    config = LLAMA3_8B if not smoke else LlamaConfig(**{**LLAMA3_8B.__dict__, "num_hidden_layers": 1})
    pool = allocate_kv_pool(config, pages if not smoke else 4, 16, resolve_kv_cache_dtype("fp8", jnp.bfloat16, "gpu"),
                            scales=(ones[: config.num_hidden_layers], ones[: config.num_hidden_layers]))
    jax.block_until_ready(pool.k)
    del pool
    return {"name": "fp8 KV capacity", "budget_bytes": budget, "bf16_tokens": tokens["bfloat16"],
            "fp8_tokens": tokens["fp8"], "ratio": tokens["fp8"] / tokens["bfloat16"]}


def decode(smoke: bool, rounds: int) -> dict:
    """bf16 pages vs fp8 pages, the same decode batch, the Pallas kernel."""
    seqs, context = (4, 256) if smoke else (64, 8192)
    hq, kvh, d = (8, 2, 64) if smoke else (32, 8, 128)
    rng = np.random.default_rng(0)
    args, _ = make_step(rng, hq=hq, kvh=kvh, d=d, ps=16, seqs=[(1, context)] * seqs, dtype=jnp.bfloat16)
    q, k_bf16, v_bf16, *rest = args
    scale = jnp.full((kvh,), 4.0 / 448, jnp.float32)  # N(0, 1) values: 4 sigma before saturating
    fp8 = [quantize(jnp.swapaxes(x.reshape(kvh, -1, d), 0, 1), scale).swapaxes(0, 1).reshape(x.shape)
           for x in (k_bf16, v_bf16)]
    attend = functools.partial(ragged_paged_attention, sm_scale=d ** -0.5, backend="pallas", interpret=smoke)
    fns = {"bf16": lambda q_, k, v, kf, vf, *r: attend(q_, k, v, *r),
           "fp8": lambda q_, k, v, kf, vf, *r: attend(q_, kf, vf, *r, k_scale=scale, v_scale=scale)}
    timed = time_interleaved(fns, (q, k_bf16, v_bf16, *fp8, *rest), rounds=rounds, inner=1 if smoke else 5)
    for name, result in timed.items():
        if isinstance(result, Exception):
            raise RuntimeError(f"{name} failed: {result}") from result
    us = {name: 1e6 * timed[name][0] for name in fns}
    return {"name": "fp8 KV decode attention", "seqs": seqs, "context": context, "bf16_us": us["bf16"],
            "fp8_us": us["fp8"], "ratio": us["bf16"] / us["fp8"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, interpret mode (any machine)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--json", default=None, help="append the rows as JSON lines here")
    args = ap.parse_args(argv)
    rows = [capacity(args.smoke), decode(args.smoke, args.rounds or (2 if args.smoke else 15))]
    cap, dec = rows
    print(f"capacity  fp8 {cap['fp8_tokens']:,} tokens vs bf16 {cap['bf16_tokens']:,} in {cap['budget_bytes'] / 2**30:.1f}"
          f" GiB: {cap['ratio']:.2f}x (target 2x)")
    print(f"decode    {dec['seqs']} x {dec['context']:,} tokens, attention per layer: fp8 {dec['fp8_us']:.1f} us vs "
          f"bf16 {dec['bf16_us']:.1f} us: {dec['ratio']:.2f}x (target >= 1.3x)" + (" [smoke]" if args.smoke else ""))
    if args.json:
        with open(args.json, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
