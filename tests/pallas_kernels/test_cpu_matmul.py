"""The native CPU matmul (cpu_matmul.cc) for decode-sized dots: numerics, shapes it takes, the step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_matmul

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the native kernel is XLA:CPU's")


@pytest.mark.parametrize("m", [17, 23, 30, 32, 61, 128])
@pytest.mark.parametrize("k, n", [(576, 960), (1536, 576), (64, 100), (7, 64), (33, 200), (130, 128), (0, 64)])
def test_matches_a_float64_product(m, k, n):
  """Row counts that split into uneven register tiles, widths with a narrow last column block, depths
  of whole and partial 64-row chunks of w (the accumulators carried in y between chunks), and none."""
  assert cpu_matmul.load_cpu_matmul()
  rng = np.random.default_rng(m * 1000 + n)
  x = rng.standard_normal((m, k), np.float32)
  w = rng.standard_normal((k, n), np.float32)
  got = np.asarray(jax.jit(cpu_matmul.matmul_cpu)(jnp.asarray(x), jnp.asarray(w)))
  want = x.astype(np.float64) @ w.astype(np.float64)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


@pytest.mark.parametrize("shape, dtype, ok", [
    ((17, 8), jnp.float32, True), ((32, 8), jnp.float32, True), ((1, 8), jnp.float32, False),
    ((16, 8), jnp.float32, False), ((128, 8), jnp.float32, True), ((129, 8), jnp.float32, False),
    ((20, 8), jnp.bfloat16, False)])
def test_it_takes_decode_sized_float32_dots_only(shape, dtype, ok):
  x = jnp.zeros(shape, dtype)
  w = jnp.zeros((shape[1], 4), dtype)
  assert cpu_matmul.supports(x, w) == ok
  if not ok:
    with pytest.raises(ValueError, match="native CPU matmul"):
      cpu_matmul.matmul_cpu(x, w)
