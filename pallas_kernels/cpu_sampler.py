"""The sampler's exact top_k / top_p cut and its candidates' top-k on the CPU, as native XLA FFI calls
(cpu_sampler.cc).

threshold f32[R] of logits x f32[R, V] (tempered, min_p-cut: -inf where cut), top_k i32[R] (0 or >= V:
off) and top_p f32[R] (1: off): per row, the smallest logit kept by the top_k cut (the k-th largest,
ties all kept), then by the top_p cut over the top_k survivors (the shortest head, in descending
order, whose probability mass reaches top_p, ended with its ties); -inf when both are off. Tokens
with logits >= the threshold are kept. This is what jaxpaged.sample.sampler's fallback needs for the rows
whose 256 largest logits do not decide the cut (flat distributions).

XLA:CPU finds it by bisection (`jaxpaged.sample.ops._bisect_threshold`: 32 passes over the row, 24 ms at
32 x 49k); the native call does a radix select per row (three histogram passes, the last two over a
small fraction of the row). Its sums are in double, XLA's in float32, so the two agree except where
a row's mass reaches top_p within float32 rounding at a token. Compiled on first use and
registered once per process (cpu_build.py); `load_cpu_sampler` is False where it can't be built.
`reference_threshold` is the readable reference: a sort.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels.cpu_build import load_target

SOURCE = Path(__file__).with_name("cpu_sampler.cc")
TARGET = "jaxpaged_cpu_sampler_threshold"
TOP_K_TARGET = "jaxpaged_cpu_sampler_top_k"
ROW_STATS_TARGET = "jaxpaged_cpu_sampler_row_stats"
GUMBEL_TARGET = "jaxpaged_cpu_sampler_gumbel_candidates"
SCALE_TARGET = "jaxpaged_cpu_sampler_scale"
MAX_GUMBEL_CANDIDATES = 16  # kMaxCandidates in the C++


def load_cpu_sampler() -> bool:
  """Builds and registers the five FFI targets once per process; False if it can't."""
  return (load_target(SOURCE, "JaxpagedCpuSamplerThreshold", TARGET)
          and load_target(SOURCE, "JaxpagedCpuSamplerTopK", TOP_K_TARGET)
          and load_target(SOURCE, "JaxpagedCpuSamplerRowStats", ROW_STATS_TARGET)
          and load_target(SOURCE, "JaxpagedCpuSamplerGumbelCandidates", GUMBEL_TARGET)
          and load_target(SOURCE, "JaxpagedCpuSamplerScale", SCALE_TARGET))


def scale_cpu(x, inv_temperature, log_min_p):
  """(scaled f32[R, V], min_p_threshold f32[R]) of x f32[R, V], inv_temperature f32[R] (1 / each row's
  temperature) and log_min_p f32[R] (log of its min_p: -inf when off), as `reference_scale` computes them in
  XLA, bit for bit but on rows holding a NaN (the sampler fails those; jit-traceable): the sampler's
  tempered logits cut at max + log(min_p), the maximum over the non-NaN values. XLA:CPU runs those
  ops as three passes over the rows, each on one thread, into fresh buffers: at 32 x 49k ~1.9 ms."""
  R = x.shape[0] if x.ndim == 2 else -1
  if (x.ndim != 2 or x.dtype != jnp.float32 or inv_temperature.shape != (R,) or inv_temperature.dtype != jnp.float32
      or log_min_p.shape != (R,) or log_min_p.dtype != jnp.float32):
    raise ValueError(f"scale_cpu takes x f32[R, V], inv_temperature f32[R] and log_min_p f32[R]; got x "
                     f"{x.dtype}{list(x.shape)}, inv_temperature {inv_temperature.dtype}{list(inv_temperature.shape)}, "
                     f"log_min_p {log_min_p.dtype}{list(log_min_p.shape)}")
  _require_kernel()
  out = (jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct((R,), jnp.float32))
  return tuple(jax.ffi.ffi_call(SCALE_TARGET, out)(x, inv_temperature, log_min_p))


def reference_scale(x, inv_temperature, log_min_p):
  """`scale_cpu` in XLA ops (readable): x scaled by the inverse temperature, cut below its maximum + log(min_p)."""
  scaled = x * inv_temperature[:, None]
  threshold = jnp.max(scaled, axis=-1) + log_min_p
  return jnp.where(scaled >= threshold[:, None], scaled, -jnp.inf), threshold


def row_stats_cpu(x, raw):
  """(ids i32[R], lse f32[R], finite bool[R]) of x, raw f32[R, V] (V >= 1; jit-traceable): each row's first
  maximum of x (V - 1 where x holds a NaN), and of raw its log-sum-exp (NaN where raw holds a NaN or its
  maximum is infinite) and whether all its values are finite: what a greedy token and a sampled token's
  log-prob need, in three passes over each row, sums in double (`reference_row_stats`: XLA's, in float32;
  at 32 x 49k the XLA ops take ~3 ms)."""
  if (x.ndim != 2 or x.dtype != jnp.float32 or raw.shape != x.shape or raw.dtype != jnp.float32
      or x.shape[1] < 1):
    raise ValueError(f"row_stats_cpu takes float32 x and raw of one shape [R, V], V >= 1; got x {x.dtype}"
                     f"{list(x.shape)}, raw {raw.dtype}{list(raw.shape)}")
  _require_kernel()
  R = x.shape[0]
  out = (jax.ShapeDtypeStruct((R,), jnp.int32), jax.ShapeDtypeStruct((R,), jnp.float32),
         jax.ShapeDtypeStruct((R,), jnp.bool_))
  return tuple(jax.ffi.ffi_call(ROW_STATS_TARGET, out)(x, raw))


def reference_row_stats(x, raw):
  """`row_stats_cpu` in XLA ops (readable): the first maximum (NaN rows: V - 1), max + log(sum(exp(raw -
  max))) and all(isfinite(raw))."""
  best = jnp.max(x, axis=-1, keepdims=True)
  ids = jnp.min(jnp.where(x == best, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1] - 1), axis=-1)
  top = jnp.max(raw, axis=-1, keepdims=True)
  lse = top + jnp.log(jnp.sum(jnp.exp(raw - top), axis=-1, keepdims=True))
  return ids, lse[:, 0], jnp.all(jnp.isfinite(raw), axis=-1)


def top_k_cpu(x, k: int):
  """(values f32[R, k], ids i32[R, k]): `jax.lax.top_k(x, k)` of x f32[R, V], k <= V: each row's k largest
  values, descending, equal values in index order (jit-traceable; builds the kernel first if needed). A
  bound from the row's 32-value chunk maxima (their k-th largest is at most the k-th largest value) leaves a
  few hundred candidates, in the chunks that reach it, of which k are selected and sorted (the radix select
  of the threshold first where many remain: rows of ties, or fewer chunks than k). At 32 x 49k, k = 256, on
  SmolLM2's logits: 0.73 ms; the radix select alone took ~2.2, XLA:CPU's TopK (a partial sort of each whole
  row) 4.8."""
  if x.ndim != 2 or x.dtype != jnp.float32 or not isinstance(k, int) or not 0 <= k <= x.shape[1]:
    raise ValueError(f"top_k_cpu takes float32 x [R, V] and an integer 0 <= k <= V; got x {x.dtype}"
                     f"{list(x.shape)}, k={k!r}")
  _require_kernel()
  shape = (x.shape[0], k)
  out = (jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape, jnp.int32))
  return tuple(jax.ffi.ffi_call(TOP_K_TARGET, out)(x))


def _require_kernel() -> None:
  if not load_cpu_sampler():
    raise RuntimeError("the native CPU sampler kernels (cpu_sampler.cc) could not be built: see the log")


def threshold_cpu(x, top_k, top_p):
  """f32[R]: the top_k then top_p threshold of each row of x f32[R, V] (jit-traceable; builds and registers
  the kernel first if needed: a RuntimeError where it can't be built)."""
  if (x.ndim != 2 or x.dtype != jnp.float32 or top_k.shape != x.shape[:1] or top_k.dtype != jnp.int32
      or top_p.shape != x.shape[:1] or top_p.dtype != jnp.float32):
    raise ValueError(f"threshold_cpu takes float32 x [R, V], int32 top_k [R] and float32 top_p [R]; got "
                     f"x {x.dtype}{list(x.shape)}, top_k {top_k.dtype}{list(top_k.shape)}, "
                     f"top_p {top_p.dtype}{list(top_p.shape)}")
  _require_kernel()
  out = jax.ShapeDtypeStruct(x.shape[:1], jnp.float32)
  return jax.ffi.ffi_call(TARGET, out)(x, top_k, top_p)


def reference_threshold(x, top_k, top_p):
  """f32[R]: `threshold_cpu` by a full sort of each row (readable, slow; float32 sums)."""
  R, V = x.shape
  ordered = -jnp.sort(-x, axis=-1)  # f32[R, V] descending
  k_on = (top_k > 0) & (top_k < V)
  k_threshold = jnp.where(k_on, jnp.take_along_axis(ordered, jnp.clip(top_k - 1, 0, V - 1)[:, None], -1)[:, 0],
                          -jnp.inf)  # f32[R]
  kept = ordered >= k_threshold[:, None]
  probs = jnp.where(kept, jnp.exp(ordered - ordered[:, :1]), 0.0)
  mass_before = jnp.cumsum(probs, axis=-1) - probs  # f32[R, V]: exclusive, descending order
  in_head = mass_before < top_p[:, None] * jnp.sum(probs, axis=-1, keepdims=True)
  last = jnp.maximum(jnp.sum(in_head, axis=-1), 1) - 1  # i32[R]: the head's last token
  p_threshold = jnp.take_along_axis(ordered, last[:, None], -1)[:, 0]
  p_threshold = jnp.where(top_p < 1.0, p_threshold, -jnp.inf)
  return jnp.maximum(k_threshold, p_threshold)


def gumbel_candidates_cpu(x, threshold, keys, need, num_candidates: int = 4):
  """(ids i32[R, C], ok bool[R]) naming, for each row r where need[r], the C = num_candidates tokens with the
  best Gumbel-max scores x[r, t] + noise(keys[r], t) over the tokens kept (x >= threshold[r]); x f32[R, V],
  threshold f32[R], keys u32[R, 2] (each row's Threefry key, after fold_in of its step), need bool[R]
  (jit-traceable). The noise is jaxpaged.sample.sampler's stream: the same Threefry bits, then -log(-log(u)) with
  float32 polynomials, so the scores are approximate (~1e-6). ok: every other kept token scores below the
  best by more than a margin far above that error, so the exact argmax is among the C ids (the caller scores
  them exactly); False where need is False, no token is kept, or the margin does not hold (rows are then
  left to the full-vocabulary pass). ids past a row's kept tokens repeat its best; rows not needed: 0.
  `reference_gumbel_candidates` is the readable version. Before it such rows took a second program (XLA's
  full-vocabulary pass) after the flags were read back: 32 rows of temperature alone over SmolLM2's 49k
  vocabulary, the whole sampler 8.9 -> 6.7 ms (docs/kernels.md)."""
  R = x.shape[0] if x.ndim == 2 else -1
  if (x.ndim != 2 or x.dtype != jnp.float32 or threshold.shape != (R,) or threshold.dtype != jnp.float32
      or keys.shape != (R, 2) or keys.dtype != jnp.uint32 or need.shape != (R,) or need.dtype != jnp.bool_):
    raise ValueError(f"gumbel_candidates_cpu takes x f32[R, V], threshold f32[R], keys u32[R, 2], need bool[R]; got "
                     f"x {x.dtype}{list(x.shape)}, threshold {threshold.dtype}{list(threshold.shape)}, keys "
                     f"{keys.dtype}{list(keys.shape)}, need {need.dtype}{list(need.shape)}")
  if not 1 <= num_candidates <= MAX_GUMBEL_CANDIDATES:
    raise ValueError(f"num_candidates={num_candidates} must be in [1, {MAX_GUMBEL_CANDIDATES}]")
  _require_kernel()
  out = (jax.ShapeDtypeStruct((R, num_candidates), jnp.int32), jax.ShapeDtypeStruct((R,), jnp.bool_))
  return tuple(jax.ffi.ffi_call(GUMBEL_TARGET, out)(x, threshold, keys, need))


def reference_gumbel_candidates(x, threshold, noise, need, num_candidates: int = 4):
  """`gumbel_candidates_cpu` with the exact noise f32[R, V] given (readable; ok wherever need): the ids of
  the num_candidates best scores, ties to the lower id."""
  scores = jnp.where(x >= threshold[:, None], x + noise, -jnp.inf)
  _, ids = jax.lax.top_k(scores, num_candidates)
  return jnp.where(need[:, None], ids, 0).astype(jnp.int32), need
