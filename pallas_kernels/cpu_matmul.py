"""Matmul on the CPU for a decode step's rows, as a native XLA FFI call (cpu_matmul.cc).

y [M, N] = x [M, K] @ w [K, N] in float32 for MIN_ROWS <= M <= MAX_ROWS: the
T = 32 bucket (17-32 decodes) and its LM head, and the T = 64 and 128 buckets
(mixed steps, shorter prefills). XLA:CPU gives those dots to
YNNPACK (model_runner.cpu_compiler_options: steps above 16 tokens), which
packs w on every call; this call reads w in place with 6 x 64 register
tiles (AVX-512; four 6 x 16 tiles with AVX2, eight 6 x 8 tiles of GCC's
generic vectors elsewhere), 64 rows of w at a time, prefetching the next 64
while it computes.
A bare stack of SmolLM2's dots (30 layers and the LM head, quiet 2-core
machine): 32 rows XLA 37 ms, this 27.6-27.9 (without the prefetching chunks
31.9); 24 rows 31.2 -> 21.1; 64 rows 61-63 -> 48-50; 128 rows 102-112 -> 89-92
(a 128-token step's forward 103 -> 88 ms); 256 rows both ~190 (YNNPACK stays
there: row blocks that keep x in L2 did not help). For [K, N] weights
outside that range XLA's dots stay: up to 16 rows they match this (16 rows
19.9 vs 19.2, 4 rows 16.6 vs 16.4, 1 row 13.0 vs 16.9), and at 256 rows
YNNPACK's packing pays for itself.

With w blocked ([N / 64, K, 64], `block_weight`: each column block one
contiguous run) it takes any row count and matches or beats XLA's dots at
every one (the stack above: 1 row 12.5 vs XLA's 12.5, and 8.8 in a run
where the VM's memory ran faster; 4 rows 16.0 -> 13.4, 32 rows 24.3,
128 rows 100 -> 83, 256 rows 185 -> 175): the runner holds the weights it
can so (`llama.pack_weights`, a `llama.PackedWeight` each).

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
MIN_ROWS = 17  # [K, N] weights
MAX_ROWS = 128
BLOCK_COLS = 64  # the blocked layout's column blocks (kCols in cpu_matmul.cc)


def block_weight(w):
  """w [K, N] (N a multiple of 64) -> [N / 64, K, 64]: each 64-column block one contiguous run, the
  layout `matmul_cpu` streams fastest (the runner's `pack_weights` holds the weight dots' weights so);
  stacked layers w [L, K, N] -> [L, N / 64, K, 64]. A jax.Array gives a jax.Array; a numpy array gives
  a (strided) numpy view, for the host to copy."""
  if w.ndim not in (2, 3) or w.shape[-1] % BLOCK_COLS:
    raise ValueError(f"block_weight takes w [K, N] or [L, K, N] with N a multiple of {BLOCK_COLS}; "
                     f"got {list(w.shape)}")
  return w.reshape(*w.shape[:-1], w.shape[-1] // BLOCK_COLS, BLOCK_COLS).swapaxes(-3, -2)


def blockable(w) -> bool:
  """Whether `block_weight` takes w and the native call reads the result: f32 [K, N] or [L, K, N],
  N % 64 == 0."""
  return w.ndim in (2, 3) and w.shape[-1] % BLOCK_COLS == 0 and w.shape[-1] > 0 and w.dtype == jnp.float32


def load_cpu_matmul() -> bool:
  """Builds and registers the FFI target once per process; False if it can't."""
  return load_target(SOURCE, "JaxpagedCpuMatmul", TARGET)


def supports(x, w) -> bool:
  """Whether the native call takes x [M, K] @ w (static): w [K, N] for MIN_ROWS <= M <= MAX_ROWS, or
  blocked [N / 64, K, 64] (`block_weight`), or blocked layers stacked [L, N / 64, K, 64] (with a layer
  index), for any M >= 1; float32."""
  if x.ndim != 2 or x.dtype != jnp.float32 or w.dtype != jnp.float32 or x.shape[0] < 1:
    return False
  if w.ndim in (3, 4):
    return w.shape[-2] == x.shape[1] and w.shape[-1] == BLOCK_COLS
  return (w.ndim == 2 and x.shape[1] == w.shape[0]
          and MIN_ROWS <= x.shape[0] <= MAX_ROWS)


def matmul_cpu(x, w, layer=None):
  """x [M, K] @ w -> f32 [M, N]: w [K, N], blocked [N / 64, K, 64], or stacked [L, N / 64, K, 64] read
  at `layer` (an int32 scalar, traced or not; required then, clamped to [0, L)) in place
  (`load_cpu_matmul()` must have returned True)."""
  if not supports(x, w):
    raise ValueError(f"native CPU matmul takes float32 x [M, K] and w [K, N] "
                     f"({MIN_ROWS} <= M <= {MAX_ROWS}), blocked [N / "
                     f"{BLOCK_COLS}, K, {BLOCK_COLS}] or stacked [L, N / {BLOCK_COLS}, K, {BLOCK_COLS}] "
                     f"(any M); got x {x.dtype}{list(x.shape)}, w {w.dtype}{list(w.shape)}.")
  if (w.ndim == 4) != (layer is not None):
    raise ValueError(f"native CPU matmul: a layer index goes with stacked w [L, N / {BLOCK_COLS}, K, "
                     f"{BLOCK_COLS}] only; got w {list(w.shape)}, layer {layer!r}")
  n = w.shape[-3] * BLOCK_COLS if w.ndim >= 3 else w.shape[1]
  out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
  index = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(())
  return jax.ffi.ffi_call(TARGET, out)(x, w, index)
