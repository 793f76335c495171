"""The native CPU top_k / top_p cut (cpu_sampler.cc) against its definition, the sort reference and the
sampler's bisection."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.sample import sampler
from jaxpaged.sample import ops
from jaxpaged.sample import sampling_batch
from pallas_kernels import cpu_sampler

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the native kernel is XLA:CPU's")


def native(x, top_k, top_p):
  return np.asarray(jax.jit(cpu_sampler.threshold_cpu)(
      jnp.asarray(x, jnp.float32), jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32)))


def rows(seed: int, num_rows: int, vocab: int, scale: float) -> np.ndarray:
  x = np.random.default_rng(seed).standard_normal((num_rows, vocab)).astype(np.float32) * scale
  x[1, : vocab // 3] = -np.inf  # a min_p cut
  x[2] = np.round(x[2])  # ties everywhere
  return x


def check_definition(x: np.ndarray, top_k: int, top_p: float, got: float) -> None:
  """got is the top_k-th largest value when top_p is off; else it is at or above that cut and, among the
  top_k survivors, the mass at or above got reaches top_p while the mass strictly above it does not
  (float64 sums, rounding slack)."""
  v = x.astype(np.float64)
  k_on = 0 < top_k < len(v)
  k_cut = np.sort(v)[::-1][top_k - 1] if k_on else -np.inf
  if not k_on and top_p >= 1.0:
    assert got == -np.inf
    return
  assert (v >= got).sum() >= 1
  if top_p >= 1.0:  # the k-th largest value: >= k tokens kept, ties all

    assert got == np.float32(k_cut)
    return
  w = np.where(v >= k_cut, np.exp(v - v.max()), 0.0)
  target = top_p * w.sum()
  assert got >= k_cut
  assert w[v >= got].sum() >= target * (1 - 1e-6)
  assert w[v > got].sum() < target * (1 + 1e-6)


@pytest.mark.parametrize("vocab, scale", [(49152, 2.0), (1000, 0.1), (300, 8.0), (64, 1.0)])
def test_meets_the_definition_on_every_row(vocab, scale):
  """Flat and peaked rows, a row cut by min_p (-inf), one of ties; top_k off, small, large and >= V, top_p
  off, low and high, and both together."""
  settings = [(0, 0.95), (5, 1.0), (100, 0.5), (vocab // 2, 0.9), (vocab + 7, 0.99), (0, 0.7), (vocab - 1, 1.0),
              (1, 0.3), (0, 1.0), (3, 0.999)]
  x = rows(vocab, len(settings), vocab, scale)
  top_k, top_p = (np.array(c) for c in zip(*settings))
  got = native(x, top_k, top_p)
  for i, (k, p) in enumerate(settings):
    check_definition(x[i], int(k), float(p), float(got[i]))


def test_agrees_with_the_sort_reference_and_the_bisection():
  """Random rows of SmolLM2's vocabulary width: the three agree exactly except where a row's mass reaches
  top_p within float32 rounding (the native sums are in double): at most one row in 64 here."""
  x = rows(7, 64, 49152, 2.0)
  rng = np.random.default_rng(8)
  top_k = rng.choice([0, 0, 20, 300, 5000], size=64).astype(np.int32)
  top_p = rng.choice([1.0, 0.95, 0.8, 0.5], size=64).astype(np.float32)
  got = native(x, top_k, top_p)
  ref = np.asarray(cpu_sampler.reference_threshold(jnp.asarray(x), jnp.asarray(top_k), jnp.asarray(top_p)))
  bisect = np.asarray(jax.jit(ops._bisect_threshold)(jnp.asarray(x), jnp.asarray(top_k), jnp.asarray(top_p)))
  assert (ref == bisect).sum() >= 63 and (got == ref).sum() >= 63
  only_k = top_p == 1.0
  assert (got[only_k] == ref[only_k]).all()  # counts are exact


def test_edge_shapes_and_bad_arguments():
  assert native(np.zeros((0, 5)), np.zeros(0), np.zeros(0)).shape == (0,)
  assert native(np.array([[1.5]]), [0], [0.5])[0] == 1.5
  assert native(np.array([[1.0, 2.0]]), [0], [1.0])[0] == -np.inf
  with pytest.raises(ValueError, match="threshold_cpu takes float32 x"):
    cpu_sampler.threshold_cpu(jnp.zeros((2, 4), jnp.bfloat16), jnp.zeros(2, jnp.int32), jnp.ones(2))
  with pytest.raises(ValueError, match="top_k"):
    cpu_sampler.threshold_cpu(jnp.zeros((2, 4)), jnp.zeros(3, jnp.int32), jnp.ones(2))


@pytest.mark.parametrize("k", [0, 1, 20, 256, 1000])
def test_top_k_is_lax_top_k(k):
  """Values and ids of lax.top_k, bit for bit: equal values in index order (a row of ties, one where -0 and +0
  straddle the k-th place), -inf rows' tails, and k from 0 to past the ties."""
  x = rows(k, 8, 4096, 2.0)
  x[3, :600], x[3, 600:1200], x[3, 1200:] = 0.0, -0.0, -1.0
  x[4, 100:] = -np.inf
  got_values, got_ids = jax.jit(lambda a: cpu_sampler.top_k_cpu(a, k))(jnp.asarray(x))
  want_values, want_ids = jax.lax.top_k(jnp.asarray(x), k)
  np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(want_ids))
  np.testing.assert_array_equal(np.asarray(got_values).view(np.uint32), np.asarray(want_values).view(np.uint32))
  with pytest.raises(ValueError, match="top_k_cpu takes"):
    cpu_sampler.top_k_cpu(jnp.asarray(x), 4097)


@pytest.mark.parametrize("k", [1, 256, 1536, 1537])
def test_top_k_bound_on_chunk_maxima_is_lax_top_k(k):
  """At a vocabulary of whole 32-value chunks and a tail (49157 = 1536 * 32 + 5), k up to one past the chunk
  count (there the kernel takes the radix select): logit-like rows, one that is all ties, ties straddling the
  k-th place across chunks, the largest values in the tail, -inf beyond the first chunks."""
  vocab = 49157
  rng = np.random.default_rng(k)
  x = (rng.standard_normal((6, vocab)) * 2.5).astype(np.float32)
  x[0, rng.integers(0, vocab, 40)] += 12.0  # peaked
  x[1] = 0.5  # all ties
  x[2] = np.round(x[2] * 2) / 2  # ties straddle every place, across chunks
  x[3, -5:] = 30.0  # the tail holds the largest values
  x[4, 64:] = -np.inf
  x[5, ::2], x[5, 1::2] = 0.0, -0.0
  got_values, got_ids = jax.jit(lambda a: cpu_sampler.top_k_cpu(a, k))(jnp.asarray(x))
  want_values, want_ids = jax.lax.top_k(jnp.asarray(x), k)
  np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(want_ids))
  np.testing.assert_array_equal(np.asarray(got_values).view(np.uint32), np.asarray(want_values).view(np.uint32))


def test_scale_is_the_samplers_xla_scale_bit_for_bit():
  """scale_cpu against its reference and the sampler's XLA `_scale` (the path off the CPU): tempered rows, a
  greedy row (temperature 1), min_p on and off, an infinite maximum, signed zeros; a NaN row (the sampler fails
  it) only runs."""
  from jaxpaged.sample.sampling_batch import RowInfo, make_sampling_batch
  from jaxpaged.sampling_params import SamplingParams
  S, V = 8, 1003
  x = (np.random.default_rng(5).standard_normal((S, V)) * 3).astype(np.float32)
  x[3, 7] = np.nan
  x[4, 9] = np.inf
  x[5, ::2], x[5, 1::2] = 0.0, -0.0
  params = [SamplingParams(temperature=0.7), SamplingParams(temperature=0.0), SamplingParams(temperature=1.3,
            min_p=0.1), SamplingParams(temperature=0.9), SamplingParams(temperature=0.8, min_p=0.05),
            SamplingParams(temperature=0.3, min_p=0.2), SamplingParams(temperature=1.0, min_p=0.5)]
  batch = make_sampling_batch([RowInfo(p, seed=i) for i, p in enumerate(params)], S, V)
  xj = jnp.asarray(x)
  want = jax.jit(lambda a, b: sampler._scale(a, b))(xj, batch)
  got = jax.jit(lambda a, b: sampler._scale(a, b, native=True))(xj, batch)
  inverse = 1.0 / jnp.where(jnp.asarray(batch.temperature) < sampling_batch.GREEDY_TEMPERATURE_EPS, 1.0,
                            jnp.asarray(batch.temperature))
  ref = jax.jit(cpu_sampler.reference_scale)(xj, inverse, jnp.log(jnp.asarray(batch.min_p)))
  rows = np.arange(S) != 3
  for a, b, c in zip(got, want, ref):
    np.testing.assert_array_equal(np.asarray(a)[rows].view(np.uint32), np.asarray(b)[rows].view(np.uint32))
    np.testing.assert_array_equal(np.asarray(a)[rows].view(np.uint32), np.asarray(c)[rows].view(np.uint32))
  scaled = np.asarray(got[0])
  assert (scaled[2] == -np.inf).any() and not (scaled[0] == -np.inf).any()  # min_p cuts only where on
  assert np.isinf(scaled[4, 9]) and (scaled[4, :9] == -np.inf).all()  # an infinite maximum cuts the rest
  with pytest.raises(ValueError, match="scale_cpu takes"):
    cpu_sampler.scale_cpu(xj, inverse[:3], inverse)


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 1000, 49152])
def test_row_stats_match_the_reference(vocab):
  """Same ids and finite flags as the XLA reference, log-sum-exps within float32 rounding; rows with -inf
  (a grammar or min_p cut) stay finite-sum rows; NaN / +inf / all -inf rows get NaN and are flagged."""
  rng = np.random.default_rng(vocab)
  raw = (rng.standard_normal((8, vocab)) * 4).astype(np.float32)
  x = raw + rng.standard_normal((8, vocab)).astype(np.float32)  # "processed": bias, penalties
  raw[1, :(vocab + 1) // 2] = -np.inf  # a cut: the sum skips them (vocab 1: all -inf)
  x[2] = np.round(x[2] / 8)  # ties for the maximum: the first one
  x[3, -1] = x[3].max() + 1  # the maximum in the last lane
  bad = raw.copy()
  bad[4, vocab // 2] = np.nan
  bad[5, 0] = np.inf
  bad[6] = -np.inf
  ids, lse, finite = jax.jit(cpu_sampler.row_stats_cpu)(jnp.asarray(x), jnp.asarray(bad))
  ref_ids, ref_lse, ref_finite = jax.jit(cpu_sampler.reference_row_stats)(jnp.asarray(x), jnp.asarray(bad))
  np.testing.assert_array_equal(ids, ref_ids)
  np.testing.assert_array_equal(finite, ref_finite)
  assert list(np.asarray(finite)) == [True, False, True, True, False, False, False, True]
  ok = ~np.isnan(np.asarray(ref_lse))
  np.testing.assert_allclose(np.asarray(lse)[ok], np.asarray(ref_lse)[ok], rtol=2e-6, atol=2e-6)
  assert np.array_equal(np.isnan(lse), ~ok) and ok[[0, 2, 3, 7]].all()
  x[5, vocab // 2] = np.nan  # a NaN in x: the last id (a NaN row is flagged by its raw logits and never emitted)
  assert int(jax.jit(cpu_sampler.row_stats_cpu)(jnp.asarray(x), jnp.asarray(raw))[0][5]) == vocab - 1


def test_row_stats_bad_arguments():
  with pytest.raises(ValueError, match="same shape|one shape"):
    cpu_sampler.row_stats_cpu(jnp.zeros((2, 4)), jnp.zeros((2, 5)))
  with pytest.raises(ValueError, match="V >= 1"):
    cpu_sampler.row_stats_cpu(jnp.zeros((2, 0)), jnp.zeros((2, 0)))
  with pytest.raises(ValueError, match="float32"):
    cpu_sampler.row_stats_cpu(jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 4), jnp.int32))


def test_the_greedy_sampler_takes_the_native_row_stats():
  """The sampler's greedy part with the native row stats: the XLA part's tokens, log-probs within rounding."""
  logits = jnp.asarray((np.random.default_rng(3).standard_normal((4, 3000)) * 5).astype(np.float32))
  batch = sampling_batch.make_sampling_batch([], 4, 3000)
  native = sampler._greedy_sample(logits, batch, True)
  xla = sampler._greedy_sample(logits, batch, False)
  np.testing.assert_array_equal(native.token_ids, xla.token_ids)
  np.testing.assert_allclose(native.logprobs, xla.logprobs, rtol=1e-5, atol=1e-5)
  assert bool(native.finite.all())


# ---- the whole-row Gumbel candidates -----------------------------------------------------------------------


def test_gumbel_candidates_hold_the_exact_argmax():
  """Over flat and peaked rows, cuts and none: where the call says ok, XLA's exact full-row Gumbel-max
  (ops._gumbel_argmax over every token) is among its candidates, so scoring them exactly draws the
  same token; ok nearly everywhere; rows not needed get ok False and ids 0."""
  R, V = 48, 5000
  rng = np.random.default_rng(3)
  x = rng.standard_normal((R, V)).astype(np.float32) * np.repeat([0.05, 1.0, 8.0], R // 3)[:, None]
  threshold = np.where(np.arange(R) % 4 == 1, np.sort(x, axis=1)[:, -300], -np.inf).astype(np.float32)
  key_data = rng.integers(0, 2**32, (R, 2), dtype=np.uint64).astype(np.uint32)
  steps = rng.integers(0, 1000, R).astype(np.int32)
  need = np.arange(R) % 7 != 3
  args = [jnp.asarray(a) for a in (x, threshold, key_data, steps)]
  keys = jax.jit(ops._row_keys)(args[2], args[3])
  ids, ok = map(np.asarray, jax.jit(cpu_sampler.gumbel_candidates_cpu)(args[0], args[1], keys, jnp.asarray(need)))
  all_ids = jnp.broadcast_to(jnp.arange(V, dtype=jnp.int32), (R, V))
  want, _ = jax.jit(ops._gumbel_argmax)(args[0], all_ids, args[1], args[2], args[3])
  want = np.asarray(want)
  noise = jax.jit(ops._gumbel_noise_at)(args[2], args[3], all_ids)  # the exact stream, every token
  ref_ids, ref_ok = map(np.asarray, jax.jit(cpu_sampler.reference_gumbel_candidates)(
      args[0], args[1], noise, jnp.asarray(need)))
  np.testing.assert_array_equal(ref_ids[need, 0], want[need])  # the readable version's best: the exact argmax
  np.testing.assert_array_equal(ref_ok, need)
  assert ids.shape == (R, sampler.GUMBEL_CANDIDATES) and ids.dtype == np.int32
  assert not ok[~need].any() and (ids[~need] == 0).all()
  assert ok[need].mean() > 0.95
  for r in np.flatnonzero(ok):
    assert want[r] in ids[r], r
    assert (x[r, ids[r]] >= threshold[r]).all()  # only kept tokens are named
  values = jnp.take_along_axis(args[0], jnp.asarray(ids), axis=-1)
  got, _ = jax.jit(ops._gumbel_argmax)(values, jnp.asarray(ids), args[1], args[2], args[3])
  np.testing.assert_array_equal(np.asarray(got)[ok], want[ok])


def test_gumbel_candidates_reject_bad_arguments():
  x, t = jnp.zeros((2, 8), jnp.float32), jnp.zeros((2,), jnp.float32)
  keys, need = jnp.zeros((2, 2), jnp.uint32), jnp.ones((2,), bool)
  with pytest.raises(ValueError, match="keys u32"):
    cpu_sampler.gumbel_candidates_cpu(x, t, keys.astype(jnp.int32), need)
  with pytest.raises(ValueError, match="num_candidates"):
    cpu_sampler.gumbel_candidates_cpu(x, t, keys, need, num_candidates=17)
