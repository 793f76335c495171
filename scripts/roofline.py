#!/usr/bin/env python3
"""Batch-1 decode's weight-read roofline on this machine: a memory-bandwidth probe and the model's weight bytes.

A decode step at batch 1 reads every weight once (a tied embedding once, as the LM head; the embedding
row lookup and the KV cache are left out: a few MB against ~540 MB for SmolLM2-135M in float32), so no
engine decodes faster than  roofline tok/s = read bandwidth / weight bytes.

The bandwidth is the best of these read probes on one --probe-mib float32 array (far above the caches),
each timed --rounds times in this process (fastest round per probe: the roofline is an upper bound):
  numpy sum, 1 thread        np.add.reduce over the array
  numpy sum, N threads       one np.add.reduce per thread over 1/N of it (numpy drops the GIL), N = cores
  numpy matvec               the array as [R, 1024] times a vector (numpy's BLAS gemv, its threads)
  jax matvec                 the same on the default device (XLA:CPU's dot, its threads)
  jax sum                    a jitted jnp.sum
A sum is often bound by its adds, a matrix-vector product by its reads; the largest rate is the
roofline's bandwidth: the highest read rate this process reached.

    python scripts/roofline.py [--model smollm2-135m-instruct] [--dtype float32] [--json]

`scripts/compare_servers.py --roofline` runs this (as a subprocess, --json) and prints each server's
concurrency-1 decode rate (1000 / median TPOT) as a share of the roofline; `scripts/bench_cpu_step.py`
prints it next to the engine's batch-1 step.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def _best_seconds(fn, rounds: int) -> float:
    fn()  # first touch / compile
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def read_bandwidth(probe_mib: int = 512, rounds: int = 5, threads: int | None = None) -> dict[str, float]:
    """{probe name: bytes read per second} for the read probes of the module docstring, and "best"."""
    n = probe_mib * (1 << 20) // 4
    x = np.random.default_rng(0).random(n, dtype=np.float32)
    nbytes = x.nbytes
    out = {"numpy sum, 1 thread": nbytes / _best_seconds(lambda: np.add.reduce(x), rounds)}
    threads = threads or os.cpu_count() or 1
    chunks = np.array_split(x, threads)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        out[f"numpy sum, {threads} threads"] = nbytes / _best_seconds(
            lambda: list(pool.map(np.add.reduce, chunks)), rounds)
    matrix, vector = x[:n - n % 1024].reshape(-1, 1024), np.ones(1024, np.float32)
    out["numpy matvec"] = matrix.nbytes / _best_seconds(lambda: matrix @ vector, rounds)
    import jax  # pylint: disable=import-outside-toplevel
    import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
    md, vd = jnp.asarray(matrix), jnp.asarray(vector)
    matvec = jax.jit(jnp.matmul)
    out["jax matvec"] = matrix.nbytes / _best_seconds(lambda: matvec(md, vd).block_until_ready(), rounds)
    xd = jnp.asarray(x)
    total = jax.jit(jnp.sum)
    out["jax sum"] = nbytes / _best_seconds(lambda: total(xd).block_until_ready(), rounds)
    out["best"] = max(out.values())
    return out


def weight_bytes(model: str = "smollm2-135m-instruct", dtype: str = "float32") -> int:
    """Bytes of weights a batch-1 decode step reads: every param of the model at `dtype` (the
    GGUF's config, no weights loaded; a tied embedding counted once)."""
    from jaxpaged.models.gguf_loader import gguf_config, open_gguf  # pylint: disable=import-outside-toplevel
    from jaxpaged.models.llama import param_shapes  # pylint: disable=import-outside-toplevel
    from jaxpaged.models.loader import parse_dtype, resolve_model_path  # pylint: disable=import-outside-toplevel
    config = gguf_config(open_gguf(resolve_model_path(model)))
    shapes = param_shapes(config)
    leaves = [shapes["embed"], shapes["final_norm"], *shapes["layers"].values()]
    if "lm_head" in shapes:
        leaves.append(shapes["lm_head"])
    itemsize = (parse_dtype(dtype) or np.dtype(np.float32)).itemsize
    return itemsize * sum(math.prod(s) for s in leaves)


def roofline(model: str = "smollm2-135m-instruct", dtype: str = "float32", probe_mib: int = 512,
             rounds: int = 5) -> dict:
    """{"bandwidth": {probe: B/s}, "weight_bytes": int, "tok_s": best bandwidth / weight bytes, ...}."""
    bandwidth = read_bandwidth(probe_mib, rounds)
    nbytes = weight_bytes(model, dtype)
    return {"model": model, "dtype": dtype, "bandwidth": bandwidth, "weight_bytes": nbytes,
            "tok_s": bandwidth["best"] / nbytes, "probe_mib": probe_mib, "cpu_count": os.cpu_count(),
            "loadavg": os.getloadavg()}


def describe(r: dict) -> str:
    """One line: the probes, the weight bytes and the roofline."""
    probes = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in r["bandwidth"].items() if k != "best")
    return (f"weight-read roofline (batch 1): {r['model']} {r['dtype']} weights {r['weight_bytes'] / 1e6:.0f} MB, "
            f"read bandwidth {r['bandwidth']['best'] / 1e9:.1f} GB/s (best of: {probes} GB/s) -> "
            f"{r['tok_s']:.1f} tok/s (load average {r['loadavg'][0]:.1f})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--probe-mib", type=int, default=512)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = p.parse_args(argv)
    r = roofline(args.model, args.dtype, args.probe_mib, args.rounds)
    print(json.dumps(r) if args.json else describe(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
