"""RoPE's cos / sin tables of a step on the CPU, as a native XLA FFI call (cpu_rope.cc).

cos, sin f32[U, T, D] of positions i32[T] under U sets of inverse frequencies f32[U, D/2] (a model with
windowed layers has two RoPE bases): the angle float32(position) * inv_freq, as `reference_rope_tables`
(XLA's ops) forms it, its cosine and sine in double rounded to float32 (XLA:CPU's float32 ones are within
a few ulp of them). The point is the call boundary: XLA:CPU sinks the cosines of one table into every
layer's RoPE fusion and evaluates them once per head there (at 32 decode rows, SmolLM2: ~3 ms of a ~54 ms
step); the call's result is computed once and read. Compiled on first use and registered once per process
(cpu_build.py); `load_cpu_rope` is False where it can't be built.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels.cpu_build import load_target

SOURCE = Path(__file__).with_name("cpu_rope.cc")
TARGET = "jaxpaged_cpu_rope_tables"


def load_cpu_rope() -> bool:
  """Builds and registers the FFI target once per process; False if it can't."""
  return load_target(SOURCE, "JaxpagedCpuRopeTables", TARGET)


def _check(positions, inv_freq) -> None:
  if positions.ndim != 1 or not jnp.issubdtype(positions.dtype, jnp.integer):
    raise ValueError(f"positions must be integer [T], got {positions.dtype}{list(positions.shape)}")
  if inv_freq.ndim != 2 or inv_freq.dtype != jnp.float32:
    raise ValueError(f"inv_freq must be float32 [U, D/2], got {inv_freq.dtype}{list(inv_freq.shape)}")


def rope_tables_cpu(positions, inv_freq):
  """(cos, sin) f32[U, T, D] (D = 2 x inv_freq's last axis) of positions i32[T] and inv_freq f32[U, D/2];
  jit-traceable; `load_cpu_rope()` must have returned True."""
  _check(positions, inv_freq)
  if not load_cpu_rope():
    raise RuntimeError("the native CPU RoPE kernel is not built here (load_cpu_rope() is False)")
  (u, half), t = inv_freq.shape, positions.shape[0]
  out = jax.ShapeDtypeStruct((u, t, 2 * half), jnp.float32)
  cos, sin = jax.ffi.ffi_call(TARGET, (out, out))(positions.astype(jnp.int32), inv_freq)
  return cos, sin


def reference_rope_tables(positions, inv_freq):
  """`rope_tables_cpu` in XLA ops (readable; float32 cosines)."""
  _check(positions, inv_freq)
  freqs = positions.astype(jnp.float32)[None, :, None] * inv_freq[:, None, :]  # f32[U, T, D/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)  # f32[U, T, D]
  return jnp.cos(emb), jnp.sin(emb)
