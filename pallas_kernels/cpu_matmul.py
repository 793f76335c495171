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
can so (`weight_dots.pack_weights`, a `weight_dots.PackedWeight` each).

The model's weight dots call it through `weight_dots.Matmul` when the step asks for
it (`AttentionConfig.native_matmul`, set by the runner with the native CPU
attention). Compiled on first use and registered once per process
(cpu_build.py); `load_cpu_matmul` is False where it can't be built. The
reference is `x @ w`.

Weight-only int8 (`quantize_int8`, the engine's `quantization="int8"`): w as
int8 q [K, N] and a float32 scale per column and run of GROUP_SIZE rows (as
llama.cpp's Q8_0 blocks), scale = the run's max |w| / 127, q = round(w / scale);
the call reads q blocked ([N / 64, K, 64], a quarter of float32's bytes; the
scales blocked alike, [N / 64, K / GROUP_SIZE, 64]) and widens each row to
float32 in registers: y = sum over runs of (x @ q_run) * scale_run, every
product and sum in float32. Its reference is `reference_int8`.

W8A8 (`matmul_w8a8`, the engine's `quantization="w8a8"`): the same int8
blocks, and x quantised too at the call, per row and run of GROUP_SIZE values
(`quantize_rows_int8`), each run's dot an integer sum times both scales, as
llama.cpp's Q8_0 dots: AVX-512 VNNI tiles where built (`vnni()`), else the
float tiles over x's int8 values, to the same bits. Its reference is
`reference_w8a8`.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu_build import build_library, load_target

SOURCE = Path(__file__).with_name("cpu_matmul.cc")
TARGET = "jaxpaged_cpu_matmul"
TARGET_INT8 = "jaxpaged_cpu_matmul_int8"
MIN_ROWS = 17  # [K, N] weights
MAX_ROWS = 128
BLOCK_COLS = 64  # the blocked layout's column blocks (kCols in cpu_matmul.cc)
CHUNK_ROWS = 64  # rows of w a tile walks at a time (kChunk): an int8 scale's run of rows divides it
GROUP_SIZE = 32  # int8: rows of w per scale (SmolLM2, mean KL to float32 per token: per column 0.0061, 64 rows
#                  0.0030, 32 rows 0.0020; docs/kernels.md)


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


def quantize_int8(w, group_size: int = GROUP_SIZE):
  """Weight-only int8, symmetric, on the host: w [..., K, N] (float; numpy or JAX) -> numpy (q int8 [..., K, N],
  scale float32 [..., ceil(K / group_size), N]): one scale per column and run of group_size rows of w (the last
  run may be shorter), the run's max |w| / 127 (1 for an all-zero run), q = round(w / scale), so each
  |w - q * scale| <= scale / 2. group_size divides 64 (the native call's chunk of rows)."""
  w = np.asarray(w)
  if w.ndim < 2 or not np.issubdtype(w.dtype, np.floating):
    raise ValueError(f"quantize_int8 takes a float w [..., K, N]; got {w.dtype}{list(w.shape)}")
  if group_size < 1 or CHUNK_ROWS % group_size:
    raise ValueError(f"quantize_int8: group_size={group_size} must divide {CHUNK_ROWS}")
  *lead, k, n = w.shape
  groups = -(-k // group_size)
  padded = w
  if k % group_size:  # a short last run: zero rows, which change no max
    padded = np.zeros((*lead, groups * group_size, n), w.dtype)
    padded[..., :k, :] = w
  runs = padded.reshape(*lead, groups, group_size, n)
  amax = np.abs(runs).max(axis=-2).astype(np.float32)  # [..., groups, N]
  scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
  q = runs / scale[..., None, :]  # one float temporary, rounded and clipped in place
  np.clip(np.rint(q, out=q), -127, 127, out=q)
  q = q.astype(np.int8)
  return q.reshape(padded.shape)[..., :k, :], scale


def dequantize_int8(q, scale):
  """quantize_int8's values as float32: q [..., K, N] times its runs' scales [..., ceil(K / G), N]."""
  k = q.shape[-2]
  group = _group_size(k, scale.shape[-2])
  return q.astype(jnp.float32) * jnp.repeat(scale, group, axis=-2)[..., :k, :]


def reference_int8(x, q, scale):
  """The int8 product as written: x [M, K] @ (q [K, N] widened, times its runs' scales [ceil(K / G), N])."""
  return x @ dequantize_int8(q, scale)


def quantize_rows_int8(x, group_size: int):
  """x [M, K] float32 as `matmul_w8a8` quantises it: per row and run of group_size values (the weights' runs;
  the last may be shorter), d = the run's max |x| / 127 (as max * (1 / 127) in float32), q = round(x * (1 / d))
  to nearest even (0 where d = 0) -> (q [M, K] int8, d [M, ceil(K / G)])."""
  x = jnp.asarray(x, jnp.float32)
  m, k = x.shape
  runs = -(-k // group_size)
  padded = jnp.pad(x, ((0, 0), (0, runs * group_size - k))).reshape(m, runs, group_size)
  d = jnp.abs(padded).max(axis=-1) * (np.float32(1) / np.float32(127))  # [M, runs]
  inv = jnp.where(d > 0, 1 / jnp.where(d > 0, d, 1), 0)
  q = jnp.round(padded * inv[..., None]).astype(jnp.int8)  # |q| <= 127; jnp.round: half to even
  return q.reshape(m, runs * group_size)[:, :k], d


def reference_w8a8(x, q, scale):
  """The int8 product with x quantised too (W8A8): each run of G rows of w (G from scale's shape) meets the
  same run of x's values, quantised per row (quantize_rows_int8); their integer dot times both scales,
  summed over runs: y [M, N] = sum_g d_x[:, g] * scale[g] * (x_q[:, run g] @ q[run g])."""
  k = q.shape[-2]
  group = _group_size(k, scale.shape[-2])
  xq, d = quantize_rows_int8(x, group)
  runs = scale.shape[-2]
  pad = runs * group - k
  xr = jnp.pad(xq, ((0, 0), (0, pad))).reshape(xq.shape[0], runs, group)
  qr = jnp.pad(jnp.asarray(q), ((0, pad), (0, 0))).reshape(runs, group, q.shape[-1])
  sums = jnp.einsum("mgk,gkn->mgn", xr, qr, preferred_element_type=jnp.int32)  # exact
  return jnp.einsum("mgn,mg,gn->mn", sums.astype(jnp.float32), d, scale)


def vnni(extra_flags: tuple[str, ...] = ()) -> bool:
  """Whether the call built with `extra_flags` runs W8A8 products (`matmul_w8a8`) of 2+ rows on AVX-512 VNNI
  integer dots; elsewhere its float tiles compute the same integer sums (exact in float32), so the results are
  equal to the bit, only slower (there slower than weight-only int8 too)."""
  lib = ctypes.cdll.LoadLibrary(str(build_library(SOURCE, extra_flags=extra_flags)))
  return bool(lib.JaxpagedCpuMatmulVnni())


def _group_size(k: int, groups: int) -> int:
  """The run length G (a power of two dividing 64) of scales for ceil(K / G) = groups runs (one run: any G >= K
  computes alike; 64 is used)."""
  for group in (64, 32, 16, 8, 4, 2, 1):
    if -(-k // group) == groups:
      return group
  raise ValueError(f"int8 scales: {groups} runs of rows fit no run length dividing {CHUNK_ROWS} for K = {k}")


def load_cpu_matmul() -> bool:
  """Builds and registers the FFI targets (float32 and int8 weights) once per process; False if it can't."""
  return load_target(SOURCE, "JaxpagedCpuMatmul", TARGET) and load_target(SOURCE, "JaxpagedCpuMatmulInt8",
                                                                          TARGET_INT8)


def supports(x, w, any_rows: bool = False) -> bool:
  """Whether the native call takes x [M, K] @ w (static): w [K, N] for MIN_ROWS <= M <= MAX_ROWS (any
  M >= 1 with any_rows: the call computes any M, and each row's sums in one order whatever M is, which
  batch-invariant mode needs of its unblockable dots; outside the range XLA's dots are the faster ones), or
  blocked [N / 64, K, 64] (`block_weight`), or blocked layers stacked [L, N / 64, K, 64] (with a layer
  index), for any M >= 1; float32."""
  if x.ndim != 2 or x.dtype != jnp.float32 or w.dtype != jnp.float32 or x.shape[0] < 1:
    return False
  if w.ndim in (3, 4):
    return w.shape[-2] == x.shape[1] and w.shape[-1] == BLOCK_COLS
  return (w.ndim == 2 and x.shape[1] == w.shape[0]
          and (any_rows or MIN_ROWS <= x.shape[0] <= MAX_ROWS))


def matmul_cpu(x, w, layer=None, scale=None, rows=None, any_rows=False):
  """x [M, K] @ w -> f32 [M, N]: w [K, N], blocked [N / 64, K, 64], or stacked [L, N / 64, K, 64] read
  at `layer` (an int32 scalar, traced or not; required then, clamped to [0, L)) in place
  (`load_cpu_matmul()` must have returned True). With `scale`, w is `quantize_int8`'s int8 q blocked (or
  stacked) and scale its float32 scales blocked alike, [(L,) N / 64, ceil(K / G), 64]: reference_int8.
  rows (an int32 scalar, traced or not; None: M): only x's first `rows` rows are computed (clamped to
  [0, M]; a padded step's real tokens), y's rows from there on are zeros. any_rows: w [K, N] at any M
  (`supports`). Each row of y is summed over K in one order (chunk by chunk of w, 64 rows a chunk,
  sequentially within one), the same at every M: the product is batch-invariant."""
  if scale is not None:
    return _matmul_int8(x, w, layer, scale, rows)
  if not supports(x, w, any_rows):
    raise ValueError(f"native CPU matmul takes float32 x [M, K] and w [K, N] "
                     f"({MIN_ROWS} <= M <= {MAX_ROWS}), blocked [N / "
                     f"{BLOCK_COLS}, K, {BLOCK_COLS}] or stacked [L, N / {BLOCK_COLS}, K, {BLOCK_COLS}] "
                     f"(any M); got x {x.dtype}{list(x.shape)}, w {w.dtype}{list(w.shape)}.")
  _check_layer("native CPU matmul", "w", w, layer)
  n = w.shape[-3] * BLOCK_COLS if w.ndim >= 3 else w.shape[1]
  out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
  return jax.ffi.ffi_call(TARGET, out)(x, w, *_scalars(x, layer, rows))


def row_sums_cpu(x):
  """x [..., K] float32 -> its sums over K [..., 1] as the native call's product with a block of ones: each
  row summed in one fixed order (`matmul_cpu`) whatever the number of rows, which XLA:CPU's reductions are
  not (batch-invariant mode's norms)."""
  k = x.shape[-1]
  ones = jnp.ones((1, k, BLOCK_COLS), jnp.float32)  # [N / 64, K, 64]: one column block
  y = matmul_cpu(x.reshape(-1, k).astype(jnp.float32), ones)
  return y[:, :1].reshape(*x.shape[:-1], 1)


def _scalars(x, layer, rows) -> tuple[jax.Array, jax.Array]:
  """The calls' int32 scalar operands: the layer index (0 without a stack) and the rows computed."""
  index = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(())
  return index, jnp.asarray(x.shape[0] if rows is None else rows, jnp.int32).reshape(())


def _check_layer(call: str, name: str, w, layer) -> None:
  if (w.ndim == 4) != (layer is not None):
    raise ValueError(f"{call}: a layer index goes with stacked {name} [L, N / {BLOCK_COLS}, K, {BLOCK_COLS}] only; "
                     f"got {name} {list(w.shape)}, layer {layer!r}")


def matmul_w8a8(x, q, layer, scale, rows=None):
  """matmul_cpu over int8 weights (q and scale as there) with x quantised too, per row and run of G values (the
  weights' runs; `quantize_rows_int8`), each run's integer dot times both scales: reference_w8a8 (llama.cpp's
  Q8_0 dots). AVX-512 VNNI integer dots where built (`vnni()`), else the float tiles, to the same bits; a row's
  result does not depend on the other rows."""
  if scale is None:
    raise ValueError("matmul_w8a8 takes int8 weights with their scales (quantize_int8, blocked)")
  return _matmul_int8(x, q, layer, scale, rows, activations=True)


def _matmul_int8(x, q, layer, scale, rows, activations=False):
  blocked = q.ndim in (3, 4) and q.shape[-1] == BLOCK_COLS
  ok = (x.ndim == 2 and x.dtype == jnp.float32 and x.shape[0] >= 1 and q.dtype == jnp.int8 and blocked
        and q.shape[-2] == x.shape[1] and scale.dtype == jnp.float32 and scale.ndim == q.ndim
        and scale.shape[:-2] == q.shape[:-2] and scale.shape[-1] == BLOCK_COLS)
  if not ok:
    raise ValueError(f"native CPU int8 matmul takes float32 x [M, K] (M >= 1), int8 q [N / {BLOCK_COLS}, K, "
                     f"{BLOCK_COLS}] with float32 scales [N / {BLOCK_COLS}, ceil(K / G), {BLOCK_COLS}] (`block_weight` "
                     f"of quantize_int8's q and scale), or both stacked on a leading L axis; got x "
                     f"{x.dtype}{list(x.shape)}, q {q.dtype}{list(q.shape)}, scale {scale.dtype}{list(scale.shape)}")
  _check_layer("native CPU int8 matmul", "q", q, layer)
  group = _group_size(q.shape[-2], scale.shape[-2])
  out = jax.ShapeDtypeStruct((x.shape[0], q.shape[-3] * BLOCK_COLS), jnp.float32)
  return jax.ffi.ffi_call(TARGET_INT8, out)(x, q, scale, *_scalars(x, layer, rows), group=np.int64(group),
                                            activations=bool(activations))
