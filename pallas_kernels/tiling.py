"""Planning and tiling shared by the two attention kernels (Triton and XLA).

Letters used in shapes below:
  T   packed query tokens of all sequences (prefill chunks and decodes mixed)
  S   sequence slots (static); slots >= num_seqs are padding
  Hq  query heads; KVH key/value heads; G = Hq // KVH (GQA group)
  D   head dim; N pages in the pool; ps page size; P pages per page-table row
  NT  query tiles (static upper bound); bq query tokens per tile

A tile is (sequence, bq consecutive query tokens of it). The tile schedule is
computed on device from cu_q_lens, so the batch layout is fully dynamic while
every shape stays static. `plan_kernel_calls` decides, from static shapes
alone, how many kernel calls a batch takes and each call's tiling.

Nothing here is used by the reference (`reference.py`), which is written
independently so that it can check these pieces.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

# Finite "minus infinity": keeps (m_old - m_new) free of inf - inf = NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# A window this wide is no window: positions stay far below it.
NO_WINDOW = 1 << 30
_KERNEL_BACKENDS = ("pallas", "xla")


def next_pow2(x: int) -> int:
  return 1 if x <= 1 else 1 << (x - 1).bit_length()


# --------------------------------------------------------------------------
# Static planning: kernel calls and their tilings.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Static tiling of one kernel call."""
  block_q: int          # query tokens per tile (bq)
  rows: int             # Triton: R = next_pow2(bq * G) >= 16; XLA: bq * G
  pages_per_block: int  # pages per inner iteration (block_k = ppb * ps)
  num_splits: int = 1   # KV splits (flash-decoding), 1 = off
  num_warps: int | None = None    # Triton only
  num_stages: int | None = None   # Triton only
  # XLA only: live tiles attended together, each group over its own blocks
  # in a loop of ceil(live tiles / tile_chunk); None = all tiles in lockstep.
  tile_chunk: int | None = None

  def __post_init__(self):
    for name in ("block_q", "rows", "pages_per_block", "num_splits"):
      if getattr(self, name) < 1:
        raise ValueError(f"KernelConfig.{name} must be >= 1, got "
                         f"{getattr(self, name)}.")
    if self.tile_chunk is not None and self.tile_chunk < 1:
      raise ValueError(f"KernelConfig.tile_chunk must be None or >= 1, got "
                       f"{self.tile_chunk}.")


@dataclasses.dataclass(frozen=True)
class KernelCall:
  """One kernel call of a batch: its tiling and static number of tiles."""
  cfg: KernelConfig
  num_tiles: int


# Triton keys per inner block, and the shared memory the pipelines may take.
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
# XLA path (CPU-tuned on the 2-core machine): decode tiles of one token and
# 64-key blocks (fastest of 16-256), prefill tiles of 16 tokens and 64-key
# blocks (of 8-32 tokens and 32-128 keys, SmolLM2 shapes, 512-token mixed
# steps: 0.73x the time of 128-key blocks, whose lockstep loop computes more
# masked keys past each tile's causal end; docs/kernels.md).
_XLA_DECODE_BLOCK_KEYS = 64
_XLA_PREFILL_BLOCK_KEYS = 64
_XLA_PREFILL_BLOCK_Q = 16
# XLA steps of 2..16 tokens (a few decodes, speculative verifications, short
# chunks) put every multi-token sequence in one tile of next_pow2(T) <= 16
# tokens, attended one tile at a time: lockstep one-token tiles would read each
# page once per query (a 4-token verification: 4x the K/V of a decode), and a
# lockstep call sized for the worst case reads pages for its idle tiles too.
# SmolLM2 shapes, 30 layers, context 170 (docs/kernels.md): a
# 4-token verification 4.4 -> 1.6 ms, an 8-token one 12 -> 2.4 ms, decodes alike.
_XLA_SERIAL_MAX_TOKENS = 16


# Batch-invariant mode: one tiling for every step shape, so a query's reduction over its keys runs in the
# same order in any batch. One query token a tile (a decode's tile; a prefill chunk's tokens each in their
# own), blocks of BATCH_INVARIANT_BLOCK_KEYS keys from key 0, no KV splits (flash-decoding's split count
# follows the batch's tile count, and the partial results' merge changes the sums).
BATCH_INVARIANT_BLOCK_KEYS = 128


def batch_invariant_tiling(page_size: int) -> dict[str, int]:
  """The tiling arguments (block_q, pages_per_block) of batch-invariant mode for pages of page_size."""
  return dict(block_q=1, pages_per_block=max(1, BATCH_INVARIANT_BLOCK_KEYS // page_size))


def choose_config(num_tokens, num_slots, group, page_size, max_pages,
                  num_kv_heads, *, head_dim, itemsize, block_q=None,
                  pages_per_block=None, num_splits=None, num_warps=None,
                  num_stages=None, backend="pallas") -> KernelConfig:
  """Picks static tile sizes; explicit arguments override the heuristics.

  head_dim, itemsize: of the KV pool (they size the pipeline's buffers).
  backend: "pallas" (the Triton kernel) or "xla" (the blocked XLA path,
  which has no splits, warps or stages)."""
  if backend not in _KERNEL_BACKENDS:
    raise ValueError(f"backend must be one of {_KERNEL_BACKENDS}, got "
                     f"{backend!r}.")
  if backend == "xla":
    return _xla_config(num_tokens, num_slots, group, page_size, max_pages,
                       block_q=block_q, pages_per_block=pages_per_block)
  decode_like = num_tokens <= num_slots
  if block_q is not None:
    rows = max(16, next_pow2(block_q * group))
  elif decode_like:   # one decode token per tile: rows = G padded to 16
    rows = max(16, next_pow2(group))
  else:               # prefill chunks: ~32 tokens, at most 128 rows
    rows = max(next_pow2(group), min(128, max(16, next_pow2(32 * group))))
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
    num_splits = max(1, min(32, next_pow2(want), max_blocks))
  warps = num_warps or (4 if rows <= 32 else 8)
  return KernelConfig(bq, rows, ppb, num_splits, warps, num_stages)


def _xla_config(num_tokens, num_slots, group, page_size, max_pages, *,
                block_q, pages_per_block) -> KernelConfig:
  """The XLA path's tiling: its tiles are one vectorised batch, so a decode
  tile holds one token (no padded rows) and blocks never pass the table."""
  decode_like = num_tokens <= num_slots
  bq = block_q or (1 if decode_like else _XLA_PREFILL_BLOCK_Q)
  keys = _XLA_DECODE_BLOCK_KEYS if decode_like else _XLA_PREFILL_BLOCK_KEYS
  ppb = min(pages_per_block or max(1, keys // page_size), max_pages)
  return KernelConfig(bq, bq * group, max(1, ppb))


def plan_kernel_calls(num_tokens, num_slots, group, page_size, max_pages,
                      num_kv_heads, *, head_dim, itemsize, block_q=None,
                      pages_per_block=None, num_splits=None, num_warps=None,
                      num_stages=None, max_num_partial_prefills=None,
                      backend="pallas") -> tuple[KernelCall, ...]:
  """The kernel calls a (T, S) batch makes: one tiling for all, or, for
  T > S without block_q, a decode call (one tile a sequence) and a prefill
  call sized for min(S, max_num_partial_prefills) sequences (see
  docs/kernels.md). backend: "pallas" or "xla" (see choose_config); the
  XLA path splits steps of 2..16 tokens too (_xla_small_step_calls)."""
  config = functools.partial(
      choose_config, group=group, page_size=page_size, max_pages=max_pages,
      num_kv_heads=num_kv_heads, head_dim=head_dim, itemsize=itemsize,
      pages_per_block=pages_per_block, num_splits=num_splits,
      num_warps=num_warps, num_stages=num_stages, backend=backend)
  if backend == "xla" and block_q is None and \
      2 <= num_tokens <= _XLA_SERIAL_MAX_TOKENS:
    return _xla_small_step_calls(num_tokens, num_slots, config,
                                 max_num_partial_prefills)
  cfg = config(num_tokens, num_slots, block_q=block_q)
  if block_q is not None or num_tokens <= num_slots:
    return (KernelCall(cfg, num_tiles_bound(num_tokens, num_slots,
                                            cfg.block_q)),)
  prefill_seqs = min(num_slots, max_num_partial_prefills or num_slots)
  return (KernelCall(config(num_slots, num_slots), num_slots),
          KernelCall(cfg, num_tiles_bound(num_tokens, prefill_seqs,
                                          cfg.block_q)))


def _xla_small_step_calls(num_tokens, num_slots, config,
                          max_num_partial_prefills):
  """A small XLA step's calls: its decodes in one-token tiles in lockstep,
  and its multi-token sequences (at most T // 2 of them) in tiles of
  next_pow2(T) tokens, one tile at a time (see _XLA_SERIAL_MAX_TOKENS)."""
  bq = next_pow2(num_tokens)
  decode = config(num_slots, num_slots, block_q=1)
  multi = dataclasses.replace(config(num_tokens, num_slots, block_q=bq),
                              tile_chunk=1)
  multi_seqs = min(num_slots, num_tokens // 2,
                   max_num_partial_prefills or num_slots)
  return (KernelCall(decode, min(num_tokens, num_slots)),
          KernelCall(multi, num_tiles_bound(num_tokens, multi_seqs, bq)))


def num_tiles_bound(num_tokens: int, num_slots: int, block_q: int) -> int:
  """Static bound on sum_s ceil(q_len_s / bq) given sum_s q_len_s <= T."""
  bound = (num_tokens + num_slots * (block_q - 1)) // block_q
  return max(1, min(num_tokens, bound))


def run_planned_calls(run, calls, cu_q_lens, num_seqs, num_tokens):
  """Runs a batch's planned calls: `run(cfg=, num_tiles=, include=)` -> out
  [T, Hq, D]. A mixed batch's two calls: sequences with at most the decode
  tile's queries (decodes) in small tiles, one per sequence; the others
  (prefill chunks) in tall tiles. One tiling for all would pad each decode's
  G query rows up to a prefill tile (16 tokens on CPU, 128 rows in Triton)."""
  if len(calls) == 1:   # one tiling fits the whole batch
    return run(cfg=calls[0].cfg, num_tiles=calls[0].num_tiles)
  decode, prefill = calls
  cu = clamped_cu_q_lens(cu_q_lens, num_seqs)                 # [S+1]
  is_decode = cu[1:] - cu[:-1] <= decode.cfg.block_q          # [S]
  out_d = run(cfg=decode.cfg, num_tiles=decode.num_tiles, include=is_decode)
  out_p = run(cfg=prefill.cfg, num_tiles=prefill.num_tiles,
              include=~is_decode)
  tok_seq = _seq_of_token(cu, num_tokens)                     # [T]
  return jnp.where(is_decode[tok_seq][:, None, None], out_d, out_p)


# --------------------------------------------------------------------------
# Tile schedule (plain jnp, runs on device).
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


# --------------------------------------------------------------------------
# Pool indexing, the window and precision (both kernels).
# --------------------------------------------------------------------------


def flat_page_ids(page_ids, layer, num_kv_heads, num_pages):
  """Page ids [...] -> rows of the pool viewed as [L*KVH*N, ps, D], [KVH, ...].

  Works for both pool forms (4-D: layer 0), so the layer is selected by the
  gather itself: no per-layer slice of the stacked pool is materialised.
  """
  layer = jnp.int32(0) if layer is None else jnp.asarray(layer, jnp.int32)
  heads = jnp.arange(num_kv_heads, dtype=jnp.int32)
  base = (layer * num_kv_heads + heads) * num_pages            # [KVH]
  return base.reshape((num_kv_heads,) + (1,) * page_ids.ndim) + page_ids


def effective_window(sliding_window):
  """int32 scalar W, NO_WINDOW where sliding_window <= 0 (no window). The
  query at position p sees keys k with p - W < k <= p."""
  w = jnp.asarray(sliding_window, jnp.int32)
  return jnp.where(w > 0, w, NO_WINDOW)


def f32_precision(dtype):
  """HIGHEST for f32 inputs: GPU dots (XLA's and Triton's) otherwise run f32
  as TF32 (~1e-3 error); None keeps bf16/f16 on their native MMA path."""
  return lax.Precision.HIGHEST if dtype == jnp.float32 else None
