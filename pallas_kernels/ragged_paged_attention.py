"""Ragged paged attention: one call for a whole continuous batch.

Letters used in shapes below:
  T   packed query tokens of all sequences (prefill chunks and decodes mixed)
  S   sequence slots (static); slots >= num_seqs are padding
  Hq  query heads; KVH key/value heads; G = Hq // KVH (GQA group)
  D   head dim; N pages in the pool; ps page size; P pages per page-table row
  L   layers of a layer-stacked pool
  NT  query tiles (static upper bound); bq query tokens per tile
  R   rows of a kernel tile = bq * G padded to a power of two (>= 16)
  NS  KV splits (flash-decoding)

KV pool: k_pages, v_pages [KVH, N, ps, D], or [L, KVH, N, ps, D] with a traced
`layer`. Page 0 is the null page (padding slots / padded page-table entries).

Sequence s < num_seqs owns queries cu_q_lens[s]:cu_q_lens[s+1]; they are the
last q_len of its kv_len tokens (bottom-right aligned causal mask). Tokens at
index >= cu_q_lens[num_seqs] are padding and produce exact zeros.

Both backends cut the batch into query tiles: tile = (sequence, bq consecutive
query tokens of it). The tile schedule is computed on device from cu_q_lens, so
the batch layout is fully dynamic while every shape stays static.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Finite "minus infinity": keeps (m_old - m_new) free of inf - inf = NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
           jnp.dtype(jnp.float32))
_BACKENDS = ("auto", "reference", "xla", "pallas")


def _next_pow2(x: int) -> int:
  return 1 if x <= 1 else 1 << (x - 1).bit_length()


# --------------------------------------------------------------------------
# Tile schedule (shared by both backends; plain jnp, runs on device).
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TileSchedule:
  """Per-tile metadata, all int32 [NT] except tile_begin [S]."""
  seq: jax.Array        # sequence slot owning the tile
  q_start: jax.Array    # packed index (into T) of the tile's first query
  q_len: jax.Array      # live queries in the tile (0 = inactive tile)
  pos0: jax.Array       # kv position of the tile's first query
  kv_len: jax.Array     # kv_len of the owning sequence
  tile_begin: jax.Array  # [S] first tile of each sequence
  # Static: tile t is packed token t (one-token tiles of every sequence, as
  # many tiles as tokens), so moving q/o between tiles and tokens needs no
  # gather.
  tiles_are_tokens: bool = False


def _count_at_or_below(sorted_ends, values):
  """searchsorted(side='right') without a loop: one [len(values), S] compare.

  jnp.searchsorted's default binary search is a while loop, which XLA:GPU
  steps from the host (a sync per level: ~0.3 ms a call measured on an H200
  at S=16); S is at most a few hundred here, so comparing all is cheaper."""
  return jnp.searchsorted(sorted_ends, values, side="right",
                          method="compare_all")


def _seq_of_token(cu, num_tokens):
  """[T] sequence slot of each packed token, from clamped cu_q_lens [S+1];
  padding tokens (past the live total) map to the last slot."""
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  return jnp.minimum(_count_at_or_below(cu[1:], t), cu.shape[0] - 2)


def num_tiles_bound(num_tokens: int, num_slots: int, block_q: int) -> int:
  """Static bound on sum_s ceil(q_len_s / bq) given sum_s q_len_s <= T."""
  bound = (num_tokens + num_slots * (block_q - 1)) // block_q
  return max(1, min(num_tokens, bound))


def clamped_cu_q_lens(cu_q_lens, num_seqs):
  """cu_q_lens [S+1] with entries past num_seqs (may hold anything) set to
  the packed total, so every slot past num_seqs has q_len 0."""
  num_seqs = jnp.asarray(num_seqs, jnp.int32)
  s1 = cu_q_lens.shape[0]
  return jnp.where(jnp.arange(s1) <= num_seqs, cu_q_lens, cu_q_lens[num_seqs])


def tile_schedule(cu_q_lens, kv_lens, num_seqs, *, block_q, num_tiles,
                  include=None, num_tokens=None):
  """Maps tiles 0..NT-1 to (sequence, query range); jittable.

  include: optional bool [S]; sequences where it is False get no tiles (their
  queries keep their packed offsets, so the caller fills them elsewhere).
  num_tokens: T, if known; with block_q 1, no include and T tiles, tile t is
  token t (see TileSchedule.tiles_are_tokens).
  """
  s = kv_lens.shape[0]
  cu = clamped_cu_q_lens(cu_q_lens, num_seqs)                 # [S+1]
  q_lens = cu[1:] - cu[:-1]                                   # [S]
  tiles_per_seq = (q_lens + block_q - 1) // block_q           # [S]
  if include is not None:
    tiles_per_seq = jnp.where(include, tiles_per_seq, 0)
  tile_end = jnp.cumsum(tiles_per_seq)                        # [S]
  tile_begin = tile_end - tiles_per_seq                       # [S]
  t = jnp.arange(num_tiles, dtype=jnp.int32)                  # [NT]
  seq = jnp.minimum(
      _count_at_or_below(tile_end, t), s - 1).astype(jnp.int32)
  q_off = (t - tile_begin[seq]) * block_q                     # [NT]
  live = t < tile_end[-1]
  q_len = jnp.where(live, jnp.clip(q_lens[seq] - q_off, 0, block_q), 0)
  return TileSchedule(
      seq=seq,
      q_start=(cu[seq] + q_off).astype(jnp.int32),
      q_len=q_len.astype(jnp.int32),
      pos0=(kv_lens[seq] - q_lens[seq] + q_off).astype(jnp.int32),
      kv_len=kv_lens[seq].astype(jnp.int32),
      tile_begin=tile_begin.astype(jnp.int32),
      tiles_are_tokens=(block_q == 1 and include is None
                        and num_tiles == num_tokens),
  )


def gather_q_tiles(q, sched: TileSchedule, block_q: int):
  """q [T, Hq, D] -> [NT, bq, Hq, D]; dead query slots are zero."""
  if sched.tiles_are_tokens:   # [T, 1, Hq, D]: a reshape, no gather
    return jnp.where((sched.q_len > 0)[:, None, None, None], q[:, None],
                     jnp.zeros((), q.dtype))
  u = jnp.arange(block_q, dtype=jnp.int32)
  tok = sched.q_start[:, None] + u[None, :]                   # [NT, bq]
  live = u[None, :] < sched.q_len[:, None]                    # [NT, bq]
  qt = q[jnp.clip(tok, 0, q.shape[0] - 1)]                    # [NT, bq, Hq, D]
  return jnp.where(live[:, :, None, None], qt, jnp.zeros((), q.dtype))


def scatter_tiles_to_tokens(o_tiles, cu_q_lens, num_seqs, sched, num_tokens):
  """o_tiles [NT, bq, Hq, D] -> out [T, Hq, D]; padding tokens exactly 0."""
  if sched.tiles_are_tokens:   # a reshape, no gather
    return jnp.where((sched.q_len > 0)[:, None, None], o_tiles[:, 0],
                     jnp.zeros((), o_tiles.dtype))
  block_q = o_tiles.shape[1]
  num_seqs = jnp.asarray(num_seqs, jnp.int32)
  cu = clamped_cu_q_lens(cu_q_lens, num_seqs)                 # [S+1]
  t = jnp.arange(num_tokens, dtype=jnp.int32)                 # [T]
  seq = _seq_of_token(cu, num_tokens)
  j = t - cu[seq]                                             # pos in chunk
  tile = jnp.clip(sched.tile_begin[seq] + j // block_q, 0,
                  o_tiles.shape[0] - 1)
  out = o_tiles[tile, jnp.clip(j % block_q, 0, block_q - 1)]  # [T, Hq, D]
  live = t < cu[num_seqs]
  return jnp.where(live[:, None, None], out, jnp.zeros((), out.dtype))


def _f32_precision(dtype):
  """HIGHEST for f32 inputs: GPU dots (XLA's and Triton's) otherwise run f32
  as TF32 (~1e-3 error); None keeps bf16/f16 on their native MMA path."""
  return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def _kernel_precision(dtype, interpret):
  """The kernel's dots. Compiled for the GPU, f32 inputs run as TF32 on the
  tensor cores (~1e-3 error, XLA's default for f32 on GPUs too): an IEEE f32
  dot falls back to FMAs and 3xTF32 needs 255 registers, and both spill at
  D=128 (sm_90 build, tests/pallas_kernels/test_cuda_compile.py). In
  interpret mode f32 is exact; bf16/f16 always use their native MMA."""
  return _f32_precision(dtype) if interpret else None


def _flat_page_ids(page_ids, layer, num_kv_heads, num_pages):
  """Page ids [...] -> rows of the pool viewed as [L*KVH*N, ps, D], [KVH, ...].

  Works for both pool forms (4-D: layer 0), so the layer is selected by the
  gather itself: no per-layer slice of the stacked pool is materialised.
  """
  layer = jnp.int32(0) if layer is None else jnp.asarray(layer, jnp.int32)
  heads = jnp.arange(num_kv_heads, dtype=jnp.int32)
  base = (layer * num_kv_heads + heads) * num_pages            # [KVH]
  return base.reshape((num_kv_heads,) + (1,) * page_ids.ndim) + page_ids


# --------------------------------------------------------------------------
# Pure-JAX reference (also the CPU production path).
# --------------------------------------------------------------------------


def ragged_paged_attention_reference(q, k_pages, v_pages, kv_lens, page_table,
                                     cu_q_lens, num_seqs, *, sm_scale,
                                     layer=None, block_q=None):
  """Jittable reference: gathers each tile's pages, masked softmax in f32."""
  t, hq, d = q.shape
  kvh, n, ps, _ = k_pages.shape[-4:]
  s, p = page_table.shape
  g = hq // kvh
  bq = block_q or (1 if t <= s else 16)
  nt = num_tiles_bound(t, s, bq)
  sched = tile_schedule(cu_q_lens, kv_lens, num_seqs, block_q=bq,
                        num_tiles=nt, num_tokens=t)
  qt = gather_q_tiles(q, sched, bq).reshape(nt, bq, kvh, g, d)
  ids = _flat_page_ids(page_table[sched.seq], layer, kvh, n)   # [KVH, NT, P]
  k = k_pages.reshape(-1, ps, d)[ids].reshape(kvh, nt, p * ps, d)
  v = v_pages.reshape(-1, ps, d)[ids].reshape(kvh, nt, p * ps, d)

  kpos = jnp.arange(p * ps, dtype=jnp.int32)                   # [K]
  u = jnp.arange(bq, dtype=jnp.int32)
  qpos = sched.pos0[:, None] + u[None, :]                      # [NT, bq]
  kv_live = kpos[None, :] < sched.kv_len[:, None]              # [NT, K]
  mask = ((u[None, :] < sched.q_len[:, None])[:, :, None]
          & (kpos[None, None, :] <= qpos[:, :, None])
          & kv_live[:, None, :])                               # [NT, bq, K]
  hi = lax.Precision.HIGHEST
  logits = jnp.einsum("nuhgd,hnkd->nhguk", qt, k, precision=hi,
                      preferred_element_type=jnp.float32) * sm_scale
  mask = mask[:, None, None]                                   # [NT,1,1,bq,K]
  logits = jnp.where(mask, logits, MASK_VALUE)
  probs = jnp.where(mask, jnp.exp(logits - logits.max(-1, keepdims=True)), 0.)
  denom = probs.sum(-1)                                        # [NT,KVH,G,bq]
  v = jnp.where(kv_live[None, :, :, None], v, jnp.zeros((), v.dtype))
  o = jnp.einsum("nhguk,hnkd->nuhgd", probs, v.astype(jnp.float32),
                 precision=hi)
  o = o / jnp.where(denom > 0, denom, 1.).transpose(0, 3, 1, 2)[..., None]
  o = o.reshape(nt, bq, hq, d).astype(q.dtype)
  return scatter_tiles_to_tokens(o, cu_q_lens, num_seqs, sched, t)


# --------------------------------------------------------------------------
# Blocked pure-JAX path ("xla"): the CPU production path.
# --------------------------------------------------------------------------


def ragged_paged_attention_xla(q, k_pages, v_pages, kv_lens, page_table,
                               cu_q_lens, num_seqs, *, sm_scale, layer=None,
                               block_q=None, pages_per_block=None,
                               include=None, num_tiles=None):
  """The reference's math with an online softmax over blocks of pages.

  A while loop runs ceil(longest live kv_len / block) times, so the work and
  the gathered K/V follow the batch's real context, not the page table's
  static width P (which can then be the full max_model_len / page_size).
  include/num_tiles: as in `_pallas_forward`.
  """
  t, hq, d = q.shape
  kvh, n, ps, _ = k_pages.shape[-4:]
  s, p = page_table.shape
  g = hq // kvh
  bq = block_q or (1 if t <= s else 16)
  # Keys per block: 64 for decode tiles, 128 for prefill tiles (CPU-tuned).
  ppb = min(pages_per_block or max(1, (64 if bq == 1 else 128) // ps), p)
  nt = num_tiles or num_tiles_bound(t, s, bq)
  sched = tile_schedule(cu_q_lens, kv_lens, num_seqs, block_q=bq,
                        num_tiles=nt, include=include, num_tokens=t)
  qt = gather_q_tiles(q, sched, bq).reshape(nt, bq, kvh, g, d)
  pt = jnp.pad(page_table, ((0, 0), (0, -p % ppb)))[sched.seq]  # [NT, Pp]
  u = jnp.arange(bq, dtype=jnp.int32)
  qpos = sched.pos0[:, None] + u[None, :]                      # [NT, bq]
  q_live = u[None, :] < sched.q_len[:, None]                   # [NT, bq]
  longest = jnp.max(jnp.where(sched.q_len > 0, sched.kv_len, 0))
  num_blocks = (longest + ppb * ps - 1) // (ppb * ps)
  hi = _f32_precision(q.dtype)

  def block(b, carry):
    m, l, acc = carry                       # [NT,KVH,G,bq], idem, [..., D]
    ids = lax.dynamic_slice_in_dim(pt, b * ppb, ppb, axis=1)    # [NT, ppb]
    flat = _flat_page_ids(ids, layer, kvh, n)                   # [KVH,NT,ppb]
    k = k_pages.reshape(-1, ps, d)[flat].reshape(kvh, nt, ppb * ps, d)
    v = v_pages.reshape(-1, ps, d)[flat].reshape(kvh, nt, ppb * ps, d)
    kpos = b * ppb * ps + jnp.arange(ppb * ps, dtype=jnp.int32)  # [K]
    kv_live = kpos[None, :] < sched.kv_len[:, None]             # [NT, K]
    mask = (q_live[:, :, None] & (kpos[None, None, :] <= qpos[:, :, None])
            & kv_live[:, None, :])[:, None, None]               # [NT,1,1,bq,K]
    logits = jnp.einsum("nuhgd,hnkd->nhguk", qt, k, precision=hi,
                        preferred_element_type=jnp.float32) * sm_scale
    logits = jnp.where(mask, logits, MASK_VALUE)
    m_new = jnp.maximum(m, logits.max(-1))
    probs = jnp.where(mask, jnp.exp(logits - m_new[..., None]), 0.)
    alpha = jnp.exp(m - m_new)
    v = jnp.where(kv_live[None, :, :, None], v, jnp.zeros((), v.dtype))
    pv = jnp.einsum("nhguk,hnkd->nhgud", probs, v.astype(jnp.float32),
                    precision=hi)
    return m_new, l * alpha + probs.sum(-1), acc * alpha[..., None] + pv

  init = (jnp.full((nt, kvh, g, bq), MASK_VALUE, jnp.float32),
          jnp.zeros((nt, kvh, g, bq), jnp.float32),
          jnp.zeros((nt, kvh, g, bq, d), jnp.float32))
  _, l, acc = lax.fori_loop(0, num_blocks, block, init)
  o = acc / jnp.where(l > 0, l, 1.)[..., None]                  # [NT,KVH,G,bq,D]
  o = o.transpose(0, 3, 1, 2, 4).reshape(nt, bq, hq, d).astype(q.dtype)
  return scatter_tiles_to_tokens(o, cu_q_lens, num_seqs, sched, t)


# --------------------------------------------------------------------------
# Pallas kernel (Triton lowering; runs under interpret=True on CPU).
# --------------------------------------------------------------------------


def _rpa_kernel(seq_ref, qlen_ref, pos0_ref, kvlen_ref, layer_ref, pt_ref,
                q_ref, k_ref, v_ref, *refs, sm_scale, group, block_q,
                pages_per_block, page_size, num_pages, num_kv_heads,
                num_splits, num_aliased, precision):
  """One program: KV head h, query tile i, KV split c.

  q_ref [R, D] (row r = token r // G, head r % G of the group),
  k_ref/v_ref [L*KVH*N*ps, D] (whole pool, a row a token slot), pt_ref [S, P]
  page table.
  Outputs: o [R, D] (normalised), and with splits lse [R] (f32).
  """
  o_ref, *lse_ref = refs[num_aliased:]
  h, i, c = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  seq, q_len, pos0, kv_len = seq_ref[i], qlen_ref[i], pos0_ref[i], kvlen_ref[i]
  rows, d = q_ref.shape
  block_k = pages_per_block * page_size
  row_tok = lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group
  row_pos, row_live = pos0 + row_tok, row_tok < q_len           # [R, 1]
  kv_end = jnp.where(q_len > 0, jnp.minimum(kv_len, pos0 + q_len), 0)
  num_blocks = pl.cdiv(kv_end, block_k)      # blocks of the whole sequence
  per_split = pl.cdiv(num_blocks, num_splits)
  b_lo = c * per_split
  b_hi = jnp.minimum(num_blocks, b_lo + per_split)
  # Blocks wholly at or before the tile's first query position need no mask:
  # every key there is live (< kv_end) and causal for every query row (rows
  # holding no query compute finite values nothing reads). The split's
  # blocks [b_lo, b_mid) run unmasked in the pipelined loop; the rest,
  # [b_mid, b_hi) (the causal diagonal and the sequence's tail, where V past
  # kv_end may be stale NaN), at most `masked_blocks`, run one by one after
  # it, masked. Out of the loop they are not pipelined: no extra buffers.
  b_mid = jnp.clip((pos0 + 1) // block_k, b_lo, jnp.maximum(b_lo, b_hi))
  masked_blocks = pl.cdiv(block_q + block_k - 2, block_k)
  page_base = (layer_ref[0] * num_kv_heads + h) * num_pages
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
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * sm_scale
    if masked:
      kpos = b * block_k + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
      mask = row_live & (kpos <= row_pos) & (kpos < kv_end)  # [R, K]
      s = jnp.where(mask, s, MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    if masked:   # p is 0 past kv_end, but 0 * NaN is NaN: zero V there too
      p = jnp.where(mask, p, 0.0)
      kpos_col = b * block_k + lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)
      v = jnp.where(kpos_col < kv_end, v, jnp.zeros((), v.dtype))
    pv = jnp.dot(p.astype(v.dtype), v, precision=precision,
                 preferred_element_type=jnp.float32)
    return (acc * alpha[:, None] + pv, m_new, l * alpha + p.sum(axis=1),
            krows_next)

  q = q_ref[...]
  init = (jnp.zeros((rows, d), jnp.float32),
          jnp.full((rows,), MASK_VALUE, jnp.float32),
          jnp.zeros((rows,), jnp.float32), key_rows(b_lo))
  carry = lax.fori_loop(b_lo, b_mid, functools.partial(body, masked=False),
                        init)
  for j in range(masked_blocks):
    carry = lax.cond(b_mid + j < b_hi,
                     functools.partial(body, b_mid + j, masked=True),
                     lambda carry: carry, carry)
  acc, m, l, _ = carry
  l_safe = jnp.where(l > 0.0, l, 1.0)
  o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
  if lse_ref:
    lse_ref[0][...] = jnp.where(l > 0.0, m + jnp.log(l_safe), MASK_VALUE)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Static tiling of the Pallas kernel."""
  block_q: int          # query tokens per tile (bq)
  rows: int             # R = next_pow2(bq * G), >= 16
  pages_per_block: int  # pages per inner iteration (block_k = ppb * ps)
  num_splits: int       # KV splits (flash-decoding), 1 = off
  num_warps: int
  num_stages: int


# Keys per inner block, and the shared memory the pipelines may take.
# Decode tiles are memory-bound: 32-key blocks with (stages - 1) blocks in
# flight keep 4 programs a SM on an H100/H200 (sm_90 build at D=128 bf16:
# 54 KiB, 128 registers) and the loads a few blocks ahead of the dots.
# Prefill tiles (128 rows, 1 program a SM by registers) are compute-bound:
# 64-key blocks, 3 stages where Q and 3 K/V buffers fit. Their Hopper wgmma
# dots read shared memory asynchronously, so the pipeliner keeps one buffer
# more than the blocks in flight: at 2 stages it waits for all copies before
# each block's dots (no overlap); at 3 the next block's copies stay in flight
# (D=128 bf16: 128 KiB, 239 registers, no spills).
_DECODE_BLOCK_KEYS = 32
_PREFILL_BLOCK_KEYS = 64
_DECODE_BUFFER_BYTES = 48 * 1024
_PREFILL_SHARED_BYTES = 160 * 1024


def choose_config(num_tokens, num_slots, group, page_size, max_pages,
                  num_kv_heads, *, head_dim, itemsize, block_q=None,
                  pages_per_block=None, num_splits=None, num_warps=None,
                  num_stages=None):
  """Picks static tile sizes; explicit arguments override the heuristics.

  head_dim, itemsize: of the KV pool (they size the pipeline's buffers)."""
  decode_like = num_tokens <= num_slots
  if block_q is not None:
    rows = max(16, _next_pow2(block_q * group))
  elif decode_like:   # one decode token per tile: rows = G padded to 16
    rows = max(16, _next_pow2(group))
  else:               # prefill chunks: ~32 tokens, at most 128 rows
    rows = max(_next_pow2(group), min(128, max(16, _next_pow2(32 * group))))
  bq = block_q if block_q is not None else rows // group
  keys = _DECODE_BLOCK_KEYS if decode_like else _PREFILL_BLOCK_KEYS
  ppb = pages_per_block or max(1, keys // page_size)
  if num_stages is None:
    block_bytes = 2 * ppb * page_size * head_dim * itemsize   # K and V blocks
    if decode_like:   # (stages - 1) blocks in flight
      num_stages = 1 + max(1, min(3, _DECODE_BUFFER_BYTES // block_bytes))
    else:             # Q, and 3 buffers at 3 stages
      q_bytes = rows * head_dim * itemsize
      fits = 3 * block_bytes + q_bytes <= _PREFILL_SHARED_BYTES
      num_stages = 3 if fits else 2
  if num_splits is None:
    max_blocks = max(1, -(-max_pages // ppb))
    tiles = num_tiles_bound(num_tokens, num_slots, bq) * num_kv_heads
    want = -(-512 // tiles) if decode_like else 1
    num_splits = max(1, min(32, _next_pow2(want), max_blocks))
  warps = num_warps or (4 if rows <= 32 else 8)
  return KernelConfig(bq, rows, ppb, num_splits, warps, num_stages)


@dataclasses.dataclass(frozen=True)
class KernelCall:
  """One pallas_call of a batch: its tiling and static number of tiles."""
  cfg: KernelConfig
  num_tiles: int


def plan_kernel_calls(num_tokens, num_slots, group, page_size, max_pages,
                      num_kv_heads, *, head_dim, itemsize, block_q=None,
                      pages_per_block=None, num_splits=None, num_warps=None,
                      num_stages=None,
                      max_prefill_seqs=None) -> tuple[KernelCall, ...]:
  """The kernel calls a (T, S) batch makes: one tiling for all, or, for
  T > S without block_q, a decode call (one tile a sequence) and a prefill
  call sized for min(S, max_prefill_seqs) sequences (see docs/kernels.md)."""
  config = functools.partial(
      choose_config, group=group, page_size=page_size, max_pages=max_pages,
      num_kv_heads=num_kv_heads, head_dim=head_dim, itemsize=itemsize,
      pages_per_block=pages_per_block, num_splits=num_splits,
      num_warps=num_warps, num_stages=num_stages)
  cfg = config(num_tokens, num_slots, block_q=block_q)
  if block_q is not None or num_tokens <= num_slots:
    return (KernelCall(cfg, num_tiles_bound(num_tokens, num_slots,
                                            cfg.block_q)),)
  prefill_seqs = min(num_slots, max_prefill_seqs or num_slots)
  return (KernelCall(config(num_slots, num_slots), num_slots),
          KernelCall(cfg, num_tiles_bound(num_tokens, prefill_seqs,
                                          cfg.block_q)))


def _merge_splits(o, lse):
  """Flash-decoding merge in f32: o [NS, ..., R, D], lse [NS, ..., R]."""
  w = jnp.exp(lse - lse.max(axis=0, keepdims=True))            # [NS, ..., R]
  num = (w[..., None] * o).sum(axis=0)
  return num / w.sum(axis=0)[..., None]                        # den >= 1


def _pallas_call(q_tiles, k_flat, v_flat, page_table, sched, layer, *,
                 cfg, sm_scale, group, page_size, num_pages, num_kv_heads,
                 interpret, poison_output):
  """q_tiles [KVH, NT, R, D] -> o [KVH, NT, R, D] (merged over splits).

  k_flat, v_flat [L*KVH*N*ps, D]: the pool, a row per token slot."""
  kvh, nt, rows, d = q_tiles.shape
  ns = cfg.num_splits
  meta = [sched.seq, sched.q_len, sched.pos0, sched.kv_len, layer, page_table]
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
  if poison_output:   # testing aid: outputs start NaN, unwritten rows show
    for j, (shp, spec) in enumerate(zip(out_shape, out_specs)):
      aliases[len(inputs)] = j
      inputs.append(jnp.full(shp.shape, jnp.nan, shp.dtype))
      in_specs.append(spec)
  kernel = functools.partial(
      _rpa_kernel, sm_scale=sm_scale, group=group, block_q=cfg.block_q,
      pages_per_block=cfg.pages_per_block, page_size=page_size,
      num_pages=num_pages, num_kv_heads=num_kv_heads, num_splits=ns,
      num_aliased=len(aliases),
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


def _pallas_forward(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens,
                    num_seqs, *, sm_scale, layer, cfg, num_tiles, interpret,
                    poison_output, include=None):
  """Tiles the batch, runs the kernel, scatters tiles back to tokens.

  include: run only the sequences it marks; num_tiles: a static bound on
  their tiles (see plan_kernel_calls).
  """
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
  layer_arr = jnp.reshape(jnp.asarray(0 if layer is None else layer,
                                      jnp.int32), (1,))
  o = _pallas_call(
      qt, k_pages.reshape(-1, d), v_pages.reshape(-1, d), pt, sched,
      layer_arr, cfg=cfg, sm_scale=sm_scale, group=g, page_size=ps, num_pages=n,
      num_kv_heads=kvh, interpret=interpret, poison_output=poison_output)
  o = o[:, :, : bq * g].reshape(kvh, nt, bq, g, d)             # [KVH,NT,bq,G,D]
  o = o.transpose(1, 2, 0, 3, 4).reshape(nt, bq, hq, d)
  return scatter_tiles_to_tokens(o, cu_q_lens, num_seqs, sched, t)


# --------------------------------------------------------------------------
# Public wrapper.
# --------------------------------------------------------------------------


def _check_int_array(name, x, shape):
  if x.shape != shape:
    raise ValueError(f"{name} must have shape {shape}, got {x.shape}.")
  if x.dtype != jnp.int32:
    raise ValueError(f"{name} must be int32, got {x.dtype}.")


def _validate(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, layer,
              backend):
  """Shape/dtype checks with ValueErrors naming the offending values."""
  if backend not in _BACKENDS:
    raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}.")
  if q.ndim != 3:
    raise ValueError(f"q must be [T, Hq, D], got shape {q.shape}.")
  if q.dtype not in _DTYPES:
    raise ValueError(f"q dtype {q.dtype} not in {[str(x) for x in _DTYPES]}.")
  if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
    raise ValueError(f"k_pages {k_pages.shape}/{k_pages.dtype} and v_pages "
                     f"{v_pages.shape}/{v_pages.dtype} must match.")
  if k_pages.ndim not in (4, 5):
    raise ValueError("k_pages must be [KVH, N, ps, D] or [L, KVH, N, ps, D], "
                     f"got shape {k_pages.shape}.")
  if (k_pages.ndim == 5) != (layer is not None):
    raise ValueError("layer must be given iff the pool is 5-D; got pool shape "
                     f"{k_pages.shape} and layer={layer!r}.")
  if k_pages.dtype != q.dtype:
    raise ValueError(f"KV dtype {k_pages.dtype} must equal q dtype {q.dtype}.")
  kvh, _, _, d = k_pages.shape[-4:]
  if q.shape[2] != d:
    raise ValueError(f"q head_dim {q.shape[2]} != KV head_dim {d}.")
  if q.shape[1] % kvh:
    raise ValueError(f"num q heads {q.shape[1]} not divisible by num kv heads "
                     f"{kvh}.")
  if page_table.ndim != 2:
    raise ValueError(f"page_table must be [S, P], got {page_table.shape}.")
  s = page_table.shape[0]
  _check_int_array("page_table", page_table, page_table.shape)
  _check_int_array("kv_lens", kv_lens, (s,))
  _check_int_array("cu_q_lens", cu_q_lens, (s + 1,))


def _check_pallas_shapes(head_dim, page_size, cfg, pool_rows):
  """Triton needs power-of-two blocks and >= 16 wide dot operands; the
  kernel indexes the pool's token slots (rows) with int32."""
  if pool_rows >= 2**31:
    raise ValueError(f"pallas backend: the pool has {pool_rows} token slots "
                     "(layers x kv heads x pages x page_size), more than "
                     "int32 row indices reach.")
  if head_dim < 16 or head_dim & (head_dim - 1):
    raise ValueError(f"pallas backend needs a power-of-two head_dim >= 16, "
                     f"got head_dim={head_dim}; use backend='reference'.")
  if page_size & (page_size - 1):
    raise ValueError(f"pallas backend needs a power-of-two page_size, got "
                     f"page_size={page_size}.")
  block_k = cfg.pages_per_block * page_size
  if block_k < 16 or block_k & (block_k - 1):
    raise ValueError(f"pages_per_block * page_size = {block_k} must be a "
                     "power of two >= 16.")


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "backend", "interpret", "block_q", "pages_per_block",
    "num_splits", "num_warps", "num_stages", "max_prefill_seqs",
    "poison_output"))
def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_table,
                           cu_q_lens, num_seqs, *, sm_scale, layer=None,
                           backend="auto", interpret=False, block_q=None,
                           pages_per_block=None, num_splits=None,
                           num_warps=None, num_stages=None,
                           max_prefill_seqs=None, poison_output=False):
  """Causal attention for a packed, ragged batch over a paged KV pool.

  Args:
    q: [T, Hq, D] packed queries (bf16/fp16/fp32).
    k_pages, v_pages: [KVH, N, ps, D], or [L, KVH, N, ps, D] with `layer`.
    kv_lens: int32[S] tokens in each sequence's cache, incl. this step's.
    page_table: int32[S, P] page ids per sequence (padded with 0).
    cu_q_lens: int32[S+1] query offsets; seq s owns q[cu[s]:cu[s+1]].
    num_seqs: int32 scalar (traced ok): live sequence slots.
    sm_scale: softmax scale (static float).
    layer: int32 scalar (traced ok) for a layer-stacked pool.
    backend: "auto" (pallas on GPU, else xla), "reference" (the readable
      oracle: gathers the whole page-table row), "xla" (blocked online
      softmax in plain JAX: the CPU path), "pallas".
    interpret: run the Pallas kernel in interpret mode (CPU testing).
    block_q, pages_per_block, num_splits, num_warps, num_stages: kernel
      tiling overrides (see choose_config); ignored by the reference.
      Without block_q, a batch with T > S runs as two calls (decodes in
      small tiles, prefill chunks in tall ones).
    max_prefill_seqs: static promise that at most this many sequences have
      more than one query (the scheduler's cap on prefills per step). It
      bounds the prefill tiles of a T > S batch; sequences beyond it would
      get no output, so callers must enforce it. None: no promise.
    poison_output: testing aid, kernel outputs start NaN-filled (aliased).

  Returns:
    [T, Hq, D] in q.dtype; rows of padding tokens are exactly 0.
  """
  _validate(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, layer,
            backend)
  if max_prefill_seqs is not None and (
      not isinstance(max_prefill_seqs, int) or max_prefill_seqs < 1):
    raise ValueError("max_prefill_seqs must be a positive int or None, got "
                     f"{max_prefill_seqs!r}.")
  if backend == "auto":
    backend = "pallas" if jax.default_backend() == "gpu" else "xla"
  sm_scale = float(sm_scale)
  if backend == "reference":
    return ragged_paged_attention_reference(
        q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, num_seqs,
        sm_scale=sm_scale, layer=layer)
  t, s = q.shape[0], page_table.shape[0]
  if backend == "xla":
    run = functools.partial(
        ragged_paged_attention_xla, q, k_pages, v_pages, kv_lens, page_table,
        cu_q_lens, num_seqs, sm_scale=sm_scale, layer=layer,
        pages_per_block=pages_per_block)
    if block_q is not None or t <= s:
      return run(block_q=block_q)
    prefill_seqs = min(s, max_prefill_seqs or s)
    return _split_decode_prefill(
        run, cu_q_lens, num_seqs, t, decode_block_q=1,
        decode_kw=dict(block_q=1, num_tiles=s),
        prefill_kw=dict(block_q=16,
                        num_tiles=num_tiles_bound(t, prefill_seqs, 16)))
  kvh, _, ps, d = k_pages.shape[-4:]
  calls = plan_kernel_calls(
      t, s, q.shape[1] // kvh, ps, page_table.shape[1], kvh, head_dim=d,
      itemsize=q.dtype.itemsize, block_q=block_q,
      pages_per_block=pages_per_block, num_splits=num_splits,
      num_warps=num_warps, num_stages=num_stages,
      max_prefill_seqs=max_prefill_seqs)
  for call in calls:
    _check_pallas_shapes(d, ps, call.cfg, k_pages.size // d)
  run = functools.partial(
      _pallas_forward, q, k_pages, v_pages, kv_lens, page_table, cu_q_lens,
      num_seqs, sm_scale=sm_scale, layer=layer, interpret=interpret,
      poison_output=poison_output)
  if len(calls) == 1:   # one tiling fits the whole batch
    return run(cfg=calls[0].cfg, num_tiles=calls[0].num_tiles)
  decode, prefill = calls
  return _split_decode_prefill(
      run, cu_q_lens, num_seqs, t, decode_block_q=decode.cfg.block_q,
      decode_kw=dict(cfg=decode.cfg, num_tiles=decode.num_tiles),
      prefill_kw=dict(cfg=prefill.cfg, num_tiles=prefill.num_tiles))


def _split_decode_prefill(run, cu_q_lens, num_seqs, num_tokens, *,
                          decode_block_q, prefill_kw, decode_kw):
  """A mixed batch in two calls: sequences with at most `decode_block_q`
  queries (decodes) in small tiles, one per sequence; the others (prefill
  chunks) in tall tiles. One tiling for all would pad each decode's G query
  rows up to a prefill tile (16 tokens on CPU, 128 rows in the kernel)."""
  cu = clamped_cu_q_lens(cu_q_lens, num_seqs)                 # [S+1]
  is_decode = cu[1:] - cu[:-1] <= decode_block_q              # [S]
  out_d = run(include=is_decode, **decode_kw)   # num_tiles: S, one a seq
  out_p = run(include=~is_decode, **prefill_kw)
  tok_seq = _seq_of_token(cu, num_tokens)                     # [T]
  return jnp.where(is_decode[tok_seq][:, None, None], out_d, out_p)
