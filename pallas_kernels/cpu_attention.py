"""Ragged paged attention on the CPU as a native XLA FFI call (cpu_attention.cc).

The XLA path (xla_attention.py) gathers every K/V block into a copy before
its two dots, because XLA:CPU fuses no gather into a library dot: each K/V
byte is read, written and read again. This call reads the pool in place:
per (sequence, KV head), one pass over the keys for the scores, one over V,
split across XLA's intra-op threads. Decodes are bound by reading the pool;
a prefill chunk's queries find their keys in cache. With AVX-512 (AVX2), a
sequence's several query tokens (prefill chunks, draft verifications) run in
tiles of up to 16 (8) rows (tokens x heads of a KV head's group), each key
read once for all of a tile's rows, the tiles spread over the threads: with
AVX-512, 2,048 tokens of SmolLM2 prefill 2.3x faster, 8 tokens at context 500
1.65x (cpu_attention.cc, TileOps::kMinRows; docs/kernels.md).

The C++ source is compiled on first use and registered with XLA once per
process (cpu_build.py). Without a compiler `load_cpu_attention` returns
False and callers keep the XLA path.

Same contract as `ragged_paged_attention`, float32 queries over a float32 pool
or an fp8 one (e4m3 bytes with per-KV-head scales, kv_quant.py: a second FFI
target of the same library, which turns the rows it reads into floats). The
reference is `reference.ragged_paged_attention_reference`.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu_build import load_target
from pallas_kernels.kv_quant import is_fp8_pool

SOURCE = Path(__file__).with_name("cpu_attention.cc")
TARGET = "jaxpaged_cpu_attention"
TARGET_FP8 = "jaxpaged_cpu_attention_fp8"


def load_cpu_attention() -> bool:
  """Builds and registers the FFI targets (float and fp8 pools) once per
  process; False if it can't be built here (the caller then keeps the XLA
  path)."""
  return (load_target(SOURCE, "JaxpagedCpuAttention", TARGET)
          and load_target(SOURCE, "JaxpagedCpuAttentionFp8", TARGET_FP8))


MAX_HEAD_DIM = 256   # kMaxHeadDim in the C++ (64, 128 and 256 compiled as constants)
MAX_GROUP = 16       # query heads per KV head (kMaxGroup in the C++)


def supports(q, k_pages) -> bool:
  """Whether the native call takes these shapes and dtypes (static)."""
  kvh, d = k_pages.shape[-4], q.shape[-1]
  return (q.dtype == jnp.float32
          and (k_pages.dtype == jnp.float32 or is_fp8_pool(k_pages.dtype))
          and d <= MAX_HEAD_DIM and q.shape[1] % kvh == 0
          and q.shape[1] // kvh <= MAX_GROUP)


def ragged_paged_attention_cpu(q, k_pages, v_pages, kv_lens, page_table,
                               cu_q_lens, num_seqs, *, sm_scale, layer=None,
                               sliding_window=None, k_scale=None,
                               v_scale=None, query_tiles=True):
  """The native call (un-jitted, unvalidated; `load_cpu_attention()` must
  have returned True). q [T, Hq, D] f32 with Hq / KVH <= 16 and D <= 256;
  pool [KVH, N, ps, D] or [L, KVH, N, ps, D] with `layer`, float32 or e4m3
  bytes with k_scale, v_scale f32 [KVH] -> f32 [T, Hq, D].
  query_tiles=False: every query token attends on its own, so its result is
  the same to the bit whatever its sequence's q_len (batch-invariant mode; a
  tile's rows sum in another order)."""
  if not supports(q, k_pages):
    raise ValueError(f"native CPU attention takes float32 (or fp8) pools, "
                     f"float32 queries, head_dim <= "
                     f"{MAX_HEAD_DIM} and <= {MAX_GROUP} query heads per KV "
                     f"head; got q {q.dtype}{list(q.shape)}, pool "
                     f"{k_pages.dtype}{list(k_pages.shape)}.")
  scalar = lambda x, default: jnp.asarray(
      default if x is None else x, jnp.int32).reshape(())
  out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
  tail = (kv_lens, page_table, cu_q_lens, scalar(num_seqs, 0),
          scalar(layer, 0), scalar(sliding_window, 0))
  attrs = dict(sm_scale=np.float32(sm_scale), query_tiles=bool(query_tiles))
  if is_fp8_pool(k_pages.dtype):
    return jax.ffi.ffi_call(TARGET_FP8, out)(
        q, k_pages, v_pages, k_scale, v_scale, *tail, **attrs)
  return jax.ffi.ffi_call(TARGET, out)(q, k_pages, v_pages, *tail, **attrs)
