#!/usr/bin/env python3
"""Benchmark ragged paged attention (decode and mixed batches).

GPU (default): Llama-3-8B attention shapes (32 q heads, 8 kv heads, D=128),
bf16, page_size 16; decode batch {1,16,64,256} x context {512,2048,8192} and
mixed prefill+decode batches. Per row: device time (median of rounds of
back-to-back calls after warm-up), achieved GB/s over the bytes the step
really needs (K/V of every live token + Q + O), % of a device-to-device copy
bandwidth measured in the same run, and speed ratio vs the pure-JAX reference
path and vs jax.experimental.pallas.ops.gpu.paged_attention (decode only).

  python scripts/bench_kernels.py            # GPU
  python scripts/bench_kernels.py --smoke    # CPU: tiny, reference+interpret
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

# Import the checkout's package even where the install is stale or absent.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from pallas_kernels import ragged_paged_attention  # noqa: E402


def timeit(fn, *args, rounds, inner, warmup=2):
  """Median seconds per call; calls are queued back to back per round."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / inner)
  return statistics.median(times)


def copy_bandwidth(nbytes, rounds, inner):
  """Bytes read + written per second by a device-to-device elementwise copy."""
  x = jnp.ones((nbytes // 2,), jnp.bfloat16)
  f = jax.jit(lambda a: a * 2)       # one read + one write of nbytes
  return 2 * nbytes / timeit(f, x, rounds=rounds, inner=inner)


def make_step(rng, *, hq, kvh, d, ps, seqs, dtype):
  """seqs: list of (q_len, kv_len). Returns (args, bytes_needed, decode)."""
  s = len(seqs)
  pages = [-(-kv // ps) for _, kv in seqs]
  p = max(pages)
  n = 1 + sum(pages)
  perm = rng.permutation(np.arange(1, n)).astype(np.int32)
  table = np.zeros((s, p), np.int32)
  off = 0
  for i, npg in enumerate(pages):
    table[i, :npg] = perm[off:off + npg]
    off += npg
  q_lens = np.array([q for q, _ in seqs], np.int32)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  t = int(cu[-1])
  key = jax.random.PRNGKey(0)
  kk, kv_, kq = jax.random.split(key, 3)
  pool = (kvh, n, ps, d)
  k_pages = jax.random.normal(kk, pool, dtype)
  v_pages = jax.random.normal(kv_, pool, dtype)
  q = jax.random.normal(kq, (t, hq, d), dtype)
  kv_lens = np.array([kv for _, kv in seqs], np.int32)
  item = jnp.dtype(dtype).itemsize
  needed = (2 * int(kv_lens.sum()) * kvh * d + 2 * t * hq * d) * item
  args = (q, k_pages, v_pages, jnp.asarray(kv_lens), jnp.asarray(table),
          jnp.asarray(cu), jnp.int32(s))
  return args, needed


def jax_paged_attention_fn(interpret, sm_scale):
  """JAX's own Triton decode kernel adapted to our layout, or (None, why)."""
  try:
    from jax.experimental.pallas.ops.gpu import paged_attention as jpa
  except Exception as e:  # pylint: disable=broad-except
    return None, f"import failed: {type(e).__name__}: {e}"

  def fn(q, k_pages, v_pages, kv_lens, page_table, cu, ns):
    del cu, ns  # decode: one query token per sequence, all slots live
    p = page_table.shape[1]
    k_splits = max(s for s in (16, 8, 4, 2, 1) if p % s == 0)
    ppcb = max(c for c in (8, 4, 2, 1) if (p // k_splits) % c == 0)
    q = (q.astype(jnp.float32) * sm_scale).astype(q.dtype)  # no scale arg
    return jpa.paged_attention(q, k_pages, v_pages, page_table, kv_lens,
                               k_splits=k_splits, pages_per_compute_block=ppcb,
                               interpret=interpret)
  return jax.jit(fn), "ok"


def bench_row(name, args, needed, *, sm_scale, decode, opts, copy_bw, jpa):
  """Times ours / reference / JAX's kernel for one batch; returns a row."""
  ours = jax.jit(functools.partial(
      ragged_paged_attention, sm_scale=sm_scale, backend="pallas",
      interpret=opts.smoke))
  ref = jax.jit(functools.partial(
      ragged_paged_attention, sm_scale=sm_scale, backend="reference"))
  timing = dict(rounds=opts.rounds, inner=opts.inner)
  t_ours = timeit(ours, *args, **timing)
  out = ours(*args)
  ref_out = ref(*args)
  t_ref = timeit(ref, *args, **timing) if not opts.skip_reference else None
  err = float(jnp.abs(out.astype(jnp.float32)
                      - ref_out.astype(jnp.float32)).max())
  t_jpa = None
  if decode and jpa is not None:
    try:
      jerr = float(jnp.abs(jpa(*args).astype(jnp.float32)
                           - ref_out.astype(jnp.float32)).max())
      t_jpa = timeit(jpa, *args, **timing)
      err = max(err, jerr)
    except Exception as e:  # pylint: disable=broad-except
      print(f"  [{name}] jax paged_attention failed: {type(e).__name__}: "
            f"{str(e)[:200]}")
  gbs = needed / t_ours / 1e9
  row = dict(name=name, us=t_ours * 1e6, gbs=gbs,
             pct=100 * needed / t_ours / copy_bw,
             vs_ref=(t_ref / t_ours) if t_ref else None,
             vs_jax=(t_jpa / t_ours) if t_jpa else None, err=err)
  print(fmt_row(row), flush=True)
  return row


HEADER = (f"{'case':34s} {'us':>10s} {'GB/s':>8s} {'%copy':>6s} "
          f"{'xref':>7s} {'xjaxpa':>7s} {'maxdiff':>8s}")


def fmt_row(r):
  opt = lambda v: f"{v:7.2f}" if v is not None else f"{'-':>7s}"
  return (f"{r['name']:34s} {r['us']:10.1f} {r['gbs']:8.1f} {r['pct']:6.1f} "
          f"{opt(r['vs_ref'])} {opt(r['vs_jax'])} {r['err']:8.1e}")


def configs(smoke):
  """(decode batches, decode contexts, mixed batches as (q_len, kv_len))."""
  if smoke:
    mixed = {"mixed: 1x48 chunk/+80 + 3 dec@100": [(48, 128)] + [(1, 100)] * 3}
    return [1, 4], [64, 200], mixed
  mixed = {
      "mixed: 512 chunk/+1536 + 63 dec@2k": [(512, 2048)] + [(1, 2048)] * 63,
      "mixed: 4x256 fresh + 124 dec@1k": [(256, 256)] * 4 + [(1, 1024)] * 124,
      "prefill: 4x2048 fresh": [(2048, 2048)] * 4,
  }
  return [1, 16, 64, 256], [512, 2048, 8192], mixed


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--smoke", action="store_true",
                  help="tiny sizes on CPU: reference + interpret mode")
  ap.add_argument("--rounds", type=int, default=None)
  ap.add_argument("--inner", type=int, default=None)
  ap.add_argument("--skip-reference", action="store_true",
                  help="don't time the pure-JAX reference path")
  opts = ap.parse_args(argv)
  opts.rounds = opts.rounds or (2 if opts.smoke else 11)
  opts.inner = opts.inner or (1 if opts.smoke else 20)
  if not opts.smoke and jax.default_backend() != "gpu":
    sys.exit("no GPU backend: run with --smoke on CPU")
  hq, kvh, d, ps = (8, 2, 64, 16) if opts.smoke else (32, 8, 128, 16)
  dtype = jnp.float32 if opts.smoke else jnp.bfloat16
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, "
        f"devices {jax.devices()}")
  copy_bw = copy_bandwidth(2**20 if opts.smoke else 2**31, opts.rounds,
                           opts.inner)
  print(f"device-to-device copy bandwidth: {copy_bw / 1e9:.1f} GB/s "
        "(read + write)")
  jpa, why = jax_paged_attention_fn(opts.smoke, d ** -0.5)
  print(f"jax.experimental.pallas.ops.gpu.paged_attention: {why}")
  print(f"shapes: Hq={hq} KVH={kvh} D={d} page_size={ps} {jnp.dtype(dtype)}")
  print(HEADER)
  rng = np.random.default_rng(0)
  batches, contexts, mixed = configs(opts.smoke)
  cases = [(f"decode b={b} ctx={c}", [(1, c)] * b, True)
           for b in batches for c in contexts]
  cases += [(name, seqs, False) for name, seqs in mixed.items()]
  rows = []
  for name, seqs, decode in cases:
    args, needed = make_step(rng, hq=hq, kvh=kvh, d=d, ps=ps, seqs=seqs,
                             dtype=dtype)
    rows.append(bench_row(name, args, needed, sm_scale=d ** -0.5,
                          decode=decode, opts=opts, copy_bw=copy_bw, jpa=jpa))
    del args
  print("\nSummary (xref / xjaxpa: speed-up of ours over that path; "
        "%copy: of the measured copy bandwidth)")
  print(HEADER)
  for r in rows:
    print(fmt_row(r))
  worst = max(r["err"] for r in rows)
  print(f"max |ours - reference| over all cases: {worst:.2e}")
  return 0 if worst < 0.1 else 1


if __name__ == "__main__":
  sys.exit(main())
