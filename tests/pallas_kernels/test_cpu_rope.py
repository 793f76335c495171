"""The native CPU RoPE tables (cpu_rope.cc) against float64 and the XLA reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.models.llama import LlamaConfig, rope_frequencies, rope_tables
from pallas_kernels import cpu_rope

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the native kernel is XLA:CPU's")

# two bases (a windowed model's local and global RoPE), positions up to a 128k context
INV_FREQ = np.stack([1.0 / (base ** (np.arange(0, 64, 2) / 64)) for base in (1e4, 5e5)]).astype(np.float32)
POSITIONS = np.array([0, 1, 2, 7, 100, 1023, 4096, 8191, 65535, 131071], np.int32)


def native(positions, inv_freq):
  return [np.asarray(x) for x in jax.jit(cpu_rope.rope_tables_cpu)(jnp.asarray(positions), jnp.asarray(inv_freq))]


def test_tables_are_the_rounded_float64_cosines_of_the_float32_angles():
  cos, sin = native(POSITIONS, INV_FREQ)
  assert cos.shape == sin.shape == (2, len(POSITIONS), 64) and cos.dtype == np.float32
  angle = (POSITIONS.astype(np.float32)[None, :, None] * INV_FREQ[:, None, :]).astype(np.float64)  # f32 product
  np.testing.assert_array_equal(cos[..., :32], np.cos(angle).astype(np.float32))
  np.testing.assert_array_equal(sin[..., :32], np.sin(angle).astype(np.float32))
  np.testing.assert_array_equal(cos[..., 32:], cos[..., :32])  # rotate-half layout: the halves repeat
  np.testing.assert_array_equal(sin[..., 32:], sin[..., :32])


def test_matches_the_xla_reference_and_the_model_tables():
  got = native(POSITIONS, INV_FREQ)
  want = jax.jit(cpu_rope.reference_rope_tables)(jnp.asarray(POSITIONS), jnp.asarray(INV_FREQ))
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, np.asarray(w), rtol=0, atol=2e-6)
  config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                       num_attention_heads=1, num_key_value_heads=1, head_dim=64, sliding_window=32,
                       layer_windowed=(True, False, True), local_rope_theta=1e4, rope_theta=5e5)
  freqs = rope_frequencies(config)
  assert freqs.shape == (2, 32)
  for g, w in zip(native(POSITIONS, freqs), rope_tables(config, jnp.asarray(POSITIONS))):
    np.testing.assert_allclose(g, np.asarray(w), rtol=0, atol=2e-6)


def test_rejects_bad_shapes():
  with pytest.raises(ValueError, match="positions"):
    cpu_rope.rope_tables_cpu(jnp.zeros((2, 3), jnp.int32), jnp.asarray(INV_FREQ))
  with pytest.raises(ValueError, match="inv_freq"):
    cpu_rope.rope_tables_cpu(jnp.asarray(POSITIONS), jnp.asarray(INV_FREQ[0]))
