"""Ragged paged attention as blocked plain JAX ("xla"): the CPU fallback of the native kernel.

Shapes as in `tiling.py`; bq query tokens per tile, K = ppb * ps keys a
block. The batch is cut into the same tiles as the Triton kernel's, planned
by the same `plan_kernel_calls` (with the XLA path's tile sizes). A call's
tiles advance together through an online softmax over blocks of pages: a
loop of ceil(longest live context / K) iterations, so the work and the
gathered K/V follow the batch's real context, not the page table's static
width P. With a sliding window, each tile starts at the first block of its
window, and the loop runs over the widest window's blocks instead. A call
planned with `tile_chunk` (small steps' multi-token sequences) runs its live
tiles that many at a time instead, each chunk over its own blocks. An fp8
pool's blocks (gathered as bytes, then read as e4m3) are widened to q's dtype (exact: every e4m3 value is a bf16, f16
and f32 value) and the scales applied per KV head to the scores (k_scale) and
to the normalised output (v_scale), not to each element.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from pallas_kernels.kv_quant import as_fp8
from pallas_kernels.tiling import (MASK_VALUE, effective_window,
                                   f32_precision, flat_page_ids,
                                   gather_q_tiles, plan_kernel_calls,
                                   run_planned_calls, scatter_tiles_to_tokens,
                                   tile_schedule)


def ragged_paged_attention_xla(q, k_pages, v_pages, kv_lens, page_table,
                               cu_q_lens, num_seqs, *, sm_scale, layer=None,
                               sliding_window=None, k_scale=None,
                               v_scale=None, block_q=None,
                               pages_per_block=None,
                               max_num_partial_prefills=None):
  """Same contract as `ragged_paged_attention` (un-jitted, unvalidated).

  sliding_window: None (static: no window) or an int32 scalar, traced ok;
  <= 0 is no window. k_scale, v_scale: f32 [KVH], an fp8 pool's scales
  (None for a float pool). block_q, pages_per_block: tiling overrides;
  max_num_partial_prefills: the promise of `ragged_paged_attention`."""
  t, hq, d = q.shape
  kvh, _, ps, _ = k_pages.shape[-4:]
  s, p = page_table.shape
  calls = plan_kernel_calls(
      t, s, hq // kvh, ps, p, kvh, head_dim=d, itemsize=q.dtype.itemsize,
      block_q=block_q, pages_per_block=pages_per_block,
      max_num_partial_prefills=max_num_partial_prefills, backend="xla")
  run = functools.partial(
      _xla_forward, q, k_pages, v_pages, kv_lens, page_table, cu_q_lens,
      num_seqs, sm_scale=sm_scale, layer=layer, sliding_window=sliding_window,
      scales=None if k_scale is None else (k_scale, v_scale))
  return run_planned_calls(run, calls, cu_q_lens, num_seqs, t)


def tile_blocks(pos0, q_len, kv_len, window, block_k):
  """(first block of each tile [NT] or 0, loop length) for tiles given by
  their first query's position, live queries and context ([NT] each): tile
  i reads blocks first[i] .. first[i] + loop length - 1, which cover its keys
  up to its last query from the first block holding a key in its first
  query's window (block 0 without a window); blocks past its end are
  masked."""
  live_tile = q_len > 0
  tile_end = jnp.where(live_tile, jnp.minimum(kv_len, pos0 + q_len), 0)
  if window is None:
    first_block = 0
  else:
    first_block = jnp.maximum(pos0 - window + 1, 0) // block_k  # [NT]
  last_block = (tile_end + block_k - 1) // block_k             # [NT]
  num_blocks = jnp.max(jnp.where(live_tile, last_block - first_block, 0))
  return first_block, num_blocks


def _scores(k, qt, precision):
  """k [NT, KVH, K, D], qt [NT, KVH, G, bq, D] -> f32 scores [NT, KVH, G, bq, K].

  The dot's operand order is XLA:CPU's fastest for the tile: one-token
  (decode) tiles as K @ q, K the lhs read as gathered (q @ K^T: ~1.4x the
  time at SmolLM2's G = 3 rows); taller tiles as q @ K^T (K @ q: ~1.15x)."""
  if qt.shape[3] == 1:
    s = jnp.einsum("nhkd,nhgud->nhkgu", k, qt, precision=precision,
                   preferred_element_type=jnp.float32)
    return jnp.moveaxis(s, 2, -1)
  return jnp.einsum("nhgud,nhkd->nhguk", qt, k, precision=precision,
                    preferred_element_type=jnp.float32)


def _xla_forward(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens,
                 num_seqs, *, sm_scale, layer, sliding_window, scales, cfg,
                 num_tiles, include=None):
  """One planned call: the tiles of the sequences `include` marks (all if
  None), at most num_tiles of them -> [T, Hq, D]. scales: an fp8 pool's
  (k_scale, v_scale) f32 [KVH] each, or None."""
  t, hq, d = q.shape
  kvh = k_pages.shape[-4]
  p = page_table.shape[1]
  g, bq, nt = hq // kvh, cfg.block_q, num_tiles
  sched = tile_schedule(cu_q_lens, kv_lens, num_seqs, block_q=bq,
                        num_tiles=nt, include=include, num_tokens=t)
  # [NT, KVH, G, bq, D]: tile and head leading, as the gathered K/V blocks,
  # so both dots batch over (tile, head) with no transposed copy of a block.
  qt = gather_q_tiles(q, sched, bq).reshape(nt, bq, kvh, g, d)
  qt = qt.transpose(0, 2, 3, 1, 4)
  pt = jnp.pad(page_table, ((0, 0), (0, -p % cfg.pages_per_block)))  # [S,Pp]
  window = (None if sliding_window is None
            else effective_window(sliding_window))
  attend = functools.partial(_attend_tiles, k_pages, v_pages, pt,
                             sm_scale=sm_scale, layer=layer, window=window,
                             pages_per_block=cfg.pages_per_block,
                             scales=scales)
  tiles = (qt, sched.seq, sched.pos0, sched.q_len, sched.kv_len)
  if cfg.tile_chunk is None or cfg.tile_chunk >= nt:
    o = attend(*tiles)                                          # lockstep
  else:
    o = _attend_in_chunks(attend, tiles, cfg.tile_chunk)
  o = o.transpose(0, 3, 1, 2, 4).reshape(nt, bq, hq, d).astype(q.dtype)
  return scatter_tiles_to_tokens(o, cu_q_lens, num_seqs, sched, t)


def _attend_in_chunks(attend, tiles, chunk):
  """`attend` over the live tiles (a prefix of the schedule), `chunk` tiles
  an iteration of a loop of ceil(live tiles / chunk): each chunk runs over
  its own blocks only, and idle tiles cost nothing. tiles: (qt, seq, pos0,
  q_len, kv_len), [NT, ...] each -> f32 [NT, KVH, G, bq, D]."""
  nt = tiles[0].shape[0]
  padded = [jnp.pad(x, [(0, -nt % chunk)] + [(0, 0)] * (x.ndim - 1))
            for x in tiles]                    # padding tiles: q_len 0
  num_live = jnp.sum(tiles[3] > 0)

  def body(i, out):
    part = [lax.dynamic_slice_in_dim(x, i * chunk, chunk) for x in padded]
    return lax.dynamic_update_slice_in_dim(out, attend(*part), i * chunk, 0)

  out = jnp.zeros(padded[0].shape, jnp.float32)
  out = lax.fori_loop(0, (num_live + chunk - 1) // chunk, body, out)
  return out[:nt]


def _attend_tiles(k_pages, v_pages, pt, qt, seq, pos0, q_len, kv_len, *,
                  sm_scale, layer, window, pages_per_block, scales=None):
  """Tiles in lockstep: an online softmax over blocks of pages, a loop of
  the tiles' longest span of blocks. qt [C, KVH, G, bq, D]; seq, pos0, q_len,
  kv_len [C] (the tile schedule's); pt [S, Pp] -> f32 [C, KVH, G, bq, D].
  scales: an fp8 pool's (k_scale, v_scale) f32 [KVH], or None."""
  c, kvh, g, bq, d = qt.shape
  n, ps = k_pages.shape[-3:-1]
  ppb = pages_per_block
  block_k = ppb * ps
  pt = pt[seq]                                                  # [C, Pp]
  u = jnp.arange(bq, dtype=jnp.int32)
  qpos = pos0[:, None] + u[None, :]                             # [C, bq]
  q_live = u[None, :] < q_len[:, None]                          # [C, bq]
  first_block, num_blocks = tile_blocks(pos0, q_len, kv_len, window,
                                        block_k)
  hi = f32_precision(qt.dtype)
  # per KV head: the softmax scale times k_scale (the scores of stored keys)
  logit_scale = (jnp.float32(sm_scale) if scales is None
                 else sm_scale * scales[0][None, :, None, None, None])

  def block(j, carry):
    m, l, acc = carry                       # [C,KVH,G,bq], idem, [..., D]
    if window is None:   # every tile at block j: one slice of the table
      ids = lax.dynamic_slice_in_dim(pt, j * ppb, ppb, axis=1)  # [C, ppb]
      kpos = j * block_k + jnp.arange(block_k, dtype=jnp.int32)[None]
    else:                # tile i at its own block first_block[i] + j
      b = first_block + j                                       # [C]
      col = b[:, None] * ppb + jnp.arange(ppb, dtype=jnp.int32)[None]
      ids = jnp.take_along_axis(pt, jnp.minimum(col, pt.shape[1] - 1), 1)
      kpos = b[:, None] * block_k + jnp.arange(block_k, dtype=jnp.int32)
    flat = jnp.moveaxis(flat_page_ids(ids, layer, kvh, n), 0, 1)  # [C,KVH,ppb]
    k = k_pages.reshape(-1, ps, d)[flat].reshape(c, kvh, block_k, d)
    v = v_pages.reshape(-1, ps, d)[flat].reshape(c, kvh, block_k, d)
    if scales is not None:   # fp8 elements, widened exactly
      k, v = as_fp8(k).astype(qt.dtype), as_fp8(v).astype(qt.dtype)
    kv_live = kpos < kv_len[:, None]                            # [C, K]
    if window is not None:   # keys before the tile's first window: not
      kv_live &= kpos > pos0[:, None] - window         # read (V may be NaN)
    mask = q_live[:, :, None] & (kpos[:, None, :] <= qpos[:, :, None])
    if window is not None:
      mask &= kpos[:, None, :] > qpos[:, :, None] - window
    mask = (mask & kv_live[:, None, :])[:, None, None]          # [C,1,1,bq,K]
    logits = _scores(k, qt, hi) * logit_scale                  # [C,KVH,G,bq,K]
    logits = jnp.where(mask, logits, MASK_VALUE)
    m_new = jnp.maximum(m, logits.max(-1))
    probs = jnp.where(mask, jnp.exp(logits - m_new[..., None]), 0.)
    alpha = jnp.exp(m - m_new)
    v = jnp.where(kv_live[:, None, :, None], v, jnp.zeros((), v.dtype))
    pv = jnp.einsum("nhguk,nhkd->nhgud", probs, v.astype(jnp.float32),
                    precision=hi)
    return m_new, l * alpha + probs.sum(-1), acc * alpha[..., None] + pv

  init = (jnp.full((c, kvh, g, bq), MASK_VALUE, jnp.float32),
          jnp.zeros((c, kvh, g, bq), jnp.float32),
          jnp.zeros((c, kvh, g, bq, d), jnp.float32))
  _, l, acc = lax.fori_loop(0, num_blocks, block, init)
  out = acc / jnp.where(l > 0, l, 1.)[..., None]                # [C,KVH,G,bq,D]
  if scales is not None:
    out = out * scales[1][None, :, None, None, None]
  return out
