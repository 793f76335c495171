"""Scatter a step's new keys/values into the paged KV pool.

Pool layout (per layer):   k_pages, v_pages: [KVH, N, page_size, D]
Layer-stacked pool:        k_pages, v_pages: [L, KVH, N, page_size, D]

A token's slot is `page * page_size + offset`. Page 0 is the null page:
padding tokens carry a slot inside page 0, so every write stays in bounds.
An fp8 pool (e4m3 bytes, uint8) stores each value divided by its KV head's
scale, saturated (kv_quant.py); k_scale/v_scale f32 [KVH] are then required.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels import kv_quant

_POOL_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, kv_quant.POOL_DTYPE)


def _check_write_args(k_pages, v_pages, k_new, v_new, slot_mapping, layer,
                      k_scale=None, v_scale=None):
  """Raises ValueError naming the offending value; returns (KVH, N, ps, D)."""
  if k_pages.shape != v_pages.shape or k_pages.dtype != v_pages.dtype:
    raise ValueError(
        f"k_pages {k_pages.shape}/{k_pages.dtype} and v_pages "
        f"{v_pages.shape}/{v_pages.dtype} must match in shape and dtype.")
  if k_pages.ndim not in (4, 5):
    raise ValueError(
        "k_pages must be [KVH, N, page_size, D] or [L, KVH, N, page_size, D],"
        f" got shape {k_pages.shape}.")
  if k_pages.dtype not in _POOL_DTYPES:
    raise ValueError(f"Unsupported pool dtype {k_pages.dtype}.")
  if (k_pages.ndim == 5) != (layer is not None):
    raise ValueError(
        f"layer must be given iff the pool is layer-stacked (5-D); got "
        f"pool ndim {k_pages.ndim} and layer={layer!r}.")
  kvh, _, _, d = k_pages.shape[-4:]
  kv_quant.check_scales(k_pages.dtype, kvh, k_scale, v_scale, "write_kv")
  if k_new.ndim != 3 or k_new.shape[1:] != (kvh, d):
    raise ValueError(
        f"k_new must be [T, {kvh}, {d}] to match the pool, got {k_new.shape}.")
  if v_new.shape != k_new.shape:
    raise ValueError(f"v_new {v_new.shape} must match k_new {k_new.shape}.")
  if slot_mapping.shape != (k_new.shape[0],):
    raise ValueError(
        f"slot_mapping must be [{k_new.shape[0]}], got {slot_mapping.shape}.")
  if not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
    raise ValueError(f"slot_mapping must be integer, got {slot_mapping.dtype}.")
  return k_pages.shape[-4:]


def write_kv_inner(k_pages, v_pages, k_new, v_new, slot_mapping, layer=None,
                   k_scale=None, v_scale=None):
  """Un-jitted scatter, for use inside a larger jitted (pool-donated) step.

  Args:
    k_pages, v_pages: [KVH, N, ps, D] pool, or [L, KVH, N, ps, D] with `layer`.
    k_new, v_new: [T, KVH, D] the step's new keys/values (cast to pool dtype;
      an fp8 pool's quantized with the scales, saturated).
    slot_mapping: int[T], slot = page * ps + offset (padding -> page 0).
    layer: int32 scalar (may be traced) selecting the layer of a 5-D pool.
    k_scale, v_scale: f32 [KVH], this layer's scales: fp8 pools only.

  Returns:
    (k_pages, v_pages) with the new entries written.
  """
  kvh, n, ps, d = _check_write_args(
      k_pages, v_pages, k_new, v_new, slot_mapping, layer, k_scale, v_scale)
  rows = k_pages.size // d                  # pool viewed as [rows, D]
  if rows >= 2**31:
    raise ValueError(f"Pool with {rows} rows of D={d} overflows int32 slots.")
  layer_idx = jnp.int32(0) if layer is None else jnp.asarray(layer, jnp.int32)
  # row[h, t] = ((layer * KVH + h) * N * ps) + slot[t]          [KVH, T]
  head_base = (layer_idx * kvh + jnp.arange(kvh, dtype=jnp.int32)) * (n * ps)
  row_idx = head_base[:, None] + slot_mapping.astype(jnp.int32)[None, :]

  if kv_quant.is_fp8_pool(k_pages.dtype):
    k_new, v_new = kv_quant.quantize(k_new, k_scale), kv_quant.quantize(
        v_new, v_scale)

  def scatter(pages, new):
    new = jnp.swapaxes(new.astype(pages.dtype), 0, 1)     # [KVH, T, D]
    flat = pages.reshape(rows, d)                         # [L*KVH*N*ps, D]
    flat = flat.at[row_idx].set(new, mode="promise_in_bounds")
    return flat.reshape(pages.shape)

  return scatter(k_pages, k_new), scatter(v_pages, v_new)


write_kv = jax.jit(write_kv_inner, donate_argnums=(0, 1))
write_kv.__doc__ = (
    "Jitted write_kv_inner with the pools donated (updated in place).\n\n"
    + (write_kv_inner.__doc__ or ""))


def write_kv_reference(k_pages, v_pages, k_new, v_new, slot_mapping,
                       layer=None, k_scale=None, v_scale=None):
  """Functional reference: loops over tokens (tests only). An fp8 pool's
  values are quantized here on the host, element by element with numpy and
  ml_dtypes (x / scale, clamped to +-448, rounded to e4m3)."""
  ps = k_pages.shape[-2]
  fp8 = kv_quant.is_fp8_pool(k_pages.dtype)

  def stored(x, scale):   # [KVH, D] -> the pool's values
    if not fp8:
      return x.astype(k_pages.dtype)
    y = np.asarray(x, np.float32) / np.asarray(scale, np.float32)[:, None]
    return np.clip(y, -448.0, 448.0).astype(ml_dtypes.float8_e4m3fn).view(
        np.uint8)

  for t in range(k_new.shape[0]):
    page, off = int(slot_mapping[t]) // ps, int(slot_mapping[t]) % ps
    idx = (slice(None), page, off) if layer is None else (
        int(layer), slice(None), page, off)
    k_pages = k_pages.at[idx].set(stored(k_new[t], k_scale))
    v_pages = v_pages.at[idx].set(stored(v_new[t], v_scale))
  return k_pages, v_pages
