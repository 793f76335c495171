"""The Triton kernel's block arithmetic, checked exhaustively on small
shapes (the kernel's numerics are in test_ragged_paged_attention.py)."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.tiling import NO_WINDOW
from pallas_kernels.triton_attention import kv_block_ranges
from pallas_kernels.triton_attention import masked_block_bounds


def _grid(block_k, max_pos=80):
  """Every (pos0, q_len, extra, window) with positions below max_pos:
  kv_len = pos0 + q_len + extra (a middle tile of a chunk has extra > 0)."""
  pos0, q_len, extra, window = np.meshgrid(
      np.arange(max_pos), np.arange(0, 40), np.array([0, 1, block_k + 3]),
      np.array([1, 2, 3, 5, 15, 16, 17, 31, 32, 33, 47, 64, 65, 100, 0]),
      indexing="ij")
  return [x.ravel().astype(np.int32) for x in (pos0, q_len, extra, window)]


@pytest.mark.parametrize("block_q,block_k,num_splits", [
    (1, 16, 1), (1, 32, 4), (5, 16, 1), (8, 32, 3), (32, 64, 1),
    (32, 16, 2), (16, 16, 1),
])
def test_kv_block_ranges_cover_exactly_the_window(block_q, block_k,
                                                  num_splits):
  """For every tile shape and window: the splits' blocks are disjoint and
  cover exactly the blocks holding a key some live query sees (no block
  wholly before the first query's window is read); the unmasked blocks hold
  only keys every live query sees; the masked ones fit the static bounds."""
  pos0, q_len, extra, window = _grid(block_k)
  q_len = np.minimum(q_len, block_q)
  kv_len = pos0 + q_len + extra
  eff = np.where(window > 0, window, NO_WINDOW)
  before, after = masked_block_bounds(block_q, block_k, windowed=True)
  pos_last = pos0 + q_len - 1
  want_lo = np.maximum(pos0 - eff + 1, 0) // block_k
  want_hi = np.where(q_len > 0, -(-(pos_last + 1) // block_k), 0)
  covered = np.zeros((pos0.size,), np.int64)
  prev_hi = want_lo
  for split in range(num_splits):
    lo, mid_lo, mid_hi, hi = (np.asarray(x) for x in kv_block_ranges(
        jnp.asarray(pos0), jnp.asarray(q_len), jnp.asarray(kv_len),
        jnp.asarray(eff), split, block_q=block_q, block_k=block_k,
        num_splits=num_splits))
    n = np.maximum(hi - lo, 0)
    busy = n > 0
    # consecutive, disjoint, in order
    assert np.all(~busy | (lo == prev_hi)), "splits leave a gap or overlap"
    prev_hi = np.where(busy, hi, prev_hi)
    covered += n
    assert np.all(~busy | ((lo <= mid_lo) & (mid_lo <= mid_hi)
                           & (mid_hi <= hi)))
    assert np.all(~busy | (mid_lo - lo <= before)), "head bound exceeded"
    assert np.all(~busy | (hi - mid_hi <= after)), "tail bound exceeded"
    # unmasked blocks: first key inside the last query's window, last key
    # at or before the first query (so live and causal for every row)
    unmasked = busy & (mid_hi > mid_lo)
    assert np.all(~unmasked | (mid_lo * block_k > pos_last - eff))
    assert np.all(~unmasked | (mid_hi * block_k <= pos0 + 1))
  live = q_len > 0
  assert np.all(~live | (covered == want_hi - want_lo))
  assert np.all(~live | (prev_hi == want_hi))
  assert np.all(live | (covered == 0))


@pytest.mark.parametrize("block_q,block_k", [(1, 16), (8, 32), (128, 64)])
def test_unwindowed_ranges_and_bounds_are_unchanged(block_q, block_k):
  """Without a window the kernel keeps its one-loop-plus-diagonal shape: no
  masked blocks before the loop, the diagonal's bound after it."""
  assert masked_block_bounds(block_q, block_k, windowed=False) == (
      0, -(-(block_q + block_k - 2) // block_k))
  for pos0, q_len, kv_len in itertools.product([0, 5, 40, 200], [1, block_q],
                                               [300]):
    lo, mid_lo, mid_hi, _ = kv_block_ranges(
        pos0, q_len, kv_len, None, 0, block_q=block_q, block_k=block_k,
        num_splits=1)
    assert int(lo) == int(mid_lo) == 0
    assert int(mid_hi) == (pos0 + 1) // block_k
