"""A batch-invariant GEMM for the GPU: x [M, K] @ w as a Pallas kernel (Triton lowering).

Batch-invariant mode (docs/rl.md) needs each output row's bits to depend on that row alone. XLA's GPU
dots (cuBLAS, its Triton GEMMs) pick their tiles, and split K across programs, by the row count M, so a
row's sums change with what else is in the batch. This kernel fixes every choice that can change a row's
reduction order, whatever M is:

- one tiling per (dtype, N) (`gemm_tiles`): M padded to the row tile, never a different tile for another M;
- the K reduction one sequential loop over BLOCK_K chunks, in one order, accumulated in float32 in the
  program's registers; no split-K, so no partial sums from other programs are ever added in;
- the same instructions for every tile (a tail of K or N is masked, not run by other code), so a row's
  products and sums are the same wherever in its tile, and in whichever tile, it lands.

Tile sizes (`gemm_tiles`; no GPU was lent when they were chosen, so they are reasoned, not measured): a
64 x 64 output tile, K in chunks of 64 (bf16/f16) or 32 (f32), 4 warps, 3 pipeline stages.
Decode (M <= 64) is one row tile: each weight tile is read once, as by any GEMV, and N / 64 programs
(Llama-3-8B: 64 for wo / w_down, 96 for wqkv, 448 for w_gate_up, 2004 for the LM head) keep most of
an H100's / H200's 132 SMs loading; a larger BLOCK_N would leave the 4096-wide dots on a quarter of them.
Prefill: 64 x 64 tiles are the smallest that Triton runs on Hopper's warpgroup MMA (4 warps), and the
weight tile is re-read once per 64 rows, mostly from the 50 MB L2; 128 x 128 tiles would halve those
re-reads but quarter the programs of a decode. 3 stages of (64 x 64 + 64 x 64) bf16 tiles are 48 KiB
of shared memory, well inside Hopper's 227 KiB (tests/pallas_kernels/test_batch_invariant_matmul.py
builds them for sm_90 and checks registers and spills).

f32 inputs run as TF32 on the tensor cores unless `precision=HIGHEST` (XLA's own default for f32 GPU
dots is TF32 too); in interpret mode (CPU tests) f32 is exact. The readable reference:
`reference.matmul_reference`.

Shapes: x [M, K]; w [K, N] (the models' weight dots' 2-D views) or, with transpose_w, [N, K] (a tied
LM head's embedding [V, E]); out [M, N].
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

FLOAT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# Row sums (`row_sums`) as a product with a ones block this wide: Triton's dots take operands >= 16 wide.
_SUM_COLS = 16


@dataclasses.dataclass(frozen=True)
class GemmTiles:
  """One kernel's fixed tiling: output tiles block_m x block_n, K in block_k chunks."""
  block_m: int
  block_n: int
  block_k: int
  num_warps: int
  num_stages: int

  def __post_init__(self):
    for name in ("block_m", "block_n", "block_k"):
      v = getattr(self, name)
      if v < 16 or v & (v - 1):
        raise ValueError(f"GemmTiles.{name}={v} must be a power of two >= 16 (Triton's dot operands)")


def gemm_tiles(dtype, n: int) -> GemmTiles:
  """The tiling of a product with N = n output columns in `dtype`: a function of (dtype, N) only, never of
  M, so a row's reduction order is one whatever the batch (reasons in the module docstring). f32 takes
  K in chunks of 32 (twice the bytes a chunk); an N below 64 (the norms' row sums) takes the narrowest
  tile that covers it."""
  block_n = 64 if n >= 64 else max(16, 1 << (n - 1).bit_length())
  block_k = 32 if jnp.dtype(dtype).itemsize == 4 else 64
  return GemmTiles(block_m=64, block_n=block_n, block_k=block_k, num_warps=4, num_stages=3)


def batch_invariant_matmul(x: jax.Array, w: jax.Array, *, transpose_w: bool = False, out_dtype=None,
                           precision=None, interpret: bool = False) -> jax.Array:
  """x [M, K] @ w [K, N] (or w [N, K] with transpose_w: x @ w.T) -> [M, N] in out_dtype (default x's),
  accumulated in float32; row i's bits depend on x[i] and w only, whatever M is.

  x and w: the same floating dtype (bfloat16, float16 or float32). precision: None (f32 as TF32 on
  the GPU) or lax.Precision.HIGHEST (IEEE f32). interpret: run the kernel in Pallas' interpret mode
  (CPU tests). Raises ValueError on other ranks, dtypes or mismatched K."""
  n = _check_operands(x, w, transpose_w)
  m, k = x.shape
  out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
  if m == 0 or n == 0 or k == 0:   # nothing to compute, or empty sums
    return jnp.zeros((m, n), out_dtype)
  tiles = gemm_tiles(x.dtype, n)
  padded = pl.cdiv(m, tiles.block_m) * tiles.block_m
  if max(padded * k, w.size, padded * n) >= 2**31:   # the kernel's element offsets are int32
    raise ValueError(f"batch_invariant_matmul: x {x.shape} @ w {w.shape} has operands of 2**31 elements or "
                     "more, past the kernel's int32 offsets; split the product")
  xp = jnp.pad(x, ((0, padded - m), (0, 0)))                 # [M', K], M' a multiple of block_m
  out = _pallas_call(xp, w, n=n, tiles=tiles, transpose_w=transpose_w, out_dtype=out_dtype,
                     precision=precision, interpret=interpret)
  return out[:m]


def row_sums(y: jax.Array, *, interpret: bool = False) -> jax.Array:
  """y [..., E] -> its float32 sums over E [..., 1], each row summed in one order at any row count: the
  kernel's product with a ones block at IEEE f32 precision (what the norms of batch-invariant mode take on
  the GPU, `llama.rms_norm(row_sums=...)`). y is read as float32."""
  y32 = y.astype(jnp.float32)
  lead = y32.shape[:-1]
  ones = jnp.ones((y32.shape[-1], _SUM_COLS), jnp.float32)
  s = batch_invariant_matmul(y32.reshape(-1, y32.shape[-1]), ones, precision=lax.Precision.HIGHEST,
                             interpret=interpret)
  return s[:, :1].reshape(*lead, 1)


def _check_operands(x, w, transpose_w: bool) -> int:
  """Validates the operands; returns N."""
  if getattr(x, "ndim", None) != 2 or getattr(w, "ndim", None) != 2:
    raise ValueError(f"batch_invariant_matmul takes x [M, K] and a 2-D w, got shapes "
                     f"{getattr(x, 'shape', None)} and {getattr(w, 'shape', None)}")
  if jnp.dtype(x.dtype) not in map(jnp.dtype, FLOAT_DTYPES) or jnp.dtype(w.dtype) != jnp.dtype(x.dtype):
    raise ValueError(f"batch_invariant_matmul takes x and w of one dtype among bfloat16, float16 and "
                     f"float32, got {x.dtype} and {w.dtype} (quantized weights are not supported)")
  k_w, n = (w.shape[1], w.shape[0]) if transpose_w else w.shape
  if x.shape[1] != k_w:
    layout = "[N, K]" if transpose_w else "[K, N]"
    raise ValueError(f"batch_invariant_matmul: x {x.shape} and w {w.shape} (as {layout}) disagree on K")
  return n


def _pallas_call(x, w, *, n, tiles: GemmTiles, transpose_w, out_dtype, precision, interpret):
  """x [M', K] (M' a multiple of block_m) @ w -> [M', N]: one program per (row tile, column tile),
  whole-array refs that each program slices (so a tail of K or N is a masked load, not a bigger block)."""
  m, k = x.shape
  grid = (m // tiles.block_m, pl.cdiv(n, tiles.block_n))
  kernel = functools.partial(_gemm_kernel, tiles=tiles, k=k, n=n, transpose_w=transpose_w,
                             precision=precision)
  whole = pl.BlockSpec()   # the whole array: each program slices its tiles itself
  return pl.pallas_call(
      kernel, grid=grid, in_specs=[whole, whole], out_specs=pl.BlockSpec(),
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype), interpret=interpret,
      compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
      name=f"batch_invariant_matmul_m{tiles.block_m}_n{tiles.block_n}_k{tiles.block_k}",
  )(x, w)


def _gemm_kernel(x_ref, w_ref, o_ref, *, tiles: GemmTiles, k, n, transpose_w, precision):
  """One program: output tile (i, j) = x[i rows] @ w[:, j cols], K summed chunk by chunk in order.

  x_ref [M', K], w_ref [K, N] or [N, K] (transpose_w), o_ref [M', N]; masks only where K or N is no
  multiple of its block (static), so every tile runs the same instructions."""
  bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
  i, j = pl.program_id(0), pl.program_id(1)
  rows, cols = pl.ds(i * bm, bm), pl.ds(j * bn, bn)
  col_ok = (j * bn + lax.broadcasted_iota(jnp.int32, (1, bn), 1)) < n if n % bn else None   # [1, bn]

  def body(step, acc):
    chunk = pl.ds(step * bk, bk)
    k_ok = (step * bk + lax.broadcasted_iota(jnp.int32, (1, bk), 1)) < k if k % bk else None  # [1, bk]
    xt = _load(x_ref.at[rows, chunk], k_ok)                                       # [bm, bk]
    if transpose_w:
      wt = _load(w_ref.at[cols, chunk], _both(col_ok, k_ok, transpose=True))      # [bn, bk]
      dims = (((1,), (1,)), ((), ()))
    else:
      wt = _load(w_ref.at[chunk, cols], _both(col_ok, k_ok, transpose=False))     # [bk, bn]
      dims = (((1,), (0,)), ((), ()))
    return acc + lax.dot_general(xt, wt, dims, precision=precision, preferred_element_type=jnp.float32)

  acc = lax.fori_loop(0, pl.cdiv(k, bk), body, jnp.zeros((bm, bn), jnp.float32))
  out = acc.astype(o_ref.dtype)
  if col_ok is None:
    o_ref[rows, cols] = out
  else:
    plgpu.store(o_ref.at[rows, cols], out, mask=jnp.broadcast_to(col_ok, (bm, bn)))


def _load(ref, mask):
  """A tile, zeros where the [1, cols]-or-full mask is False (None: no mask)."""
  if mask is None:
    return ref[...]
  return plgpu.load(ref, mask=jnp.broadcast_to(mask, ref.shape), other=0)


def _both(col_ok, k_ok, *, transpose: bool):
  """The weight tile's mask from the column mask [1, bn] and the K mask [1, bk]: [bn, bk] (transpose) or
  [bk, bn]; None where neither applies."""
  if col_ok is None and k_ok is None:
    return None
  if transpose:
    c = jnp.ones((1, 1), bool) if col_ok is None else col_ok.reshape(-1, 1)       # [bn, 1]
    kk = jnp.ones((1, 1), bool) if k_ok is None else k_ok                         # [1, bk]
  else:
    c = jnp.ones((1, 1), bool) if col_ok is None else col_ok                      # [1, bn]
    kk = jnp.ones((1, 1), bool) if k_ok is None else k_ok.reshape(-1, 1)          # [bk, 1]
  return c & kk
