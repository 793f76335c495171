"""Benchmark ragged paged attention (decode and mixed batches).

GPU (default): Llama-3-8B attention shapes (32 q heads, 8 kv heads, D=128), bf16, page_size 16;
decode batch {1,16,64,256} x context {512,2048,8192} and mixed prefill+decode batches. Per row: device
time (median of rounds of back-to-back calls after warm-up), achieved GB/s over the bytes the step really
needs (K/V of every key a query sees + Q + O), % of a device-to-device copy bandwidth measured in the same
run, and speed ratio vs the blocked pure-JAX path (backend="xla") and vs jax.experimental.pallas.ops.gpu.
paged_attention (decode only, no windows). The error column is against the readable reference
(backend="reference", run once, untimed). Rows named "win=W" run with a sliding window of W keys.

  python benchmarks/attention.py               # GPU
  python benchmarks/attention.py --smoke       # CPU: tiny, reference+interpret
  python benchmarks/attention.py --sweep       # tiling variants of our kernel on a few rows
  python benchmarks/attention.py kv-fp8 [--smoke] [--json rows.jsonl]   # fp8 KV pages against bf16 (below)
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from jaxpaged.models.llama import LlamaConfig  # noqa: E402
from jaxpaged.worker.runner_config import resolve_kv_cache_dtype  # noqa: E402
from jaxpaged.worker.step_input import allocate_kv_pool, kv_bytes_per_page  # noqa: E402
from pallas_kernels import ragged_paged_attention  # noqa: E402
from pallas_kernels.kv_quant import quantize  # noqa: E402
from pallas_kernels.tiling import plan_kernel_calls  # noqa: E402

KV_FP8_DOC = """fp8 KV cache against bf16 on a GPU, in one run: the pool's token capacity and decode attention at 8k context.

    python benchmarks/attention.py kv-fp8 [--json rows.jsonl]  # H200/H100: Llama-3-8B's attention, 64 x 8,192 tokens
    python benchmarks/attention.py kv-fp8 --smoke  # any machine: tiny sizes, the kernel in interpret mode

capacity  the engine's pool sizing (jaxpaged/config.py: pages from the bytes a token takes) for a Llama-3-8B
          config on this device's free memory (gpu_memory_utilization 0.9, 16 GB of bf16 weights set aside), with
          kv_cache_dtype bf16 and fp8: tokens each, their ratio (target 2x); the fp8 pool is then allocated to
          show it fits.
decode    the Pallas attention kernel over one layer's pool, 64 sequences decoding at 8,192 tokens of context
          (32 query / 8 KV heads, D = 128, bf16 queries), bf16 pages against fp8 pages (e4m3 bytes with
          per-head scales): median microseconds per call of each from interleaved rounds, and bf16 / fp8
          (target >= 1.3x; decode at this context is bound by reading the pool, which fp8 halves). This is the
          attention part of a decode step only: the whole step adds the weights' read, the same on both sides.
One line per target, ours and the baseline side by side from this run."""


def chain(fn, inner):
  """One jitted program making `inner` calls of fn in a row, unrolled: an
  XLA:GPU while loop syncs with the host each iteration (~20 us). Each call's
  q depends on the sum of the whole previous output, so no call is merged,
  hoisted or cut short (a dependency on one element let XLA compute only that
  element of the pure-XLA reference). Timed is device work plus kernel
  launches (and one small reduction a call), not Python dispatch."""
  @jax.jit
  def chained(q, *rest):  # arrays as arguments: closures would be constants
    out = jnp.zeros_like(q)
    for _ in range(inner):
      dep = (jnp.sum(out, dtype=jnp.float32) * 0).astype(q.dtype)
      out = fn(q + dep, *rest).astype(q.dtype)
    return out
  return chained


def time_interleaved(fns, args, *, rounds, inner, warmup_s=0.2,
                     compiler_options=None, programs=None):
  """{name: (median device seconds per call, last output)} of each fns[name]
  on args; names whose program fails to build map to the exception.
  compiler_options: {name: XLA options} to compile that name's program with;
  programs: a dict that receives each name's compiled (chained) program.

  All programs are built first and the device is kept busy for warmup_s;
  then each round times every program once, in turn. A GPU left idle during
  compiles runs slower for a while, which had fallen on whichever variant was
  timed first (2026-11-29: the same tiling 8% apart in two runs)."""
  progs, outs, result = {}, {}, {}
  for name, fn in fns.items():
    try:
      progs[name] = chain(fn, inner).lower(*args).compile(
          compiler_options=(compiler_options or {}).get(name))
      outs[name] = jax.block_until_ready(progs[name](*args))
    except Exception as e:  # pylint: disable=broad-except
      progs.pop(name)
      result[name] = e
  t0 = time.perf_counter()
  while True:   # at least one warm call of each
    for prog in progs.values():
      jax.block_until_ready(prog(*args))
    if time.perf_counter() - t0 >= warmup_s:
      break
  if programs is not None:
    programs.update(progs)
  times = {name: [] for name in progs}
  for _ in range(rounds):
    for name, prog in progs.items():
      t0 = time.perf_counter()
      outs[name] = jax.block_until_ready(prog(*args))
      times[name].append((time.perf_counter() - t0) / inner)
  for name in progs:
    result[name] = (statistics.median(times[name]), outs[name])
  return result


def copy_bandwidth(nbytes, rounds, inner):
  """Bytes read + written per second by a device-to-device elementwise copy:
  back-to-back calls of one jitted program (at 1 GiB, dispatch is hidden).
  f32, not bf16: on an H200, XLA's bf16 elementwise kernel stops near
  3.3 TB/s (1 GiB, 2026-11-29) while f32 ones and a plain copy reach ~4.1."""
  x = jax.random.normal(jax.random.PRNGKey(1), (nbytes // 4,), jnp.float32)
  f = jax.jit(lambda a: a * 2)       # one read + one write of nbytes
  for _ in range(2):
    jax.block_until_ready(f(x))
  times = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    for _ in range(inner):
      y = f(x)
    jax.block_until_ready(y)
    times.append((time.perf_counter() - t0) / inner)
  return 2 * nbytes / statistics.median(times)


def make_step(rng, *, hq, kvh, d, ps, seqs, dtype, window=None):
  """seqs: list of (q_len, kv_len). Returns (args, bytes_needed): with a
  window, args end with it (int32) and only the window's K/V is needed."""
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
  seen = kv_lens if window is None else np.minimum(kv_lens, window + q_lens - 1)
  needed = (2 * int(seen.sum()) * kvh * d + 2 * t * hq * d) * item
  args = (q, k_pages, v_pages, jnp.asarray(kv_lens), jnp.asarray(table),
          jnp.asarray(cu), jnp.int32(s))
  if window is not None:
    args += (jnp.int32(window),)
  return args, needed


def attention_fn(**kw):
  """ragged_paged_attention taking an optional 8th argument: the window."""
  def fn(*args):
    window = args[7] if len(args) > 7 else None
    return ragged_paged_attention(*args[:7], sliding_window=window, **kw)
  return fn


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
  """Times ours / the XLA path / JAX's kernel for one batch; returns a row."""
  ours = jax.jit(attention_fn(sm_scale=sm_scale, backend="pallas",
                              interpret=opts.smoke))
  fns = {"ours": ours}
  if not opts.skip_xla:
    fns["xla"] = jax.jit(attention_fn(sm_scale=sm_scale, backend="xla"))
  if decode and jpa is not None and len(args) == 7:
    fns["jpa"] = jpa
  timed = time_interleaved(fns, args, rounds=opts.rounds, inner=opts.inner)
  for baseline in ("ours", "xla"):
    if isinstance(timed.get(baseline), Exception):
      raise timed[baseline]
  t_ours, out = timed["ours"]
  ref_out = jax.jit(attention_fn(sm_scale=sm_scale, backend="reference"))(
      *args).astype(jnp.float32)
  err = float(jnp.abs(out.astype(jnp.float32) - ref_out).max())
  t_xla = None
  if "xla" in timed:
    t_xla, xla_out = timed["xla"]
    err = max(err, float(jnp.abs(xla_out.astype(jnp.float32)
                                 - ref_out).max()))
  t_jpa = None
  if isinstance(timed.get("jpa"), Exception):
    e = timed["jpa"]
    print(f"  [{name}] jax paged_attention failed: {type(e).__name__}: "
          f"{str(e)[:200]}")
  elif "jpa" in timed:
    t_jpa, jout = timed["jpa"]
    err = max(err, float(jnp.abs(jout.astype(jnp.float32) - ref_out).max()))
  gbs = needed / t_ours / 1e9
  row = dict(name=name, us=t_ours * 1e6, gbs=gbs,
             pct=100 * needed / t_ours / copy_bw,
             vs_xla=(t_xla / t_ours) if t_xla else None,
             vs_jax=(t_jpa / t_ours) if t_jpa else None, err=err)
  print(fmt_row(row), flush=True)
  return row


HEADER = (f"{'case':44s} {'us':>10s} {'GB/s':>8s} {'%copy':>6s} "
          f"{'xxla':>7s} {'xjaxpa':>7s} {'maxdiff':>8s}")


def fmt_row(r):
  opt = lambda v: f"{v:7.2f}" if v is not None else f"{'-':>7s}"
  return (f"{r['name']:44s} {r['us']:10.1f} {r['gbs']:8.1f} {r['pct']:6.1f} "
          f"{opt(r['vs_xla'])} {opt(r['vs_jax'])} {r['err']:8.1e}")


def configs(smoke):
  """(decode batches, decode contexts, mixed batches as (q_len, kv_len),
  windowed rows as name: (seqs, window))."""
  if smoke:
    mixed = {"mixed: 1x48 chunk/+80 + 3 dec@100": [(48, 128)] + [(1, 100)] * 3}
    windowed = {"decode b=4 ctx=200 win=48": ([(1, 200)] * 4, 48)}
    return [1, 4], [64, 200], mixed, windowed
  mixed = {
      "mixed: 512 chunk/+1536 + 63 dec@2k": [(512, 2048)] + [(1, 2048)] * 63,
      "mixed: 4x256 fresh + 124 dec@1k": [(256, 256)] * 4 + [(1, 1024)] * 124,
      "prefill: 4x2048 fresh": [(2048, 2048)] * 4,
  }
  # Long-context decodes under a window (Gemma 3's local layers: 512 or
  # 1024): compare with the same batch's unwindowed row above.
  windowed = {
      "decode b=64 ctx=8192 win=1024": ([(1, 8192)] * 64, 1024),
      "decode b=16 ctx=8192 win=512": ([(1, 8192)] * 16, 512),
      "mixed: 512 chunk/+1536 + 63 dec@2k win=512":
          ([(512, 2048)] + [(1, 2048)] * 63, 512),
  }
  return [1, 16, 64, 256], [512, 2048, 8192], mixed, windowed


# Tiling variants the sweep times against the heuristic's choice, by label.
# "old" is the default before 2026-11-29's pipelining change (64-key blocks,
# 2 stages); the rest bracket today's defaults (decode: 32-key blocks, 4
# stages, 4 warps; prefill: 64-key blocks, 3 stages, 8 warps) in warps, block
# size, depth and splits. Warp counts are decode-tile choices: rows with
# prefill tiles skip them. On 2026-11-29, 2 decode warps came out 5-15%
# faster than 4 on long rows in one run and within noise in the next, where
# b=64 ctx=512 ran 50% slower (docs/kernels.md): the short rows settle it.
SWEEP_VARIANTS = {
    "default": {},
    "old": dict(pages_per_block=4, num_stages=2),
    "warps 2": dict(num_warps=2),
    "ppb 4 st 3": dict(pages_per_block=4, num_stages=3),
    "ppb 8 st 2": dict(pages_per_block=8, num_stages=2),
    "ppb 8 st 3": dict(pages_per_block=8, num_stages=3),
    "splits half": dict(num_splits="half"),
    "splits x2": dict(num_splits="x2"),
}


def sweep_cases(smoke):
  if smoke:
    return {"decode b=4 ctx=200": [(1, 200)] * 4}
  return {"decode b=64 ctx=2048": [(1, 2048)] * 64,
          "decode b=64 ctx=512": [(1, 512)] * 64,
          "decode b=1 ctx=512": [(1, 512)],
          "decode b=1 ctx=8192": [(1, 8192)],
          "decode b=256 ctx=512": [(1, 512)] * 256,
          "mixed: 512 chunk/+1536 + 63 dec@2k": [(512, 2048)]
                                                + [(1, 2048)] * 63,
          "prefill: 4x2048 fresh": [(2048, 2048)] * 4}


def resolve_variant(variant, args, group, ps):
  """Turns relative num_splits ('half', 'x2', 'x4') into a number."""
  variant = dict(variant or {})
  if "num_splits" in variant:
    q, _, _, _, page_table, _, _ = args
    t, s, p = q.shape[0], page_table.shape[0], page_table.shape[1]
    base = plan_kernel_calls(
        t, s, group, ps, p, args[1].shape[0], head_dim=q.shape[2],
        itemsize=q.dtype.itemsize,
        pages_per_block=variant.get("pages_per_block"))[0].cfg.num_splits
    mult = {"half": 0.5, "x2": 2, "x4": 4}[variant["num_splits"]]
    variant["num_splits"] = max(1, int(base * mult))
  return variant


def run_sweep(opts, copy_bw, rng, shapes, dtype, out_rows):
  """Times tiling variants of our kernel on a few rows (no baselines)."""
  hq, kvh, d, ps = shapes
  print("\n== tiling sweep (ours only; 'x default' = default time / this)")
  for name, seqs in sweep_cases(opts.smoke).items():
    args, needed = make_step(rng, hq=hq, kvh=kvh, d=d, ps=ps, seqs=seqs,
                             dtype=dtype)
    fns, kws = {}, {}
    for label, variant in SWEEP_VARIANTS.items():
      if "num_warps" in variant and not name.startswith("decode"):
        continue   # a prefill tile's warps: not what these variants probe
      kws[label] = resolve_variant(variant, args, hq // kvh, ps)
      fns[label] = functools.partial(
          ragged_paged_attention, sm_scale=d ** -0.5, backend="pallas",
          interpret=opts.smoke, **kws[label])
    timed = time_interleaved(fns, args, rounds=opts.rounds, inner=opts.inner)
    base = timed["default"][0]
    for label, kw in kws.items():
      if isinstance(timed[label], Exception):
        e = timed[label]
        print(f"  {name} {label}: failed: {type(e).__name__}: {str(e)[:160]}")
        continue
      t = timed[label][0]
      print(f"  {name:34s} {label:12s} {str(kw or ''):44s} {t * 1e6:9.1f} us "
            f"{100 * needed / t / copy_bw:5.1f} %copy  x default "
            f"{base / t:5.2f}", flush=True)
      out_rows.append(dict(kind="sweep", name=name, label=label, variant=kw,
                           us=t * 1e6, pct=100 * needed / t / copy_bw))
    del args


def attention_main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--smoke", action="store_true",
                  help="tiny sizes on CPU: reference + interpret mode")
  ap.add_argument("--rounds", type=int, default=None)
  ap.add_argument("--inner", type=int, default=None)
  ap.add_argument("--skip-xla", action="store_true",
                  help="don't time the blocked pure-JAX path")
  ap.add_argument("--sweep", action="store_true",
                  help="only time tiling variants of our kernel on a few rows")
  ap.add_argument("--json", default=None,
                  help="also write every row as JSON lines to this file")
  opts = ap.parse_args(argv)
  opts.rounds = opts.rounds or (2 if opts.smoke else 11)
  opts.inner = opts.inner or (1 if opts.smoke else 10)
  if not opts.smoke and jax.default_backend() != "gpu":
    sys.exit("no GPU backend: run with --smoke on CPU")
  shapes = (8, 2, 64, 16) if opts.smoke else (32, 8, 128, 16)
  hq, kvh, d, ps = shapes
  dtype = jnp.float32 if opts.smoke else jnp.bfloat16
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, "
        f"devices {jax.devices()}")
  copy_bw = copy_bandwidth(2**20 if opts.smoke else 2**30, opts.rounds,
                           opts.inner)
  print(f"device-to-device copy bandwidth: {copy_bw / 1e9:.1f} GB/s "
        "(read + write)")
  rng = np.random.default_rng(0)
  rows = []
  try:
    if opts.sweep:
      run_sweep(opts, copy_bw, rng, shapes, dtype, rows)
      return 0 if rows else 1
    return run_table(opts, copy_bw, rng, shapes, dtype, rows)
  finally:
    if opts.json:
      with open(opts.json, "w", encoding="utf-8") as f:
        for r in rows:
          f.write(json.dumps(dict(r, copy_gbs=copy_bw / 1e9)) + "\n")


def run_table(opts, copy_bw, rng, shapes, dtype, rows):
  """The issue's table: decode grid and mixed rows vs both baselines."""
  hq, kvh, d, ps = shapes
  jpa, why = jax_paged_attention_fn(opts.smoke, d ** -0.5)
  print(f"jax.experimental.pallas.ops.gpu.paged_attention: {why}")
  print(f"shapes: Hq={hq} KVH={kvh} D={d} page_size={ps} {jnp.dtype(dtype)}")
  print(HEADER)
  batches, contexts, mixed, windowed = configs(opts.smoke)
  cases = [(f"decode b={b} ctx={c}", [(1, c)] * b, True, None)
           for b in batches for c in contexts]
  cases += [(name, seqs, False, None) for name, seqs in mixed.items()]
  cases += [(name, seqs, name.startswith("decode"), w)
            for name, (seqs, w) in windowed.items()]
  failed = 0
  for name, seqs, decode, window in cases:
    args, needed = make_step(rng, hq=hq, kvh=kvh, d=d, ps=ps, seqs=seqs,
                             dtype=dtype, window=window)
    try:
      rows.append(bench_row(name, args, needed, sm_scale=d ** -0.5,
                            decode=decode, opts=opts, copy_bw=copy_bw,
                            jpa=jpa))
    except Exception as e:  # pylint: disable=broad-except
      failed += 1
      print(f"{name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
    del args
  print("\nSummary (xxla / xjaxpa: speed-up of ours over that path; "
        "%copy: of the measured copy bandwidth)")
  print(HEADER)
  for r in rows:
    print(fmt_row(r))
  worst = max((r["err"] for r in rows), default=float("inf"))
  print(f"max |ours or xla - reference| over all cases: {worst:.2e}; "
        f"{failed} case(s) failed")
  return 0 if worst < 0.1 and not failed else 1


# ---- kv-fp8 ----------------------------------------------------------------------------------------------------

LLAMA3_8B = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                        rope_theta=500000.0, max_position_embeddings=8192)  # gpu_engine.py's model too
WEIGHT_BYTES = 16 << 30  # Llama-3-8B's bf16 weights, set aside from the device's memory


def fp8_capacity(smoke: bool) -> dict:
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


def fp8_decode(smoke: bool, rounds: int) -> dict:
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


def kv_fp8_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="attention.py kv-fp8", description=KV_FP8_DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, interpret mode (any machine)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--json", default=None, help="append the rows as JSON lines here")
    args = ap.parse_args(argv)
    rows = [fp8_capacity(args.smoke), fp8_decode(args.smoke, args.rounds or (2 if args.smoke else 15))]
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


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "kv-fp8":
        return kv_fp8_main(argv[1:])
    return attention_main(argv)


if __name__ == "__main__":
    sys.exit(main())
