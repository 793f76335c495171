"""Matmul on the CPU for a decode step's rows, as a native XLA FFI call (cpu_matmul.cc).

y [M, N] = x [M, K] @ w [K, N] in float32 for MIN_ROWS <= M <= MAX_ROWS: the
T = 32 bucket (17-32 decodes) and its LM head, and the T = 64 and 128 buckets
(mixed steps, shorter prefills). XLA:CPU gives those dots to
YNNPACK (model_runner.cpu_compiler_options: steps above 16 tokens), which
packs w on every call; this call reads w in place with 6 x 64 register
tiles, 64 rows of w at a time, prefetching the next 64 while it computes.
A bare stack of SmolLM2's dots (30 layers and the LM head, quiet 2-core
machine): 32 rows XLA 37 ms, this 27.6-27.9 (without the prefetching chunks
31.9); 24 rows 31.2 -> 21.1; 64 rows 61-63 -> 48-50; 128 rows 102-112 -> 89-92
(a 128-token step's forward 103 -> 88 ms); 256 rows both ~190 (YNNPACK stays
there: row blocks that keep x in L2 did not help). Outside that range XLA's dots stay: up to 16
rows the runner compiles XLA's own dots, which this only matches (16 rows
19.9 vs 19.2, 4 rows 16.6 vs 16.4, 1 row 13.0 vs 16.9), and at prefill
sizes YNNPACK's packing pays for itself.

The model's weight dots call it through `llama.Matmul` when the step asks for
it (`AttentionConfig.native_matmul`, set by the runner with the native CPU
attention). Compiled on first use and registered once per process
(cpu_build.py); `load_cpu_matmul` is False where it can't be built. The
reference is `x @ w`.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels.cpu_build import load_target

SOURCE = Path(__file__).with_name("cpu_matmul.cc")
TARGET = "jaxpaged_cpu_matmul"
MIN_ROWS = 17
MAX_ROWS = 128


def load_cpu_matmul() -> bool:
  """Builds and registers the FFI target once per process; False if it can't."""
  return load_target(SOURCE, "JaxpagedCpuMatmul", TARGET)


def supports(x, w) -> bool:
  """Whether the native call takes x [M, K] @ w [K, N] (static)."""
  return (x.ndim == 2 and w.ndim == 2 and x.shape[1] == w.shape[0]
          and MIN_ROWS <= x.shape[0] <= MAX_ROWS and x.dtype == jnp.float32
          and w.dtype == jnp.float32)


def matmul_cpu(x, w):
  """x [M, K] @ w [K, N] -> f32 [M, N] (`load_cpu_matmul()` must have
  returned True)."""
  if not supports(x, w):
    raise ValueError(f"native CPU matmul takes float32 x [{MIN_ROWS} <= M <= "
                     f"{MAX_ROWS}, K] and w [K, N]; got x {x.dtype}"
                     f"{list(x.shape)}, w {w.dtype}{list(w.shape)}.")
  out = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32)
  return jax.ffi.ffi_call(TARGET, out)(x, w)
