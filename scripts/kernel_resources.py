#!/usr/bin/env python3
"""What the Pallas attention kernel needs on an H200, worked out on a CPU.

For each of `bench_kernels.py`'s GPU cases (Llama-3-8B attention, bf16,
page_size 16) the kernel is lowered for CUDA, compiled by the `triton`
package for sm_90 (see `pallas_kernels/cuda_compile.py`), and its resources
read off the cubin. Per kernel call: the tiling the heuristics chose, grid size
(programs launched; in a mixed batch many exit at once, having no work),
shared memory, registers, spills, how many blocks fit on one SM (the lower
of the register and shared-memory limits) and how many waves the grid takes
on 132 SMs. No timing: that needs the GPU (`scripts/gpu_check.sh`).

  pip install triton   # a test dependency; on a CPU machine
  python scripts/kernel_resources.py [--num-stages 3] [--pages-per-block 2]
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from bench_kernels import configs  # noqa: E402
from pallas_kernels import cuda_compile, ragged_paged_attention  # noqa: E402
from pallas_kernels.tiling import plan_kernel_calls  # noqa: E402

SMS = cuda_compile.H200["num_cores"]
HQ, KVH, D, PS = 32, 8, 128, 16


def case_rows(name, seqs, overrides):
  """One row per kernel call (a mixed batch makes a decode and a prefill
  call, each with its own tiling). overrides: tiling arguments of
  `ragged_paged_attention` (num_stages, pages_per_block, ...)."""
  t, s = sum(q for q, _ in seqs), len(seqs)
  p = max(-(-kv // PS) for _, kv in seqs)
  calls = plan_kernel_calls(t, s, HQ // KVH, PS, p, KVH, head_dim=D,
                            itemsize=2, **overrides)
  sds = jax.ShapeDtypeStruct
  pool = sds((KVH, 1 + s * p, PS, D), jnp.bfloat16)
  args = (sds((t, HQ, D), jnp.bfloat16), pool, pool, sds((s,), jnp.int32),
          sds((s, p), jnp.int32), sds((s + 1,), jnp.int32),
          sds((), jnp.int32))
  fn = functools.partial(ragged_paged_attention, sm_scale=D ** -0.5,
                         backend="pallas", **overrides)
  kernels = cuda_compile.compile_for_cuda(fn, *args)
  assert len(kernels) == len(calls), (name, kernels)
  rows = []
  for i, (call, k) in enumerate(zip(calls, kernels)):
    cfg = call.cfg
    grid = KVH * call.num_tiles * cfg.num_splits
    occ = k.blocks_per_sm()
    label = name if i == 0 else "  + prefill call"
    rows.append(
        f"{label:36s} {cfg.rows:4d} {cfg.pages_per_block * PS:4d} "
        f"{cfg.num_splits:3d} {k.num_warps:3d} {grid:6d} "
        f"{k.shared_bytes / 1024:7.1f} {k.registers:5d} {k.spill_bytes:6d} "
        f"{occ:5d} {grid / (occ * SMS):6.2f}")
  return rows


def parse_overrides(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  for name in ("num_stages", "pages_per_block", "num_warps", "num_splits"):
    parser.add_argument("--" + name.replace("_", "-"), type=int,
                        help=f"override the heuristic's {name}")
  return {k: v for k, v in vars(parser.parse_args(argv)).items()
          if v is not None}


def main(argv=None):
  overrides = parse_overrides(argv)
  print(f"jax {jax.__version__}; target sm_90 (H200, {SMS} SMs); "
        f"Llama-3-8B attention Hq={HQ} KVH={KVH} D={D}, bf16, page {PS}")
  print(f"{'case':36s} {'rows':>4s} {'blkK':>4s} {'spl':>3s} {'wrp':>3s} "
        f"{'grid':>6s} {'smemKB':>7s} {'regs':>5s} {'spill':>6s} "
        f"{'blk/SM':>5s} {'waves':>6s}")
  batches, contexts, mixed = configs(smoke=False)
  cases = [(f"decode b={b} ctx={c}", [(1, c)] * b)
           for b in batches for c in contexts] + list(mixed.items())
  for name, seqs in cases:
    print("\n".join(case_rows(name, seqs, overrides)), flush=True)


if __name__ == "__main__":
  main()
