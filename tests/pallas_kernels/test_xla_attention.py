"""The XLA path's block loop (its numerics are checked against the oracle in
test_ragged_paged_attention.py)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.tiling import effective_window, tile_schedule
from pallas_kernels.xla_attention import _scores, tile_blocks


def _schedule(q_lens, kv_lens, block_q):
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
  kv = jnp.asarray(kv_lens, jnp.int32)
  return tile_schedule(cu, kv, len(q_lens), block_q=block_q,
                       num_tiles=sum(-(-q // block_q) for q in q_lens))


def _tiles(sched):
  return sched.pos0, sched.q_len, sched.kv_len


def test_windowed_loop_follows_the_window_not_the_context():
  """Decodes at context 10000 with a 100-key window read 2-3 blocks of 64
  keys, from the block holding key 9900 on; without a window, all 157."""
  sched = _schedule([1, 1, 1], [10_000, 9_950, 30], block_q=1)
  first, n = tile_blocks(*_tiles(sched), effective_window(100), 64)
  assert list(np.asarray(first)) == [9900 // 64, 9850 // 64, 0]
  assert int(n) == 3   # 9850 // 64 = 153 .. 155 (key 9949)
  first, n = tile_blocks(*_tiles(sched), None, 64)
  assert first == 0 and int(n) == -(-10_000 // 64)
  _, n = tile_blocks(*_tiles(sched), effective_window(0), 64)   # <= 0: no window
  assert int(n) == -(-10_000 // 64)


def test_windowed_prefill_tiles_start_at_their_own_window():
  """A 256-token chunk over a 1000-token prefix in tiles of 16, a 128-key
  window: each tile reads from the block of its first query's window to its
  last query, 3 blocks of 128 at most (to the chunk's end it would be 4)."""
  sched = _schedule([256], [1256], block_q=16)
  first, n = tile_blocks(*_tiles(sched), effective_window(128), 128)
  want = [(1000 + 16 * i - 127) // 128 for i in range(16)]
  assert list(np.asarray(first)) == want
  ends = [-(-(1000 + 16 * (i + 1)) // 128) for i in range(16)]  # last query
  assert int(n) == max(e - f for e, f in zip(ends, want)) == 3


def test_scores_take_either_operand_order_to_the_same_result():
  """One-token tiles run the score dot as K @ q, taller tiles as q @ K^T:
  both give q . k for every (tile, head, group row, query, key)."""
  rng = np.random.default_rng(0)
  k = jnp.asarray(rng.standard_normal((5, 2, 32, 16)), jnp.float32)
  for bq in (1, 4):
    qt = jnp.asarray(rng.standard_normal((5, 2, 3, bq, 16)), jnp.float32)
    want = np.einsum("nhgud,nhkd->nhguk", np.asarray(qt, np.float64),
                     np.asarray(k, np.float64))
    got = _scores(k, qt, lax.Precision.HIGHEST)
    assert got.shape == (5, 2, 3, bq, 32)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-4)
