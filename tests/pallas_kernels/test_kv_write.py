"""write_kv: scatter of new keys/values into the paged pool."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import write_kv, write_kv_inner
from pallas_kernels.kv_write import write_kv_reference


def _case(rng, *, layers=None, kvh=2, n=12, ps=16, d=64, t=9,
          dtype=jnp.float32):
  lead = () if layers is None else (layers,)
  shape = lead + (kvh, n, ps, d)
  kp = jnp.asarray(rng.standard_normal(shape), dtype)
  vp = jnp.asarray(rng.standard_normal(shape), dtype)
  # Distinct real slots outside page 0, plus 3 padding tokens into page 0.
  real = rng.choice(np.arange(ps, n * ps), size=t - 3, replace=False)
  slots = jnp.asarray(np.concatenate([real, [0, 5, 5]]), jnp.int32)
  k_new = jnp.asarray(rng.standard_normal((t, kvh, d)), jnp.float32)
  v_new = jnp.asarray(rng.standard_normal((t, kvh, d)), jnp.float32)
  return kp, vp, k_new, v_new, slots


def _assert_same_outside_page0(got, want, layer=None):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  if layer is not None:
    np.testing.assert_array_equal(np.delete(got, layer, 0),
                                  np.delete(want, layer, 0))
    got, want = got[layer], want[layer]
  np.testing.assert_array_equal(got[:, 1:], want[:, 1:])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_write_kv_matches_reference(dtype):
  rng = np.random.default_rng(0)
  kp, vp, k_new, v_new, slots = _case(rng, dtype=dtype)
  want_k, want_v = write_kv_reference(kp, vp, k_new, v_new, slots)
  got_k, got_v = write_kv(jnp.copy(kp), jnp.copy(vp), k_new, v_new, slots)
  _assert_same_outside_page0(got_k, want_k)
  _assert_same_outside_page0(got_v, want_v)


def test_write_kv_layer_stacked_traced_layer():
  rng = np.random.default_rng(1)
  kp, vp, k_new, v_new, slots = _case(rng, layers=3)
  want_k, want_v = write_kv_reference(kp, vp, k_new, v_new, slots, layer=1)
  got_k, got_v = write_kv(jnp.copy(kp), jnp.copy(vp), k_new, v_new, slots,
                          layer=jnp.int32(1))
  _assert_same_outside_page0(got_k, want_k, layer=1)
  _assert_same_outside_page0(got_v, want_v, layer=1)


def test_write_kv_donates_pool():
  rng = np.random.default_rng(2)
  kp, vp, k_new, v_new, slots = _case(rng)
  kp, vp = jnp.copy(kp), jnp.copy(vp)
  out_k, _ = write_kv(kp, vp, k_new, v_new, slots)
  out_k.block_until_ready()
  if jax.default_backend() == "cpu" and not kp.is_deleted():
    pytest.skip("buffer donation not honoured by this CPU runtime")
  assert kp.is_deleted() and vp.is_deleted()


def test_write_kv_inner_inside_scan_over_layers():
  """The engine pattern: stacked pool as scan carry, layer = loop index."""
  rng = np.random.default_rng(3)
  kp, vp, k_new, v_new, slots = _case(rng, layers=2)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(kp, vp):
    def body(carry, layer):
      k, v = write_kv_inner(*carry, k_new * (layer + 1), v_new, slots,
                            layer=layer)
      return (k, v), None
    return jax.lax.scan(body, (kp, vp), jnp.arange(2, dtype=jnp.int32))[0]

  want_k, _ = write_kv_reference(kp, vp, k_new, v_new, slots, layer=0)
  want_k, _ = write_kv_reference(want_k, vp, k_new * 2, v_new, slots, layer=1)
  got_k, _ = step(jnp.copy(kp), jnp.copy(vp))
  for layer in range(2):
    _assert_same_outside_page0(got_k[layer], want_k[layer])


def test_write_kv_validation():
  rng = np.random.default_rng(4)
  kp, vp, k_new, v_new, slots = _case(rng)
  with pytest.raises(ValueError, match="k_new"):
    write_kv_inner(kp, vp, k_new[:, :1], v_new, slots)
  with pytest.raises(ValueError, match="slot_mapping"):
    write_kv_inner(kp, vp, k_new, v_new, slots[:-1])
  with pytest.raises(ValueError, match="layer"):
    write_kv_inner(kp, vp, k_new, v_new, slots, layer=0)
  with pytest.raises(ValueError, match="v_pages"):
    write_kv_inner(kp, vp[:1], k_new, v_new, slots)


@pytest.mark.parametrize("layers", [None, 4])
def test_write_kv_lowers_for_cuda(layers):
  sds = jax.ShapeDtypeStruct
  lead = () if layers is None else (layers,)
  pool = sds(lead + (8, 256, 16, 128), jnp.bfloat16)
  new = sds((64, 8, 128), jnp.bfloat16)
  kw = {} if layers is None else {"layer": sds((), jnp.int32)}
  lowered = write_kv.trace(pool, pool, new, new, sds((64,), jnp.int32),
                           **kw).lower(lowering_platforms=("cuda",))
  assert "scatter" in lowered.as_text()
