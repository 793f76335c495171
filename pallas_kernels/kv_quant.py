"""The fp8 KV pool's number format, shared by the KV writer and every attention path.

An fp8 pool holds each key/value element x of KV head h as e = saturate(x /
scale[h]) in e4m3 (float8_e4m3fn: 3 mantissa bits, largest finite 448, no
infinities), and e stands for e * scale[h]. k_scale and v_scale are float32
[KVH]: one per KV head of the layer being written or read (a per-tensor scale
is the same value KVH times). Values beyond 448 * scale are clamped to
+-448 * scale (saturated), never turned into NaN as a plain cast would.

The pool arrays hold the e4m3 elements as their bytes (dtype uint8, POOL_DTYPE):
XLA:CPU converts a whole float8 array around every scatter into it, gather
from it and even a bitcast of it (a 184 MB pool: 1.1 s per KV write, against
0.02 ms for bytes), while a bitcast of the few rows a step writes or reads is
free. Every reader and writer turns bytes into e4m3 (`as_fp8`) only on the
rows it touches. Float pools (bf16/f16/f32) take no scales.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)    # the number format
POOL_DTYPE = jnp.dtype(jnp.uint8)           # how an fp8 pool is held
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)   # 448


def is_fp8_pool(dtype) -> bool:
  """Whether a pool of this dtype holds e4m3 bytes (an fp8 pool)."""
  return jnp.dtype(dtype) == POOL_DTYPE


def as_fp8(pool_bytes):
  """uint8 rows of an fp8 pool -> the same bits as float8_e4m3fn (free)."""
  return lax.bitcast_convert_type(pool_bytes, FP8_DTYPE)


def quantize(x, scale):
  """x [T, KVH, D] (any float), scale f32 [KVH] -> uint8 [T, KVH, D]: the
  bytes of x / scale rounded to nearest e4m3, saturated at +-FP8_MAX (NaN
  stays NaN)."""
  y = x.astype(jnp.float32) / scale.astype(jnp.float32)[None, :, None]
  y = jnp.clip(y, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
  return lax.bitcast_convert_type(y, POOL_DTYPE)


def check_scales(pool_dtype, kvh: int, k_scale, v_scale, who: str) -> None:
  """An fp8 pool (uint8 bytes) needs k_scale and v_scale float32 [KVH]; a
  float pool none. Raises ValueError naming `who` (the entry point) and the
  offending value. Shapes and dtypes only (static): the values are checked
  where the scales are made (jaxpaged/worker/kv_scales.py)."""
  if not is_fp8_pool(pool_dtype):
    if k_scale is not None or v_scale is not None:
      raise ValueError(f"{who}: k_scale/v_scale are for an fp8 pool (e4m3 "
                       f"bytes, uint8); this pool is {jnp.dtype(pool_dtype)}.")
    return
  for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
    if s is None:
      raise ValueError(f"{who}: an fp8 pool (e4m3 bytes, uint8) needs {name}, "
                       f"float32 [{kvh}] (one per KV head).")
    if tuple(s.shape) != (kvh,) or jnp.dtype(s.dtype) != jnp.float32:
      raise ValueError(f"{who}: {name} must be float32 [{kvh}] (one per KV "
                       f"head), got {jnp.dtype(s.dtype)}{list(s.shape)}.")
