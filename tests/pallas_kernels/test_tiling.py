"""Planning and tiling shared by the kernels (pallas_kernels/tiling.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.tiling import choose_config
from pallas_kernels.tiling import gather_q_tiles
from pallas_kernels.tiling import KernelConfig, plan_kernel_calls
from pallas_kernels.tiling import scatter_tiles_to_tokens
from pallas_kernels.tiling import tile_schedule


def test_tile_lookup_has_no_loop():
  """The tile schedule and the scatter back to tokens run without a while
  loop: XLA:GPU syncs with the host at each iteration of one (a binary
  searchsorted cost ~0.3 ms a call on an H200, docs/kernels.md)."""
  cu = jnp.array([0, 1, 9, 10, 10], jnp.int32)
  kv_lens = jnp.array([5, 30, 7, 0], jnp.int32)

  def lookup(cu, kv_lens):
    sched = tile_schedule(cu, kv_lens, 3, block_q=4, num_tiles=5)
    o_tiles = jnp.ones((5, 4, 2, 8), jnp.float32)
    return scatter_tiles_to_tokens(o_tiles, cu, 3, sched, 12)

  text = jax.jit(lookup).lower(cu, kv_lens).as_text()
  assert "while" not in text and "stablehlo.case" not in text
  out = np.asarray(jax.jit(lookup)(cu, kv_lens))
  assert np.all(out[:10] == 1) and np.all(out[10:] == 0)


@pytest.mark.parametrize("kind, d, itemsize, page_size, want", [
    # decode tiles: 32-key blocks, as many stages as 48 KiB of K/V holds (<=4)
    ("decode", 128, 2, 16, (2, 4)),
    ("decode", 64, 2, 16, (2, 4)),
    ("decode", 128, 2, 32, (1, 4)),
    ("decode", 128, 4, 16, (2, 2)),     # f32: 32 KiB a block, one ahead
    ("decode", 128, 2, 64, (1, 2)),     # a page is already 64 keys
    # prefill tiles (128 rows): 64-key blocks, 3 stages if Q and 3 K/V
    # buffers fit in 160 KiB
    ("prefill", 128, 2, 16, (4, 3)),    # 32 KiB + 3 x 32 KiB
    ("prefill", 64, 2, 32, (2, 3)),
    ("prefill", 128, 4, 16, (4, 2)),    # f32: 64 KiB + 3 x 64 KiB
])
def test_choose_config_blocks_and_stages(kind, d, itemsize, page_size, want):
  t, s = (64, 64) if kind == "decode" else (512, 4)
  cfg = choose_config(t, s, 4, page_size, 128, 8, head_dim=d,
                      itemsize=itemsize)
  assert (cfg.pages_per_block, cfg.num_stages) == want
  assert cfg.rows == (16 if kind == "decode" else 128)
  override = choose_config(t, s, 4, page_size, 128, 8, head_dim=d,
                           itemsize=itemsize, pages_per_block=8,
                           num_stages=3)
  assert (override.pages_per_block, override.num_stages) == (8, 3)


def test_one_token_tiles_move_q_and_o_without_a_gather():
  """With one-token tiles and as many tiles as tokens, tile t is token t: the
  q/o moves are reshapes, and equal the general gathers exactly (ragged
  lengths, empty sequences, padding tokens and slots)."""
  rng = np.random.default_rng(3)
  q = jnp.asarray(rng.normal(size=(12, 4, 8)), jnp.float32)
  cu = jnp.array([0, 3, 3, 4, 9, 9], jnp.int32)       # 9 live tokens, 3 padding
  kv_lens = jnp.array([5, 0, 7, 40, 3], jnp.int32)
  fast = tile_schedule(cu, kv_lens, 4, block_q=1, num_tiles=12, num_tokens=12)
  slow = tile_schedule(cu, kv_lens, 4, block_q=1, num_tiles=12)
  assert fast.tiles_are_tokens and not slow.tiles_are_tokens
  assert not tile_schedule(cu, kv_lens, 4, block_q=1, num_tiles=12,
                           num_tokens=12,
                           include=jnp.ones(5, bool)).tiles_are_tokens
  assert np.array_equal(fast.q_start[:9], np.arange(9))
  np.testing.assert_array_equal(gather_q_tiles(q, fast, 1),
                                gather_q_tiles(q, slow, 1))
  o_tiles = jnp.asarray(rng.normal(size=(12, 1, 4, 8)), jnp.float32)
  out = scatter_tiles_to_tokens(o_tiles, cu, 4, fast, 12)
  np.testing.assert_array_equal(out, scatter_tiles_to_tokens(o_tiles, cu, 4,
                                                             slow, 12))
  assert np.all(np.asarray(out[9:]) == 0)
  text = jax.jit(lambda q: gather_q_tiles(q, fast, 1)).lower(q).as_text()
  assert "gather" not in text


@pytest.mark.parametrize("backend", ["pallas", "xla"])
def test_plan_kernel_calls_splits_mixed_batches(backend):
  """One call for decode-like batches; a mixed batch's decode call has a
  tile a slot and its prefill call tiles for max_num_partial_prefills."""
  plan = lambda t, s, **kw: plan_kernel_calls(
      t, s, 4, 16, 64, 8, head_dim=128, itemsize=2, backend=backend, **kw)
  one, = plan(64, 64)
  assert one.num_tiles == 64
  decode, prefill = plan(300, 64, max_num_partial_prefills=4)
  assert decode.num_tiles == 64
  bq = prefill.cfg.block_q
  assert prefill.num_tiles == (300 + 4 * (bq - 1)) // bq
  assert plan(300, 64)[1].num_tiles == min(300, (300 + 64 * (bq - 1)) // bq)
  assert len(plan(300, 64, block_q=8)) == 1


def test_xla_tiling_is_one_token_decode_tiles_and_cpu_blocks():
  """The XLA path's tiles: one-token decode tiles with 64-key blocks,
  16-token prefill tiles with 64-key blocks, no wider than the table, and
  no Triton settings."""
  plan = lambda t, s, p, **kw: plan_kernel_calls(
      t, s, 3, 16, p, 3, head_dim=64, itemsize=4, backend="xla", **kw)
  decode, prefill = plan(128, 64, 32)
  assert (decode.cfg.block_q, decode.cfg.pages_per_block) == (1, 4)
  assert (prefill.cfg.block_q, prefill.cfg.pages_per_block) == (16, 4)
  assert decode.cfg.num_warps is None and prefill.cfg.num_splits == 1
  assert plan(8, 8, 2)[0].cfg.pages_per_block == 2      # clamped to P
  assert plan(8, 8, 32, pages_per_block=5)[0].cfg.pages_per_block == 5
  with pytest.raises(ValueError, match="backend"):
    plan_kernel_calls(8, 8, 3, 16, 4, 3, head_dim=64, itemsize=4,
                      backend="cuda")


def test_xla_small_steps_attend_multi_token_sequences_a_tile_at_a_time():
  """Steps of 2..16 tokens: a lockstep one-token decode call and a call for
  the (at most T // 2) multi-token sequences in next_pow2(T)-token tiles,
  one tile an iteration; 1 token or more than 16: as before."""
  plan = lambda t, s, **kw: plan_kernel_calls(
      t, s, 3, 16, 32, 3, head_dim=64, itemsize=4, backend="xla", **kw)
  decode, multi = plan(4, 4)                   # a 4-token verification
  assert (decode.cfg.block_q, decode.num_tiles, decode.cfg.tile_chunk) == (
      1, 4, None)
  assert (multi.cfg.block_q, multi.num_tiles, multi.cfg.tile_chunk) == (
      4, 2, 1)
  decode, multi = plan(12, 4, max_num_partial_prefills=2)   # T > S
  assert (decode.num_tiles, multi.cfg.block_q, multi.num_tiles) == (4, 16, 2)
  assert plan(16, 32)[1].num_tiles == 8        # 8 sequences of 2 tokens
  one, = plan(1, 1)
  assert (one.cfg.block_q, one.cfg.tile_chunk) == (1, None)
  one, = plan(32, 32)
  assert one.cfg.tile_chunk is None
  assert all(c.cfg.tile_chunk is None for c in plan(300, 64))
  assert len(plan(8, 8, block_q=2)) == 1
  with pytest.raises(ValueError, match="tile_chunk"):
    KernelConfig(1, 3, 4, tile_chunk=0)
