"""The fp8 KV pool: the write path's quantization, and every attention backend
reading e4m3 pages with their scales, against a float64 NumPy oracle over the
pages dequantized on the host (ml_dtypes) and against the pure-JAX reference.

Batches come from test_ragged_paged_attention's `make_batch` (pages shuffled
over the pool, NaN in every slot no query may read), their pools quantized
here with per-KV-head scales wide enough that some values saturate.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention, write_kv
from pallas_kernels.kv_quant import FP8_MAX, quantize
from pallas_kernels.kv_write import write_kv_reference
from tests.pallas_kernels.test_ragged_paged_attention import (
    BACKENDS, make_batch, oracle, run)

F8 = ml_dtypes.float8_e4m3fn


def _host_quantize(x, scale):
  """x [..., KVH, N, ps, D] f32 / scale[KVH], clamped, rounded to e4m3: the
  pool's bytes (uint8)."""
  s = np.asarray(scale, np.float32)[:, None, None, None]
  y = np.clip(np.asarray(x, np.float32) / s, -FP8_MAX, FP8_MAX).astype(F8)
  return y.view(np.uint8)


def _host_dequantize(e, scale):
  return e.view(F8).astype(np.float32) * np.asarray(scale, np.float32)[:, None, None, None]


def fp8_batch(rng, q_lens, kv_lens, q_dtype=jnp.float32, **kw):
  """A batch whose pools are e4m3 with scales (k_scale, v_scale) f32 [KVH]
  (the selected layer's, for a layer-stacked pool: every layer uses them)."""
  b = make_batch(rng, q_lens, kv_lens, **kw)
  kvh = b.k_pages.shape[-4]
  k_scale = rng.uniform(0.004, 0.02, kvh).astype(np.float32)  # some |k| > 448 s
  v_scale = rng.uniform(0.01, 0.5, kvh).astype(np.float32)
  q = np.asarray(jnp.asarray(b.q, q_dtype))
  return (dataclasses.replace(b, q=q, k_pages=_host_quantize(b.k_pages, k_scale),
                              v_pages=_host_quantize(b.v_pages, v_scale)),
          k_scale, v_scale)


def dequantized(b, k_scale, v_scale):
  """The batch as the float values its fp8 pages stand for (the oracle's)."""
  return dataclasses.replace(b, k_pages=_host_dequantize(b.k_pages, k_scale),
                             v_pages=_host_dequantize(b.v_pages, v_scale))


def check_fp8(b, k_scale, v_scale, interpret, tol):
  want = oracle(dequantized(b, k_scale, v_scale))
  live = int(b.cu_q_lens[b.num_seqs])
  scales = dict(k_scale=jnp.asarray(k_scale), v_scale=jnp.asarray(v_scale))
  for backend in BACKENDS:
    got = run(b, backend, interpret, **scales)
    assert not np.isnan(got).any(), f"{backend}: NaN in output"
    assert np.all(got[live:] == 0), f"{backend}: padding rows not zero"
    err = np.abs(got - want).max()
    assert err <= tol, f"{backend}: max abs err {err} > {tol}"


@pytest.mark.parametrize("q_dtype,tol", [(jnp.float32, 1e-4),
                                         (jnp.bfloat16, 3e-2)])
def test_every_backend_reads_fp8_pages(q_dtype, tol, interpret):
  """Decodes, a prefill chunk over a prefix, a fresh prompt: each backend
  (reference, XLA, native CPU, Pallas) matches the oracle on the dequantized
  pages."""
  rng = np.random.default_rng(7)
  b, ks, vs = fp8_batch(rng, [1, 1, 20, 5], [40, 17, 52, 5],
                        q_dtype=q_dtype, num_slots=6)
  check_fp8(b, ks, vs, interpret, tol)


def test_fp8_layer_stacked_pool_and_window(interpret):
  """A layer-stacked fp8 pool with a traced layer and a sliding window."""
  rng = np.random.default_rng(11)
  b, ks, vs = fp8_batch(rng, [1, 9, 1], [70, 33, 20], layers=3)
  b = dataclasses.replace(b, sliding_window=24)
  check_fp8(b, ks, vs, interpret, 1e-4)


def test_write_quantizes_with_the_scale_and_saturates():
  """write_kv stores x / scale rounded to e4m3 (the host reference's bytes
  exactly), clamps what passes 448 * scale to +-448 (no NaN), and leaves
  other slots alone; a layer-stacked pool writes only its layer."""
  rng = np.random.default_rng(3)
  kvh, n, ps, d, t = 2, 6, 8, 16, 10
  pool = jnp.asarray(rng.standard_normal((3, kvh, n, ps, d)).astype(F8).view(np.uint8))
  k_new = rng.standard_normal((t, kvh, d)).astype(np.float32) * 3
  v_new = rng.standard_normal((t, kvh, d)).astype(np.float32)
  k_new[0, 0, :4] = [1e6, -1e6, 1e30, -5e3]       # beyond 448 * scale
  slots = jnp.asarray(rng.permutation(n * ps)[:t], jnp.int32)
  ks = jnp.asarray([0.5, 0.01], jnp.float32)
  vs = jnp.asarray([0.02, 2.0], jnp.float32)
  want = write_kv_reference(pool, pool, jnp.asarray(k_new),
                            jnp.asarray(v_new), slots, layer=1, k_scale=ks,
                            v_scale=vs)
  got = write_kv(pool, jnp.array(pool), jnp.asarray(k_new), jnp.asarray(v_new),
                 slots, layer=jnp.int32(1), k_scale=ks, v_scale=vs)
  for g, w in zip(got, want):
    assert g.dtype == np.uint8
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  page, off = int(slots[0]) // ps, int(slots[0]) % ps
  as_f32 = lambda x: np.asarray(x).view(F8).astype(np.float32)
  assert list(as_f32(got[0][1, 0, page, off, :4])) == [448.0, -448.0, 448.0, -448.0]
  assert not np.isnan(as_f32(got[0])).any()
  # the stored values stand for x within e4m3's half-ulp (2^-4 relative)
  back = as_f32(got[1][1, :, page, off]) * np.asarray(vs)[:, None]
  np.testing.assert_allclose(back, v_new[0], rtol=2 ** -4, atol=float(vs.max()) * 2 ** -9)


def test_fp8_pools_need_scales_and_float_pools_refuse_them():
  rng = np.random.default_rng(0)
  b, ks, vs = fp8_batch(rng, [1], [5])
  args = b.args()
  with pytest.raises(ValueError, match="needs k_scale"):
    ragged_paged_attention(*args, sm_scale=0.1, backend="xla")
  with pytest.raises(ValueError, match=r"float32 \[2\]"):
    ragged_paged_attention(*args, sm_scale=0.1, backend="xla",
                           k_scale=jnp.ones((3,), jnp.float32),
                           v_scale=jnp.ones((2,), jnp.float32))
  f = make_batch(rng, [1], [5])
  with pytest.raises(ValueError, match="for an fp8"):
    ragged_paged_attention(*f.args(), sm_scale=0.1, backend="xla",
                           k_scale=jnp.asarray(ks), v_scale=jnp.asarray(vs))
  pool = jnp.zeros((2, 4, 8, 64), jnp.uint8)
  new = jnp.zeros((1, 2, 64), jnp.float32)
  with pytest.raises(ValueError, match="needs k_scale"):
    write_kv(pool, pool, new, new, jnp.zeros((1,), jnp.int32))


def test_quantize_rounds_to_nearest_e4m3():
  x = jnp.asarray([[[0.3, -1.7, 500.0, 2.0 ** -10, np.nan]]], jnp.float32)
  got = np.asarray(quantize(x, jnp.ones((1,), jnp.float32))).view(F8).astype(np.float32)
  want = np.asarray([0.3, -1.7, 448.0, 2.0 ** -10, np.nan], np.float32).astype(F8)
  np.testing.assert_array_equal(got[0, 0, :4], want[:4].astype(np.float32))
  assert np.isnan(got[0, 0, 4])


def test_native_cpu_kernel_reads_fp8_pages():
  """The native CPU call itself (not the XLA fallback) over e4m3 bytes: decodes
  and tiled multi-token sequences (head dims 64 and 48), a layer-stacked pool,
  against the oracle on the dequantized pages."""
  from pallas_kernels import cpu_attention
  if jax.default_backend() != "cpu" or not cpu_attention.load_cpu_attention():
    pytest.skip("the native CPU kernel needs a CPU backend and g++")
  rng = np.random.default_rng(5)
  for d, layers in ((64, None), (48, 2)):
    b, ks, vs = fp8_batch(rng, [1, 12, 1, 30], [50, 40, 9, 30], d=d,
                          layers=layers)
    assert cpu_attention.supports(jnp.asarray(b.q), jnp.asarray(b.k_pages))
    got = cpu_attention.ragged_paged_attention_cpu(
        *b.args(), sm_scale=b.sm_scale,
        layer=None if b.layer is None else jnp.int32(b.layer),
        k_scale=jnp.asarray(ks), v_scale=jnp.asarray(vs))
    want = oracle(dequantized(b, ks, vs))
    live = int(b.cu_q_lens[b.num_seqs])
    np.testing.assert_allclose(np.asarray(got)[:live], want[:live], atol=1e-4)
    assert np.all(np.asarray(got)[live:] == 0)
