"""Ragged paged attention: one call for a whole continuous batch.

The public entry point: validates its arguments and dispatches to a backend.

  reference.py         the readable oracle (shares no code with the kernels)
  xla_attention.py     blocked online softmax in plain JAX (the CPU fallback)
  cpu_attention.py     a native XLA:CPU FFI call, one pass over each query's keys (the CPU path)
  triton_attention.py  the Pallas kernel, lowered to Triton (the GPU path)
  tiling.py            what both kernels share: planning, tiles, pool rows

KV pool: k_pages, v_pages [KVH, N, ps, D], or [L, KVH, N, ps, D] with a traced
`layer`. Page 0 is the null page (padding slots / padded page-table entries).
Sequence s < num_seqs owns queries cu_q_lens[s]:cu_q_lens[s+1]; they are the
last q_len of its kv_len tokens (bottom-right aligned causal mask), and with a
sliding window W the query at position p sees keys k with p - W < k <= p.
Tokens at index >= cu_q_lens[num_seqs] are padding and produce exact zeros.
An fp8 pool (e4m3 bytes held as uint8, kv_quant.py) is read by every backend
with its per-KV-head k_scale/v_scale; q then stays in its own (float) dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import cpu_attention, kv_quant
from pallas_kernels.reference import ragged_paged_attention_reference
from pallas_kernels.tiling import batch_invariant_tiling
from pallas_kernels.triton_attention import ragged_paged_attention_pallas
from pallas_kernels.xla_attention import ragged_paged_attention_xla

_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16),
           jnp.dtype(jnp.float32))
BACKENDS = ("auto", "reference", "xla", "cpu", "pallas")


@functools.partial(jax.jit, static_argnames=(
    "sm_scale", "backend", "interpret", "block_q", "pages_per_block",
    "num_splits", "num_warps", "num_stages", "max_num_partial_prefills",
    "batch_invariant"))
def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_table,
                           cu_q_lens, num_seqs, *, sm_scale, layer=None,
                           sliding_window=None, k_scale=None, v_scale=None,
                           backend="auto",
                           interpret=False, block_q=None,
                           pages_per_block=None, num_splits=None,
                           num_warps=None, num_stages=None,
                           max_num_partial_prefills=None,
                           batch_invariant=False):
  """Causal attention for a packed, ragged batch over a paged KV pool.

  Args:
    q: [T, Hq, D] packed queries (bf16/fp16/fp32).
    k_pages, v_pages: [KVH, N, ps, D], or [L, KVH, N, ps, D] with `layer`;
      q's dtype, or uint8 (an fp8 pool: e4m3 bytes) with the scales below.
    kv_lens: int32[S] tokens in each sequence's cache, incl. this step's.
    page_table: int32[S, P] page ids per sequence (padded with 0).
    cu_q_lens: int32[S+1] query offsets; seq s owns q[cu[s]:cu[s+1]].
    num_seqs: int32 scalar (traced ok): live sequence slots.
    sm_scale: softmax scale (static float).
    layer: int32 scalar (traced ok) for a layer-stacked pool.
    sliding_window: None (static: no window) or an int32 scalar, traced ok
      (e.g. picked per layer inside a scan); a value <= 0 is no window. With
      W > 0 the query at position p sees keys k with p - W < k <= p (as
      transformers' Mistral and Gemma 3); pages wholly before a query tile's
      window are not read, so they may have been freed.
    k_scale, v_scale: f32 [KVH] (traced ok), an fp8 pool's scales for this
      layer (kv_quant.py): a stored element e of KV head h stands for
      e * scale[h]. None for a float pool.
    backend: "auto" (pallas on GPU, else cpu), "reference" (the readable
      oracle: gathers the whole page-table row per token), "xla" (blocked
      online softmax in plain JAX), "cpu" (the native CPU kernel,
      cpu_attention.py, on a CPU default backend; the XLA path for what it
      does not take, such as bf16, where it cannot be built, or off CPU),
      "pallas".
    interpret: run the Pallas kernel in interpret mode (CPU testing).
    block_q, pages_per_block, num_splits, num_warps, num_stages: tiling
      overrides (see tiling.choose_config); ignored by the reference.
      Without block_q, a batch with T > S runs as two calls (decodes in
      small tiles, prefill chunks in tall ones).
    max_num_partial_prefills: static promise that at most this many
      sequences have more than one query (the scheduler's limit of the same
      name). It bounds the prefill tiles of a T > S batch; sequences beyond
      it would get no output, so callers must enforce it. None: no promise.
    batch_invariant: each query's result the same to the bit whatever else
      is in the batch, however its sequence's queries were chunked and
      whichever (T, S, P) shape runs it: one fixed reduction order per query
      (the native CPU kernel without query tiles; the XLA path and the Pallas
      kernel with `tiling.BATCH_INVARIANT_TILING` and no KV splits, which
      override the tiling arguments).

  Returns:
    [T, Hq, D] in q.dtype; rows of padding tokens are exactly 0.
  """
  _validate(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, layer,
            sliding_window, backend, max_num_partial_prefills)
  kv_quant.check_scales(k_pages.dtype, k_pages.shape[-4], k_scale, v_scale,
                        "ragged_paged_attention")
  if backend == "auto":
    backend = "pallas" if jax.default_backend() == "gpu" else "cpu"
  args = (q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, num_seqs)
  common = dict(sm_scale=float(sm_scale), layer=layer,
                sliding_window=sliding_window, k_scale=k_scale,
                v_scale=v_scale)
  if backend == "reference":
    return ragged_paged_attention_reference(*args, **common)
  tiling = dict(block_q=block_q, pages_per_block=pages_per_block,
                max_num_partial_prefills=max_num_partial_prefills)
  if batch_invariant:
    tiling.update(batch_invariant_tiling(k_pages.shape[-2]))
    num_splits = 1
  if (backend == "cpu" and jax.default_backend() == "cpu"
      and cpu_attention.supports(q, k_pages)
      and cpu_attention.load_cpu_attention()):
    return cpu_attention.ragged_paged_attention_cpu(
        *args, **common, query_tiles=not batch_invariant)
  if backend in ("xla", "cpu"):
    return ragged_paged_attention_xla(*args, **common, **tiling)
  return ragged_paged_attention_pallas(
      *args, **common, **tiling, interpret=interpret, num_splits=num_splits,
      num_warps=num_warps, num_stages=num_stages)


def _check_int_array(name, x, shape):
  if x.shape != shape:
    raise ValueError(f"{name} must have shape {shape}, got {x.shape}.")
  if x.dtype != jnp.int32:
    raise ValueError(f"{name} must be int32, got {x.dtype}.")


def _validate(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens, layer,
              sliding_window, backend, max_num_partial_prefills):
  """Shape/dtype checks with ValueErrors naming the offending values."""
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
  if q.ndim != 3:
    raise ValueError(f"q must be [T, Hq, D], got shape {q.shape}.")
  if q.dtype not in _DTYPES:
    raise ValueError(f"q dtype {q.dtype} not in {[str(x) for x in _DTYPES]}.")
  _validate_pool(q, k_pages, v_pages, layer)
  if page_table.ndim != 2:
    raise ValueError(f"page_table must be [S, P], got {page_table.shape}.")
  s = page_table.shape[0]
  _check_int_array("page_table", page_table, page_table.shape)
  _check_int_array("kv_lens", kv_lens, (s,))
  _check_int_array("cu_q_lens", cu_q_lens, (s + 1,))
  if sliding_window is not None:
    w = jnp.asarray(sliding_window)
    if w.shape != () or not jnp.issubdtype(w.dtype, jnp.integer):
      raise ValueError("sliding_window must be None or an integer scalar, "
                       f"got {w.dtype}{list(w.shape)}.")
  if max_num_partial_prefills is not None and (
      not isinstance(max_num_partial_prefills, int)
      or max_num_partial_prefills < 1):
    raise ValueError("max_num_partial_prefills must be a positive int or "
                     f"None, got {max_num_partial_prefills!r}.")


def _validate_pool(q, k_pages, v_pages, layer):
  if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
    raise ValueError(f"k_pages {k_pages.shape}/{k_pages.dtype} and v_pages "
                     f"{v_pages.shape}/{v_pages.dtype} must match.")
  if k_pages.ndim not in (4, 5):
    raise ValueError("k_pages must be [KVH, N, ps, D] or [L, KVH, N, ps, D], "
                     f"got shape {k_pages.shape}.")
  if (k_pages.ndim == 5) != (layer is not None):
    raise ValueError("layer must be given iff the pool is 5-D; got pool shape "
                     f"{k_pages.shape} and layer={layer!r}.")
  if k_pages.dtype != q.dtype and not kv_quant.is_fp8_pool(k_pages.dtype):
    raise ValueError(f"KV dtype {k_pages.dtype} must equal q dtype {q.dtype} "
                     "(or be uint8: an fp8 pool's e4m3 bytes).")
  kvh, _, _, d = k_pages.shape[-4:]
  if q.shape[2] != d:
    raise ValueError(f"q head_dim {q.shape[2]} != KV head_dim {d}.")
  if q.shape[1] % kvh:
    raise ValueError(f"num q heads {q.shape[1]} not divisible by num kv heads "
                     f"{kvh}.")
