"""The Pallas kernel built for an H200 (sm_90) on a machine with no GPU.

Lowering for CUDA catches Pallas -> Triton IR errors; compiling that IR with
the `triton` package (TTIR -> PTX -> cubin) catches what Triton's own passes
reject and checks the kernel's resources: shared memory within Hopper's
per-block limit, no register spills. XLA compiles with its own Triton build,
so this is a proxy; `scripts/gpu_check.sh` is the real thing.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import cuda_compile
from pallas_kernels import ragged_paged_attention

MODEL_SHAPES = {"smollm2_135m": (9, 3, 64), "llama3_8b": (32, 8, 128)}
PATHS = {  # name: (T, S, P, num_splits)
    "decode": (64, 64, 128, 1),
    "decode_split": (8, 8, 512, 8),
    "prefill": (512, 4, 128, 1),
    "mixed": (260, 8, 64, None),
}


@pytest.fixture(scope="module")
def triton_available(kernel_mode):
  """Triton is a test dependency: missing it fails CI. On a GPU the kernel
  tests compile with XLA's own Triton, so the offline proxy is not run."""
  if kernel_mode == "gpu":
    pytest.skip("--kernel-mode=gpu compiles the kernel for real")
  import triton  # noqa: F401  pylint: disable=import-outside-toplevel


def _attention_args(hq, kvh, d, t, s, p, *, dtype=jnp.bfloat16,
                    page_size=16, layers=None, windowed=False):
  """windowed: a traced int32 sliding window (as a scan over layers picks)."""
  sds = jax.ShapeDtypeStruct
  pool = (kvh, 256, page_size, d)
  pool = pool if layers is None else (layers,) + pool
  args = (sds((t, hq, d), dtype), sds(pool, dtype), sds(pool, dtype),
          sds((s,), jnp.int32), sds((s, p), jnp.int32),
          sds((s + 1,), jnp.int32), sds((), jnp.int32))
  kw = {} if layers is None else {"layer": sds((), jnp.int32)}
  if windowed:
    kw["sliding_window"] = sds((), jnp.int32)
  return args, kw


def _attention(d, num_splits):
  return functools.partial(ragged_paged_attention, sm_scale=d ** -0.5,
                           backend="pallas", num_splits=num_splits)


def _check_resources(kernels):
  assert kernels, "no Pallas kernel in the lowered function"
  for k in kernels:
    assert k.shared_bytes <= cuda_compile.MAX_SHARED_BYTES, k
    assert k.spill_bytes == 0, f"{k.name} spills {k.spill_bytes} B/thread"
    assert 0 < k.registers <= 255, k


@pytest.mark.parametrize("model", list(MODEL_SHAPES))
@pytest.mark.parametrize("path", list(PATHS))
def test_lowers_for_cuda(model, path):
  hq, kvh, d = MODEL_SHAPES[model]
  t, s, p, ns = PATHS[path]
  args, kw = _attention_args(hq, kvh, d, t, s, p)
  text = cuda_compile.lower_for_cuda(_attention(d, ns), *args, **kw)
  assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("model", list(MODEL_SHAPES))
@pytest.mark.parametrize("path", list(PATHS))
def test_compiles_for_sm90(model, path, triton_available):
  hq, kvh, d = MODEL_SHAPES[model]
  t, s, p, ns = PATHS[path]
  args, kw = _attention_args(hq, kvh, d, t, s, p)
  kernels = cuda_compile.compile_for_cuda(_attention(d, ns), *args, **kw)
  _check_resources(kernels)
  if t > s:   # room for prefill chunks: decode and prefill tilings
    assert [k.name.split("_")[3] for k in kernels] == ["r16", "r128"]
  else:
    splits = 8 if path == "decode_split" else 1
    assert [k.name.split("_")[-1] for k in kernels] == [f"s{splits}"]


@pytest.mark.parametrize("page_size", [32, 64])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_compiles_for_sm90_page_sizes_and_dtypes(page_size, dtype, path,
                                                 triton_available):
  t, s, p, ns = PATHS[path]
  args, kw = _attention_args(32, 8, 128, t, s, p // (page_size // 16),
                             dtype=dtype, page_size=page_size)
  _check_resources(cuda_compile.compile_for_cuda(_attention(128, ns), *args,
                                                 **kw))


def test_compiles_for_sm90_layer_stacked(triton_available):
  args, kw = _attention_args(32, 8, 128, 64, 64, 128, layers=4)
  kernels = cuda_compile.compile_for_cuda(_attention(128, 1), *args, **kw)
  _check_resources(kernels)


def test_lower_to_ttir_pairs_each_call_with_its_config():
  """Two kernels with different tilings in one function keep their own
  num_warps (the config is read per custom call, in program order)."""
  a, _ = _attention_args(32, 8, 128, 64, 64, 128)
  b, _ = _attention_args(32, 8, 128, 512, 4, 128)

  def two(qa, ka, va, la, pa, ca, na, qb, kb, vb, lb, pb, cb, nb):
    sm = 128 ** -0.5
    x = ragged_paged_attention(qa, ka, va, la, pa, ca, na, sm_scale=sm,
                               backend="pallas", num_warps=4)
    y = ragged_paged_attention(qb, kb, vb, lb, pb, cb, nb, sm_scale=sm,
                               backend="pallas", num_warps=8)
    return x, y

  found = cuda_compile.lower_to_ttir(two, *a, *b)
  assert [w for _, w, _ in found] == [4, 8, 8]   # b is split in two calls
  assert all("tt.func" in ir for ir, _, _ in found)


def test_decode_pipeline_keeps_page_loads_in_flight(triton_available):
  """Decode at Llama-3-8B shape: Triton's pipeliner gives the K and V page
  gathers 3 shared-memory buffers each (3 blocks in flight while the current
  block's dots run), and 4 programs still fit on an SM. A reshape or a mask
  between a gather and its dot silently drops this to one buffer, and each
  block's loads then wait for the previous block's compute (docs/kernels.md)."""
  t, s, p, ns = PATHS["decode"]
  args, kw = _attention_args(32, 8, 128, t, s, p)
  kernel, = cuda_compile.compile_for_cuda(_attention(128, ns), *args, **kw)
  assert kernel.num_stages == 4 and kernel.num_warps == 4
  assert kernel.load_buffers() == [(3, 32, 128), (3, 32, 128)]
  assert kernel.blocks_per_sm() == 4


def test_prefill_pipeline_keeps_the_next_block_in_flight(triton_available):
  """Prefill tiles at Llama-3-8B shape (wgmma dots, which read shared memory
  asynchronously): 3 stages give 3 buffers a tensor, and the loop's wait
  leaves the next block's copies (2 groups: K and V) in flight. At 2 stages it
  waited for every copy before each block's dots."""
  t, s, p, ns = PATHS["prefill"]
  args, kw = _attention_args(32, 8, 128, t, s, p)
  decode, prefill = cuda_compile.compile_for_cuda(_attention(128, ns), *args,
                                                  **kw)
  assert prefill.num_stages == 3 and prefill.num_warps == 8
  assert prefill.load_buffers() == [(3, 64, 128), (3, 64, 128)]
  waits = [int(n) for n in re.findall(r"async_wait [^{]*\{num = (\d+)",
                                      prefill.ttgir)]
  assert waits and max(waits) >= 2, waits
  assert prefill.blocks_per_sm() == 1 and decode.blocks_per_sm() == 4


@pytest.mark.parametrize("path", list(PATHS))
def test_lowers_for_cuda_with_a_traced_window(path):
  t, s, p, ns = PATHS[path]
  args, kw = _attention_args(9, 3, 64, t, s, p, windowed=True, layers=2)
  text = cuda_compile.lower_for_cuda(_attention(64, ns), *args, **kw)
  assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("model", list(MODEL_SHAPES))
@pytest.mark.parametrize("path", list(PATHS))
def test_compiles_for_sm90_with_a_traced_window(model, path,
                                                triton_available):
  """The windowed kernel (masked blocks on both sides of the pipelined
  loop) fits Hopper's shared memory with no spills, in the same calls."""
  hq, kvh, d = MODEL_SHAPES[model]
  t, s, p, ns = PATHS[path]
  args, kw = _attention_args(hq, kvh, d, t, s, p, windowed=True)
  kernels = cuda_compile.compile_for_cuda(_attention(d, ns), *args, **kw)
  _check_resources(kernels)
  plain = _attention_args(hq, kvh, d, t, s, p)
  assert [k.name for k in kernels] == [
      k.name for k in cuda_compile.compile_for_cuda(_attention(d, ns), *plain[0],
                                                    **plain[1])]


def test_windowed_decode_keeps_its_pipeline(triton_available):
  """The window's masked first block runs before the pipelined loop, so the
  loop keeps its 3 K and 3 V buffers and 4 programs an SM (as without)."""
  t, s, p, ns = PATHS["decode"]
  args, kw = _attention_args(32, 8, 128, t, s, p, windowed=True, layers=4)
  kernel, = cuda_compile.compile_for_cuda(_attention(128, ns), *args, **kw)
  assert kernel.load_buffers() == [(3, 32, 128), (3, 32, 128)]
  assert kernel.blocks_per_sm() == 4
  prefill_args, kw = _attention_args(32, 8, 128, *PATHS["prefill"][:3],
                                     windowed=True)
  _, prefill = cuda_compile.compile_for_cuda(_attention(128, 1),
                                             *prefill_args, **kw)
  assert prefill.load_buffers() == [(3, 64, 128), (3, 64, 128)]
  assert prefill.blocks_per_sm() == 1


def _fp8_args(hq, kvh, d, t, s, p, **kw):
  """_attention_args with an fp8 pool: e4m3 bytes (uint8) and the layer's
  k_scale, v_scale f32 [KVH]."""
  (q, k, v, *rest), kwargs = _attention_args(hq, kvh, d, t, s, p, **kw)
  sds = jax.ShapeDtypeStruct
  pool = sds(k.shape, jnp.uint8)
  kwargs.update(k_scale=sds((kvh,), jnp.float32), v_scale=sds((kvh,), jnp.float32))
  return (q, pool, pool, *rest), kwargs


@pytest.mark.parametrize("path", list(PATHS))
def test_fp8_pool_lowers_for_cuda(path):
  t, s, p, ns = PATHS[path]
  args, kw = _fp8_args(32, 8, 128, t, s, p, layers=2)
  text = cuda_compile.lower_for_cuda(_attention(128, ns), *args, **kw)
  assert "__gpu$xla.gpu.triton" in text


@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_fp8_pool_compiles_for_sm90(path, triton_available):
  """e4m3 pages (Llama-3-8B shape): the kernel reads bytes and widens them to
  bf16 in registers (an fp8 -> bf16 conversion in the TTIR); same calls,
  Hopper's limits, and the decode keeps its 3-deep pipeline of K and V page
  loads, now a byte an element."""
  t, s, p, ns = PATHS[path]
  args, kw = _fp8_args(32, 8, 128, t, s, p)
  kernels = cuda_compile.compile_for_cuda(_attention(128, ns), *args, **kw)
  _check_resources(kernels)
  plain = _attention_args(32, 8, 128, t, s, p)
  assert [k.name for k in kernels] == [
      k.name for k in cuda_compile.compile_for_cuda(_attention(128, ns),
                                                    *plain[0], **plain[1])]
  assert all("f8E4M3FN" in k.ttir for k in kernels), "no e4m3 in the kernel"
  if path == "decode":
    assert kernels[0].load_buffers() == [(3, 32, 128), (3, 32, 128)]
