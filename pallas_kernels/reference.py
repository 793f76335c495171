"""The readable references (the oracles of the kernels): ragged paged attention, and a plain matmul.

Attention: one query token at a time: find its sequence and position, gather that
sequence's whole page-table row of keys and values, and take a masked softmax
in float32 at full precision. It shares no code with the kernels (no tiles,
no blocks, no planning), so their bugs cannot hide in it. Jittable (traced
num_seqs, layer and sliding_window); slow and memory-hungry by design: it
gathers a whole page-table row per token (all tokens at once where they fit
in _GATHER_BUDGET, else in groups).

Shapes: q [T, Hq, D]; k_pages, v_pages [KVH, N, ps, D] or [L, KVH, N, ps, D];
kv_lens [S]; page_table [S, P]; cu_q_lens [S+1]; G = Hq // KVH. An fp8 pool
(e4m3 bytes, uint8) comes with k_scale, v_scale f32 [KVH]: the gathered
elements are turned back into float32 values (e4m3 element * its head's
scale) before any arithmetic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

# Gathered K (and V) elements held at once: all tokens in one vmap when they
# fit (no loop in the program), else a lax.map over groups of tokens.
_GATHER_BUDGET = 1 << 26


def ragged_paged_attention_reference(q, k_pages, v_pages, kv_lens, page_table,
                                     cu_q_lens, num_seqs, *, sm_scale,
                                     layer=None, sliding_window=None,
                                     k_scale=None, v_scale=None):
  """Causal attention of packed queries over a paged KV pool.

  Sequence s < num_seqs owns queries cu_q_lens[s]:cu_q_lens[s+1], the last
  q_len of its kv_lens[s] tokens. The query at position p sees keys at
  positions k with k <= p and, with sliding_window W > 0, p - W < k.
  sliding_window: None or an int32 scalar (traced ok); <= 0 is no window.
  k_scale, v_scale: f32 [KVH] for an fp8 pool (uint8 e4m3 bytes), else None.
  Returns [T, Hq, D] in q.dtype; tokens past cu_q_lens[num_seqs] are 0.
  """
  if layer is not None:   # a layer-stacked pool: take the layer's [KVH, ...]
    k_pages = lax.dynamic_index_in_dim(k_pages, layer, keepdims=False)
    v_pages = lax.dynamic_index_in_dim(v_pages, layer, keepdims=False)
  seq, pos, live = _token_positions(cu_q_lens, kv_lens, num_seqs, q.shape[0])
  window = (jnp.int32(0) if sliding_window is None
            else jnp.asarray(sliding_window, jnp.int32))
  kvh = k_pages.shape[0]
  scales = (jnp.ones((kvh,), jnp.float32) if k_scale is None else k_scale,
            jnp.ones((kvh,), jnp.float32) if v_scale is None else v_scale)

  def attend(token):
    q_t, s, p = token
    return _attend_one(q_t, k_pages, v_pages, page_table[s], kv_lens[s], p,
                       window, sm_scale, scales)

  row = k_pages.shape[0] * page_table.shape[1] * k_pages.shape[2] * q.shape[2]
  per_step = max(1, _GATHER_BUDGET // row)   # tokens whose K rows fit
  if per_step >= q.shape[0]:
    out = jax.vmap(attend)((q, seq, pos))
  else:
    out = lax.map(attend, (q, seq, pos), batch_size=per_step)
  return jnp.where(live[:, None, None], out, 0).astype(q.dtype)


def _token_positions(cu_q_lens, kv_lens, num_seqs, num_tokens):
  """Per packed token: its sequence, its position in that sequence's cache,
  and whether it is a live query (not padding). Entries of cu_q_lens past
  num_seqs may hold anything."""
  slots = jnp.arange(kv_lens.shape[0])
  live_slot = slots < num_seqs                                    # [S]
  tok = jnp.arange(num_tokens)                                    # [T]
  ends_before = (cu_q_lens[1:][None, :] <= tok[:, None]) & live_slot[None, :]
  seq = jnp.sum(ends_before, axis=1)                              # [T]
  live = tok < cu_q_lens[num_seqs]
  seq = jnp.where(live, seq, 0)
  q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
  pos = kv_lens[seq] - q_len + (tok - cu_q_lens[seq])
  return seq, pos, live


def _attend_one(q_t, k_pages, v_pages, pages, kv_len, pos, window, sm_scale,
                scales):
  """q_t [Hq, D] at cache position pos of a sequence whose pages are
  `pages` [P] -> [Hq, D] in float32. scales: (k, v) f32 [KVH] each, what
  one stored element of a head stands for (ones for a float pool)."""
  kvh, _, ps, d = k_pages.shape
  hq = q_t.shape[0]
  k_scale, v_scale = (s_[:, None, None] for s_ in scales)
  k, v = k_pages[:, pages], v_pages[:, pages]                    # [KVH, P, ps, D]
  if k.dtype == jnp.uint8:   # an fp8 pool's bytes: the e4m3 elements
    k = lax.bitcast_convert_type(k, jnp.float8_e4m3fn)
    v = lax.bitcast_convert_type(v, jnp.float8_e4m3fn)
  k = k.reshape(kvh, -1, d).astype(jnp.float32) * k_scale        # [KVH, K, D]
  v = v.reshape(kvh, -1, d).astype(jnp.float32) * v_scale
  key_pos = jnp.arange(k.shape[1])                               # [K]
  visible = (key_pos <= pos) & (key_pos < kv_len)
  visible &= (window <= 0) | (key_pos > pos - window)
  qg = q_t.astype(jnp.float32).reshape(kvh, hq // kvh, d)        # [KVH, G, D]
  scores = jnp.einsum("hgd,hkd->hgk", qg, k,
                      precision=lax.Precision.HIGHEST) * sm_scale
  scores = jnp.where(visible, scores, -jnp.inf)
  top = jnp.max(scores, axis=-1, keepdims=True)
  weights = jnp.where(visible, jnp.exp(scores - top), 0.0)       # [KVH, G, K]
  v = jnp.where(visible[None, :, None], v, 0.0)   # free slots may hold NaN
  out = jnp.einsum("hgk,hkd->hgd", weights, v,
                   precision=lax.Precision.HIGHEST)
  total = jnp.sum(weights, axis=-1, keepdims=True)
  return (out / jnp.where(total > 0, total, 1.0)).reshape(hq, d)


def matmul_reference(x, w, *, transpose_w=False, out_dtype=None):
  """x [M, K] @ w [K, N] (w [N, K] with transpose_w) -> [M, N] in out_dtype
  (default x's): both operands widened to float32, one dot at full
  precision; the oracle of `batch_invariant_matmul` (no tiles, no loop)."""
  w32 = w.astype(jnp.float32)
  y = jnp.dot(x.astype(jnp.float32), w32.T if transpose_w else w32,
              precision=lax.Precision.HIGHEST)
  return y.astype(x.dtype if out_dtype is None else out_dtype)
