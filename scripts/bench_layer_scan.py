#!/usr/bin/env python3
"""Does the layer scan copy each layer's weights? A Llama layer stack timed four ways.

The engine runs its decoder layers as a `lax.scan` over weights stacked on a
leading L axis (compile once, not L times). On XLA:GPU a layer's weights are
then a dynamic slice of the stack; a cuBLAS gemm cannot read that in place
unless XLA's dynamic-slice fusion applies, and otherwise the slice is copied
first: each weight byte crosses HBM three times. Batch-1 decode on the H200
took 3.5x the weight-read time (docs/performance.md), which this would explain.

Same layers (Llama-3-8B shapes, bf16, random), h [T, E] through all L layers,
attention left out (q passes through: the weights are the question):
  scan        lax.scan over the stacked weights, as the engine does
  scan+dsf    the same program compiled with xla_gpu_enable_dynamic_slice_fusion
  unrolled    lax.scan(unroll=True): every slice static
  per-layer   a Python loop over separate per-layer arrays: nothing to slice

Per variant: device ms per pass, weight GB/s, % of the copy bandwidth, and a
count of what the compiled program holds (dynamic slices, copies, gemms) per
pass. `--hlo` writes the compiled HLO of each variant to a file.

  python scripts/bench_layer_scan.py            # GPU (part of scripts/gpu_check.sh)
  python scripts/bench_layer_scan.py --smoke    # tiny shapes, any device
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_engine_gpu import DSF, LLAMA3_8B, SMOKE  # noqa: E402
from bench_kernels import copy_bandwidth, time_interleaved  # noqa: E402
from jaxpaged.models.llama import (decoder_layer, param_shapes, rope_cos_sin,  # noqa: E402
                                   unstack_layers)

# What the compiled program holds, counted on its HLO text.
HLO_COUNTS = {"dynamic-slice": r"\bdynamic-slice\(", "copy": r"\bcopy(-start)?\(",
              "gemm": r"custom_call_target=\"__cublas\$(lt\$)?matmul|custom_call_target=\"__cublas\$gemm",
              "triton-gemm": r"__triton_gemm", "dot": r"\bdot\(", "while": r"\bwhile\(",
              "ds-fusion": r"dynamic_address_computation|dynamic_slice_fusion|address_computation"}


def init_layers(config, key, dtype):
  """Random stacked layer weights {name: [L, ...]} (norms at 1)."""
  shapes = param_shapes(config)["layers"]
  keys = jax.random.split(key, len(shapes))
  return {name: (jnp.ones(shape, dtype) if "norm" in name
                 else 0.02 * jax.random.normal(k, shape, dtype))
          for (name, shape), k in zip(shapes.items(), keys)}


def variants(config, num_tokens):
  """{name: fn(h [T, E], stacked, per_layer) -> h}."""
  cos, sin = rope_cos_sin(config, jnp.arange(num_tokens, dtype=jnp.int32))

  def layer(h, p):
    h, _ = decoder_layer(config, p, h, cos, sin, lambda q, k, v: (q, None))
    return h, None

  def scan(h, stacked, per_layer):
    del per_layer
    return jax.lax.scan(layer, h, stacked)[0]

  def unrolled(h, stacked, per_layer):
    del per_layer
    return jax.lax.scan(layer, h, stacked, unroll=True)[0]

  def loop(h, stacked, per_layer):
    del stacked
    for p in per_layer:
      h = layer(h, p)[0]
    return h

  return {"scan": scan, "scan+dsf": scan, "unrolled": unrolled,
          "per-layer": loop}


def hlo_counts(text, passes):
  return {k: len(re.findall(rx, text)) / passes for k, rx in HLO_COUNTS.items()}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--smoke", action="store_true")
  ap.add_argument("--tokens", default="1,64", help="T values (comma-separated)")
  ap.add_argument("--rounds", type=int, default=None)
  ap.add_argument("--inner", type=int, default=None)
  ap.add_argument("--hlo", default=None, help="write each variant's compiled HLO here")
  opts = ap.parse_args(argv)
  if not opts.smoke and jax.default_backend() != "gpu":
    sys.exit("no GPU backend: run with --smoke on CPU")
  config = SMOKE if opts.smoke else LLAMA3_8B
  rounds = opts.rounds or (2 if opts.smoke else 7)
  inner = opts.inner or (2 if opts.smoke else 4)
  dtype = jnp.float32 if opts.smoke else jnp.bfloat16
  copy_bw = copy_bandwidth(1 << (20 if opts.smoke else 30), rounds=5, inner=10)
  stacked = init_layers(config, jax.random.PRNGKey(0), dtype)
  per_layer = unstack_layers({"layers": stacked})["layers"]
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(stacked))
  print(f"jax {jax.__version__} | {jax.devices()[0]} | {config.num_hidden_layers} layers, "
        f"{weight_bytes / 2**30:.2f} GiB of layer weights | copy {copy_bw / 1e9:.0f} GB/s")
  print(f"{'T':>4s} {'variant':10s} {'ms':>8s} {'GB/s':>7s} {'%copy':>6s} {'x scan':>7s}  "
        "per pass: " + " ".join(HLO_COUNTS))
  hlo_file = open(opts.hlo, "w", encoding="utf-8") if opts.hlo else None
  try:
    for t in map(int, opts.tokens.split(",")):
      h = (0.1 * jax.random.normal(jax.random.PRNGKey(t), (t, config.hidden_size))).astype(dtype)
      args = (h, stacked, per_layer)
      fns = variants(config, t)
      programs = {}
      timed = time_interleaved(fns, args, rounds=rounds, inner=inner,
                               compiler_options={"scan+dsf": DSF}, programs=programs)
      base = timed["scan"][0] if not isinstance(timed["scan"], Exception) else None
      for name in fns:
        if isinstance(timed[name], Exception):
          print(f"{t:4d} {name:10s} failed: {type(timed[name]).__name__}: "
                f"{str(timed[name])[:200]}")
          continue
        sec = timed[name][0]
        text = programs[name].as_text()
        counts = hlo_counts(text, inner)
        if hlo_file:
          hlo_file.write(f"\n\n######## T={t} {name} ({inner} passes)\n{text}")
        ratio = f"{base / sec:7.2f}" if base else f"{'-':>7s}"
        print(f"{t:4d} {name:10s} {sec * 1e3:8.3f} {weight_bytes / sec / 1e9:7.0f} "
              f"{100 * weight_bytes / sec / copy_bw:6.1f} {ratio}  "
              + " ".join(f"{k}={v:g}" for k, v in counts.items()), flush=True)
  finally:
    if hlo_file:
      hlo_file.close()
  return 0


if __name__ == "__main__":
  sys.exit(main())
