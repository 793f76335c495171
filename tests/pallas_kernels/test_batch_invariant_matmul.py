"""The batch-invariant GEMM (pallas_kernels/batch_invariant_matmul.py): against the reference, each row's
bits independent of the batch, its bad inputs, and its build for an H200 (sm_90) from this CPU."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cuda_compile
from pallas_kernels.batch_invariant_matmul import (GemmTiles, batch_invariant_matmul, gemm_tiles,
                                                   row_sums)
from pallas_kernels.reference import matmul_reference

SDS = jax.ShapeDtypeStruct


@pytest.fixture(scope="module")
def triton_available(kernel_mode):
  """As tests/pallas_kernels/test_cuda_compile.py: Triton is a test dependency (missing it fails); on a GPU
  the kernel is compiled for real, so the offline proxy is skipped."""
  if kernel_mode == "gpu":
    pytest.skip("--kernel-mode=gpu compiles the kernel for real")
  import triton  # noqa: F401  pylint: disable=import-outside-toplevel


def _operands(m, k, n, dtype, transpose_w, seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(m, k)), dtype)
  w = jnp.asarray(rng.normal(size=(n, k) if transpose_w else (k, n)) / np.sqrt(k), dtype)
  return x, w


def _bits(a):
  a = np.asarray(a)
  return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


# (M, K, N): tile multiples, and tails of M, K and N (64-row, 64/32-deep, 64-wide tiles)
SHAPES = [(1, 64, 64), (5, 80, 200), (37, 100, 70), (64, 128, 128), (130, 96, 48), (3, 576, 17)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("transpose_w", [False, True], ids=["kn", "nk"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"m{m}k{k}n{n}" for m, k, n in SHAPES])
def test_matches_reference(shape, transpose_w, dtype, interpret):
  m, k, n = shape
  x, w = _operands(m, k, n, dtype, transpose_w)
  got = batch_invariant_matmul(x, w, transpose_w=transpose_w, out_dtype=jnp.float32, interpret=interpret)
  want = matmul_reference(x, w, transpose_w=transpose_w, out_dtype=jnp.float32)
  assert got.shape == (m, n) and got.dtype == jnp.float32
  # exact products in interpret mode (only the order of the sums differs); compiled for a GPU, f32 runs as TF32
  # and the tensor cores' bf16 accumulation is not IEEE f32 to the last bit
  tol = 1e-5 if interpret else 1e-2 if dtype == jnp.float32 else 1e-4
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)
  default = batch_invariant_matmul(x, w, transpose_w=transpose_w, interpret=interpret)
  assert default.dtype == dtype   # x's dtype unless asked: the f32 sums rounded once
  np.testing.assert_array_equal(_bits(default), _bits(got.astype(dtype)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("transpose_w", [False, True], ids=["kn", "nk"])
def test_rows_are_batch_invariant(dtype, transpose_w, interpret):
  """Each of four rows alone (M = 1) and placed among random rows of an M = 37 and an M = 300 call (other
  positions in their tiles, other tiles): the same bits."""
  k, n = 200, 136   # tails in K and N too
  x, w = _operands(4, k, n, dtype, transpose_w, seed=1)
  rng = np.random.default_rng(2)
  mm = functools.partial(batch_invariant_matmul, w=w, transpose_w=transpose_w, interpret=interpret)
  alone = [mm(x[r:r + 1])[0] for r in range(4)]
  for m, places in ((37, (0, 17, 35, 36)), (300, (5, 64, 200, 299))):
    batch = jnp.asarray(rng.normal(size=(m, k)), dtype).at[jnp.asarray(places)].set(x)
    y = mm(batch)
    for r, place in enumerate(places):
      np.testing.assert_array_equal(_bits(y[place]), _bits(alone[r]), err_msg=f"row {r} at {place} of {m}")


def test_row_sums_are_exact_sums_and_batch_invariant(interpret):
  rng = np.random.default_rng(3)
  y = jnp.asarray(rng.normal(size=(2, 9, 96)), jnp.float32)
  s = row_sums(y, interpret=interpret)
  assert s.shape == (2, 9, 1)
  np.testing.assert_allclose(np.asarray(s)[..., 0], np.asarray(y, np.float64).sum(-1), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(_bits(row_sums(y[1, 4:5], interpret=interpret)), _bits(s[1, 4:5]))


def test_empty_operands():
  x, w = _operands(0, 32, 48, jnp.float32, False)
  assert batch_invariant_matmul(x, w, interpret=True).shape == (0, 48)
  x, w = _operands(3, 0, 48, jnp.float32, False)
  assert not np.any(np.asarray(batch_invariant_matmul(x, w, interpret=True)))


@pytest.mark.parametrize("x, w, kw, match", [
    (SDS((4, 8, 2), jnp.float32), SDS((2, 16), jnp.float32), {}, "x \\[M, K\\] and a 2-D w"),
    (SDS((4, 8), jnp.float32), SDS((8, 16), jnp.bfloat16), {}, "one dtype among"),
    (SDS((4, 8), jnp.int8), SDS((8, 16), jnp.int8), {}, "quantized weights are not supported"),
    (SDS((4, 8), jnp.float32), SDS((9, 16), jnp.float32), {}, "disagree on K"),
    (SDS((4, 8), jnp.float32), SDS((8, 16), jnp.float32), {"transpose_w": True}, "as \\[N, K\\]"),
    (SDS((4, 1 << 16), jnp.bfloat16), SDS((1 << 16, 1 << 15), jnp.bfloat16), {}, "int32 offsets"),
])
def test_bad_operands_are_refused(x, w, kw, match):
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(functools.partial(batch_invariant_matmul, **kw), x, w)


def test_tiles_are_powers_of_two():
  with pytest.raises(ValueError, match="power of two >= 16"):
    GemmTiles(block_m=48, block_n=64, block_k=64, num_warps=4, num_stages=3)
  assert gemm_tiles(jnp.bfloat16, 4096) == GemmTiles(64, 64, 64, 4, 3)
  assert gemm_tiles(jnp.float32, 16).block_n == 16 and gemm_tiles(jnp.float32, 16).block_k == 32


# ----------------------------------------------------------------------------- built for CUDA on this CPU


def _dots(ttir: str) -> list[str]:
  return [line.strip() for line in ttir.splitlines() if "tt.dot " in line]


# (M, K, N, transpose_w): Llama-3-8B's wqkv at a decode step and w_down at a prefill chunk, SmolLM2's tied
# LM head ([V, E]) at a decode step
CUDA_SHAPES = {"decode_wqkv": (8, 4096, 6144, False), "prefill_w_down": (2048, 14336, 4096, False),
               "decode_tied_head": (8, 576, 49152, True)}


def test_one_tiling_for_every_row_count():
  """Lowered for CUDA, a product of 1 row and one of 2048 run the same kernel (the tiling in its name), its
  dot on the same tile shapes: only the grid grows."""
  tiles = set()
  for m in (1, 2048):
    [(ttir, num_warps, num_stages)] = cuda_compile.lower_to_ttir(
        batch_invariant_matmul, SDS((m, 4096), jnp.bfloat16), SDS((4096, 4096), jnp.bfloat16))
    [dot] = _dots(ttir)
    tiles.add((re.search(r"module @(\w+)", ttir).group(1), dot.split(":", 1)[1], num_warps, num_stages))
  assert tiles == {("batch_invariant_matmul_m64_n64_k64",
                    " tensor<64x64xbf16> * tensor<64x64xbf16> -> tensor<64x64xf32>", 4, 3)}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("case", list(CUDA_SHAPES))
def test_compiles_for_sm90(case, dtype, triton_available):
  """Through Triton's own pipeline to an sm_90 cubin: within Hopper's shared memory, no register spills,
  on the warpgroup MMA (MMAv3) for 16-bit inputs."""
  m, k, n, transpose_w = CUDA_SHAPES[case]
  w = SDS((n, k) if transpose_w else (k, n), dtype)
  kernels = cuda_compile.compile_for_cuda(functools.partial(batch_invariant_matmul, transpose_w=transpose_w),
                                          SDS((m, k), dtype), w)
  assert len(kernels) == 1
  kernel = kernels[0]
  assert kernel.shared_bytes <= cuda_compile.MAX_SHARED_BYTES, kernel
  assert kernel.spill_bytes == 0, f"{kernel.name} spills {kernel.spill_bytes} B/thread"
  assert 0 < kernel.registers <= 255
  if dtype == jnp.bfloat16:
    assert "versionMajor = 3" in kernel.ttgir


def test_row_sums_compile_for_sm90(triton_available):
  """The norms' row sums are IEEE f32 dots (Triton's default; a plain f32 product is TF32, as XLA's f32 GPU
  dots are) and fit without spills."""
  [(ttir, num_warps, num_stages)] = cuda_compile.lower_to_ttir(row_sums, SDS((64, 4096), jnp.bfloat16))
  assert cuda_compile.compile_ttir(ttir, num_warps, num_stages).spill_bytes == 0
  sums = _dots(ttir)
  plain = _dots(cuda_compile.lower_to_ttir(batch_invariant_matmul, SDS((64, 4096), jnp.float32),
                                           SDS((4096, 64), jnp.float32))[0][0])
  assert len(sums) == 1 and "xf32>" in sums[0] and "inputPrecision" not in sums[0], sums
  assert len(plain) == 1 and "inputPrecision = tf32" in plain[0], plain
