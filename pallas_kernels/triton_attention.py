"""Ragged paged attention as a Pallas kernel for GPUs (Triton lowering).

Runs under `interpret=True` on the CPU for tests. Shapes as in `tiling.py`,
and: R rows of a tile = bq * G padded to a power of two (>= 16); NS KV splits
(flash-decoding); the pool is viewed as rows [L*KVH*N*ps, D], one row per
token slot. The algorithm and its measurements: docs/kernels.md. An fp8 pool's
K/V blocks are widened to q's dtype as they are loaded (half the bytes read of
a bf16 pool), the head's k_scale folded into the scores' scale and its v_scale
into the normalised output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.kv_quant import as_fp8
from pallas_kernels.tiling import (MASK_VALUE, effective_window,
                                   f32_precision, gather_q_tiles,
                                   plan_kernel_calls, run_planned_calls,
                                   scatter_tiles_to_tokens, tile_schedule)


def ragged_paged_attention_pallas(q, k_pages, v_pages, kv_lens, page_table,
                                  cu_q_lens, num_seqs, *, sm_scale,
                                  layer=None, sliding_window=None,
                                  k_scale=None, v_scale=None,
                                  interpret=False, block_q=None,
                                  pages_per_block=None, num_splits=None,
                                  num_warps=None, num_stages=None,
                                  max_num_partial_prefills=None):
  """Same contract as `ragged_paged_attention` (un-jitted); raises
  ValueError for shapes the Triton kernel cannot tile."""
  return _ragged_paged_attention_pallas(
      q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, num_seqs,
      sm_scale=sm_scale, layer=layer, sliding_window=sliding_window,
      k_scale=k_scale, v_scale=v_scale,
      interpret=interpret, block_q=block_q, pages_per_block=pages_per_block,
      num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
      max_num_partial_prefills=max_num_partial_prefills, poison_output=False)


def _ragged_paged_attention_pallas(q, k_pages, v_pages, kv_lens, page_table,
                                   cu_q_lens, num_seqs, *, sm_scale, layer,
                                   sliding_window, interpret, block_q,
                                   k_scale=None, v_scale=None,
                                   pages_per_block, num_splits, num_warps,
                                   num_stages, max_num_partial_prefills,
                                   poison_output):
  """poison_output (tests only): the kernel's output buffers start NaN, so
  any element it fails to write shows up."""
  t, hq, d = q.shape
  kvh, _, ps, _ = k_pages.shape[-4:]
  s, p = page_table.shape
  calls = plan_kernel_calls(
      t, s, hq // kvh, ps, p, kvh, head_dim=d, itemsize=q.dtype.itemsize,
      block_q=block_q, pages_per_block=pages_per_block,
      num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
      max_num_partial_prefills=max_num_partial_prefills)
  for call in calls:
    _check_pallas_shapes(d, ps, call.cfg, k_pages.size // d)
  run = functools.partial(
      _pallas_forward, q, k_pages, v_pages, kv_lens, page_table, cu_q_lens,
      num_seqs, sm_scale=sm_scale, layer=layer, sliding_window=sliding_window,
      kv_scales=None if k_scale is None else jnp.stack([k_scale, v_scale]),
      interpret=interpret, poison_output=poison_output)
  return run_planned_calls(run, calls, cu_q_lens, num_seqs, t)


def _check_pallas_shapes(head_dim, page_size, cfg, pool_rows):
  """Triton needs power-of-two blocks and >= 16 wide dot operands; the
  kernel indexes the pool's token slots (rows) with int32."""
  if pool_rows >= 2**31:
    raise ValueError(f"pallas backend: the pool has {pool_rows} token slots "
                     "(layers x kv heads x pages x page_size), more than "
                     "int32 row indices reach.")
  if head_dim < 16 or head_dim & (head_dim - 1):
    raise ValueError(f"pallas backend needs a power-of-two head_dim >= 16, "
                     f"got head_dim={head_dim}; use backend='xla'.")
  if page_size & (page_size - 1):
    raise ValueError(f"pallas backend needs a power-of-two page_size, got "
                     f"page_size={page_size}.")
  block_k = cfg.pages_per_block * page_size
  if block_k < 16 or block_k & (block_k - 1):
    raise ValueError(f"pages_per_block * page_size = {block_k} must be a "
                     "power of two >= 16.")


def _pallas_forward(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens,
                    num_seqs, *, sm_scale, layer, sliding_window, kv_scales,
                    cfg, num_tiles, interpret, poison_output, include=None):
  """One planned call: tiles the sequences `include` marks (all if None), at
  most num_tiles tiles, runs the kernel, scatters tiles back to tokens.
  kv_scales: an fp8 pool's f32 [2, KVH] (k_scale, v_scale), else None."""
  t, hq, d = q.shape
  kvh, n, ps, _ = k_pages.shape[-4:]
  p = page_table.shape[1]
  g, bq, nt = hq // kvh, cfg.block_q, num_tiles
  sched = tile_schedule(cu_q_lens, kv_lens, num_seqs, block_q=bq,
                        num_tiles=nt, include=include, num_tokens=t)
  qt = gather_q_tiles(q, sched, bq).reshape(nt, bq, kvh, g, d)
  qt = qt.transpose(2, 0, 1, 3, 4).reshape(kvh, nt, bq * g, d)
  qt = jnp.pad(qt, ((0, 0), (0, 0), (0, cfg.rows - bq * g), (0, 0)))
  ppb = cfg.pages_per_block   # pad table so every ds(b * ppb, ppb) is in range
  pt = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, -p % ppb)))
  scalars = [jnp.asarray(0 if layer is None else layer, jnp.int32)]
  if sliding_window is not None:
    scalars.append(effective_window(sliding_window))
  o = _pallas_call(
      qt, k_pages.reshape(-1, d), v_pages.reshape(-1, d), pt, sched,
      jnp.stack(scalars), kv_scales, cfg=cfg, sm_scale=sm_scale, group=g,
      page_size=ps,
      num_pages=n, num_kv_heads=kvh, interpret=interpret,
      poison_output=poison_output)
  o = o[:, :, : bq * g].reshape(kvh, nt, bq, g, d)             # [KVH,NT,bq,G,D]
  o = o.transpose(1, 2, 0, 3, 4).reshape(nt, bq, hq, d)
  return scatter_tiles_to_tokens(o, cu_q_lens, num_seqs, sched, t)


def _kernel_precision(dtype, interpret):
  """The kernel's dots. Compiled for the GPU, f32 inputs run as TF32 on the
  tensor cores (~1e-3 error, XLA's default for f32 on GPUs too): an IEEE f32
  dot falls back to FMAs and 3xTF32 needs 255 registers, and both spill at
  D=128 (sm_90 build, tests/pallas_kernels/test_cuda_compile.py). In
  interpret mode f32 is exact; bf16/f16 always use their native MMA."""
  return f32_precision(dtype) if interpret else None


def _pallas_call(q_tiles, k_flat, v_flat, page_table, sched, scalars,
                 kv_scales, *, cfg, sm_scale, group, page_size, num_pages,
                 num_kv_heads, interpret, poison_output):
  """q_tiles [KVH, NT, R, D] -> o [KVH, NT, R, D] (merged over splits).

  k_flat, v_flat [L*KVH*N*ps, D]: the pool, a row per token slot;
  scalars int32 [1] (layer) or [2] (layer, window); kv_scales f32 [2, KVH]
  (an fp8 pool's k and v scales) or None."""
  kvh, nt, rows, d = q_tiles.shape
  ns = cfg.num_splits
  meta = [sched.seq, sched.q_len, sched.pos0, sched.kv_len, scalars,
          page_table]
  if kv_scales is not None:
    meta.append(kv_scales)
  whole = [pl.BlockSpec() for _ in meta]          # whole arrays
  q_spec = pl.BlockSpec((None, None, rows, d), lambda h, i, c: (h, i, 0, 0))
  o_dtype = q_tiles.dtype if ns == 1 else jnp.float32
  out_shape = [jax.ShapeDtypeStruct((ns, kvh, nt, rows, d), o_dtype)]
  out_specs = [pl.BlockSpec((None, None, None, rows, d),
                            lambda h, i, c: (c, h, i, 0, 0))]
  if ns > 1:
    out_shape.append(jax.ShapeDtypeStruct((ns, kvh, nt, rows), jnp.float32))
    out_specs.append(pl.BlockSpec((None, None, None, rows),
                                  lambda h, i, c: (c, h, i, 0)))
  inputs = meta + [q_tiles, k_flat, v_flat]
  in_specs = whole + [q_spec, pl.BlockSpec(), pl.BlockSpec()]
  aliases = {}
  if poison_output:   # outputs start NaN: unwritten rows show
    for j, (shp, spec) in enumerate(zip(out_shape, out_specs)):
      aliases[len(inputs)] = j
      inputs.append(jnp.full(shp.shape, jnp.nan, shp.dtype))
      in_specs.append(spec)
  kernel = functools.partial(
      _rpa_kernel, sm_scale=sm_scale, group=group, block_q=cfg.block_q,
      pages_per_block=cfg.pages_per_block, page_size=page_size,
      num_pages=num_pages, num_kv_heads=num_kv_heads, num_splits=ns,
      num_aliased=len(aliases), windowed=scalars.shape[0] > 1,
      scaled=kv_scales is not None,
      precision=_kernel_precision(q_tiles.dtype, interpret))
  outs = pl.pallas_call(
      kernel, grid=(kvh, nt, ns), in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, input_output_aliases=aliases, interpret=interpret,
      compiler_params=plgpu.CompilerParams(
          num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      name=f"ragged_paged_attention_r{rows}_k{cfg.pages_per_block}_s{ns}",
  )(*inputs)
  if ns == 1:
    return outs[0][0]
  return _merge_splits(outs[0], outs[1]).astype(q_tiles.dtype)


def _merge_splits(o, lse):
  """Flash-decoding merge in f32: o [NS, ..., R, D], lse [NS, ..., R]."""
  w = jnp.exp(lse - lse.max(axis=0, keepdims=True))            # [NS, ..., R]
  num = (w[..., None] * o).sum(axis=0)
  return num / w.sum(axis=0)[..., None]                        # den >= 1


def kv_block_ranges(pos0, q_len, kv_len, window, split, *, block_q, block_k,
                    num_splits):
  """The KV blocks one program (a tile, a split) reads: lo <= mid_lo <=
  mid_hi <= hi (when hi >= lo; an empty split may have hi < lo).

  [mid_lo, mid_hi) need no mask: each key there is live, causal and inside
  the window for every query row of the tile (rows holding no query compute
  finite values that nothing reads). [lo, mid_lo) (the window's lower edge)
  and [mid_hi, hi) (the causal diagonal and the sequence's tail) are masked,
  at most `masked_block_bounds` blocks each. window: None (static, no window)
  or the effective window (tiling.effective_window). Blocks before the first
  query's window are not read; the split shares out the rest."""
  kv_end = jnp.where(q_len > 0, jnp.minimum(kv_len, pos0 + q_len), 0)
  num_blocks = pl.cdiv(kv_end, block_k)      # blocks of the whole sequence
  if window is None:
    per_split = pl.cdiv(num_blocks, num_splits)
    lo = split * per_split
  else:
    first = jnp.maximum(pos0 - window + 1, 0) // block_k
    per_split = pl.cdiv(jnp.maximum(num_blocks - first, 0), num_splits)
    lo = first + split * per_split
  hi = jnp.minimum(num_blocks, lo + per_split)
  top = jnp.maximum(lo, hi)
  mid_lo = lo
  if window is not None:   # from the first block wholly in the last query's
    pos_last = pos0 + q_len - 1   # window
    full_lo = pl.cdiv(jnp.maximum(pos_last - window + 1, 0), block_k)
    mid_lo = jnp.clip(full_lo, lo, top)
  mid_hi = jnp.clip((pos0 + 1) // block_k, mid_lo, top)
  return lo, mid_lo, mid_hi, hi


def masked_block_bounds(block_q, block_k, windowed):
  """Static bounds on the masked blocks of kv_block_ranges: (before, after)
  the unmasked ones. The tile's queries span block_q - 1 positions, so both
  the causal diagonal (after) and the window's lower edge (before) cover at
  most cdiv(block_q + block_k - 2, block_k) blocks. Where the two edges
  cross (a window narrower than the tile), the unmasked range is empty and
  the blocks after it are fewer still (tests/pallas_kernels/
  test_triton_attention.py checks the bounds exhaustively)."""
  diagonal = pl.cdiv(block_q + block_k - 2, block_k)
  return (diagonal if windowed else 0), diagonal


def _rpa_kernel(seq_ref, qlen_ref, pos0_ref, kvlen_ref, scalar_ref, pt_ref,
                *refs, sm_scale, group, block_q, pages_per_block, page_size,
                num_pages, num_kv_heads, num_splits, num_aliased, windowed,
                scaled, precision):
  """One program: KV head h, query tile i, KV split c.

  Inputs after pt_ref: with `scaled` (an fp8 pool) scale_ref [2, KVH] f32
  (k_scale, v_scale), then q_ref [R, D] (row r = token r // G, head r % G of
  the group), k_ref/v_ref [L*KVH*N*ps, D] (whole pool, a row a token slot);
  pt_ref [S, P] page table, scalar_ref [layer] or [layer, window].
  Outputs: o [R, D] (normalised), and with splits lse [R] (f32).
  """
  scale_ref, refs = (refs[0], refs[1:]) if scaled else (None, refs)
  q_ref, k_ref, v_ref, refs = refs[0], refs[1], refs[2], refs[3:]
  o_ref, *lse_ref = refs[num_aliased:]
  h, i, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  if scaled:   # the scores of stored keys take the head's k_scale too
    sm_scale = sm_scale * scale_ref[0, h]
  seq, q_len, pos0, kv_len = seq_ref[i], qlen_ref[i], pos0_ref[i], kvlen_ref[i]
  window = scalar_ref[1] if windowed else None
  rows, d = q_ref.shape
  block_k = pages_per_block * page_size
  row_tok = lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group
  row_pos, row_live = pos0 + row_tok, row_tok < q_len           # [R, 1]
  kv_end = jnp.where(q_len > 0, jnp.minimum(kv_len, pos0 + q_len), 0)
  # The unmasked blocks run in the pipelined loop; the masked ones (at most
  # a static count on each side) one by one, a lax.cond each: out of the
  # loop they are not pipelined and add no buffers.
  lo, mid_lo, mid_hi, hi = kv_block_ranges(
      pos0, q_len, kv_len, window, c, block_q=block_q, block_k=block_k,
      num_splits=num_splits)
  before, after = masked_block_bounds(block_q, block_k, windowed)
  page_base = (scalar_ref[0] * num_kv_heads + h) * num_pages
  last_table_block = pt_ref.shape[1] // pages_per_block - 1

  slot = lax.broadcasted_iota(jnp.int32, (pages_per_block, page_size), 1)

  def key_rows(b):   # [K] pool rows of block b's keys (clamped into the table)
    b = jnp.minimum(b, last_table_block)
    ids = pt_ref[seq, pl.ds(b * pages_per_block, pages_per_block)]  # [ppb]
    return ((page_base + ids)[:, None] * page_size + slot).reshape(block_k)

  def body(b, carry, masked):
    acc, m, l, krows = carry                    # [R,D], [R], [R], [K]
    # The next block's page ids load now, off the K/V loads' critical path.
    krows_next = key_rows(b + 1)
    k, v = k_ref[krows], v_ref[krows]                    # [K, D] each
    if scaled:   # the bytes as e4m3 elements, widened exactly to q's dtype
      k, v = as_fp8(k).astype(q.dtype), as_fp8(v).astype(q.dtype)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * sm_scale
    if masked:
      kpos = b * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
      mask = row_live & (kpos <= row_pos) & (kpos < kv_end)  # [R, K]
      if windowed:
        mask &= kpos > row_pos - window
      s = jnp.where(mask, s, MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    if masked:   # p is 0 past kv_end, but 0 * NaN is NaN: zero V there too,
      p = jnp.where(mask, p, 0.0)   # and before the first query's window
      kpos_col = b * block_k + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
      v_live = kpos_col < kv_end
      if windowed:   # (pages wholly before it may have been freed)
        v_live &= kpos_col > pos0 - window
      v = jnp.where(v_live, v, jnp.zeros((), v.dtype))
    pv = jnp.dot(p.astype(v.dtype), v, precision=precision,
                 preferred_element_type=jnp.float32)
    return (acc * alpha[:, None] + pv, m_new, l * alpha + p.sum(axis=1),
            krows_next)

  def masked_blocks(carry, start, stop, count):
    for j in range(count):
      carry = lax.cond(start + j < stop,
                       functools.partial(body, start + j, masked=True),
                       lambda carry: carry, carry)
    return carry

  q = q_ref[...]
  init = (jnp.zeros((rows, d), jnp.float32),
          jnp.full((rows,), MASK_VALUE, jnp.float32),
          jnp.zeros((rows,), jnp.float32))
  unmasked = functools.partial(body, masked=False)
  if windowed:
    # All masked blocks first (the online softmax takes blocks in any
    # order): after the loop nothing but the accumulators stays live. Held
    # across the loop, the window's values cost a register and a 4th
    # program an SM (sm_90 decode build: 129 registers).
    carry = init + (key_rows(lo),)
    carry = masked_blocks(carry, lo, mid_lo, before)
    carry = carry[:3] + (key_rows(mid_hi),)
    carry = masked_blocks(carry, mid_hi, hi, after)
    carry = carry[:3] + (key_rows(mid_lo),)
    acc, m, l, _ = lax.fori_loop(mid_lo, mid_hi, unmasked, carry)
  else:
    carry = lax.fori_loop(lo, mid_hi, unmasked, init + (key_rows(lo),))
    acc, m, l, _ = masked_blocks(carry, mid_hi, hi, after)
  l_safe = jnp.where(l > 0.0, l, 1.0)
  o = acc / l_safe[:, None]
  if scaled:
    o = o * scale_ref[1, h]
  o_ref[...] = o.astype(o_ref.dtype)
  if lse_ref:
    lse_ref[0][...] = jnp.where(l > 0.0, m + jnp.log(l_safe), MASK_VALUE)
