"""Ragged paged attention on the CPU as a native XLA FFI call (cpu_attention.cc).

The XLA path (xla_attention.py) gathers every K/V block into a copy before
its two dots, because XLA:CPU fuses no gather into a library dot: each K/V
byte is read, written and read again. This call reads the pool in place:
per (sequence, KV head), one pass over the keys for the scores, one over V,
split across XLA's intra-op threads. Decodes are bound by reading the pool;
a prefill chunk's queries find their keys in cache.

The C++ source is compiled on first use with the system's C++ compiler
against the installed jaxlib's FFI headers, into
`~/.cache/jaxpaged/cpu_kernels/` (one shared object per source, jaxlib
and CPU), and registered with XLA once per process. Without a compiler,
`load_cpu_attention` returns None and callers keep the XLA path.

Same contract as `ragged_paged_attention`, float32 only. The reference is
`reference.ragged_paged_attention_reference`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_attention.cc")
TARGET = "jaxpaged_cpu_attention"
_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-math-errno", "-std=c++17",
          "-shared", "-fPIC")


def default_kernel_cache_dir() -> Path:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
      os.path.expanduser("~"), ".cache")
  return Path(base) / "jaxpaged" / "cpu_kernels"


def _cpu_tag() -> str:
  """What -march=native depends on: the CPU's model and flags."""
  try:
    text = Path("/proc/cpuinfo").read_text()
  except OSError:
    return platform.processor() or platform.machine()
  keep = [line for line in text.splitlines()
          if line.startswith(("model name", "flags", "cpu family", "model\t"))]
  return "\n".join(sorted(set(keep)))


def build_library(cache_dir: Path | None = None) -> Path:
  """Compiles cpu_attention.cc (once per source, jaxlib and CPU) -> .so path.

  Raises RuntimeError (no compiler) or subprocess.CalledProcessError."""
  compiler = shutil.which("g++") or shutil.which("c++")
  if compiler is None:
    raise RuntimeError("no C++ compiler (g++ / c++) on PATH")
  source = SOURCE.read_bytes()
  key = hashlib.sha256(b"\0".join([
      source, jaxlib.__version__.encode(), compiler.encode(),
      " ".join(_FLAGS).encode(), _cpu_tag().encode()])).hexdigest()[:16]
  cache_dir = cache_dir or default_kernel_cache_dir()
  lib = cache_dir / f"cpu_attention-{key}.so"
  if lib.exists():
    return lib
  cache_dir.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
    out = Path(tmp) / lib.name
    cmd = [compiler, *_FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE),
           "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    os.replace(out, lib)   # atomic: concurrent builders agree on the result
  return lib


@functools.cache
def load_cpu_attention() -> bool:
  """Builds and registers the FFI target once per process; False if it can't
  be built here (the caller then keeps the XLA path)."""
  try:
    lib = ctypes.cdll.LoadLibrary(str(build_library()))
  except (RuntimeError, OSError, subprocess.CalledProcessError) as err:
    detail = getattr(err, "stderr", "") or err
    logger.warning("native CPU attention unavailable, using the XLA path: %s",
                   str(detail)[-2000:])
    return False
  jax.ffi.register_ffi_target(
      TARGET, jax.ffi.pycapsule(lib.JaxpagedCpuAttention), platform="cpu")
  return True


HEAD_DIMS = (64, 128, 256)
MAX_GROUP = 16   # query heads per KV head (kMaxGroup in the C++)


def supports(q, k_pages) -> bool:
  """Whether the native call takes these shapes and dtypes (static)."""
  kvh, d = k_pages.shape[-4], q.shape[-1]
  return (q.dtype == jnp.float32 and k_pages.dtype == jnp.float32
          and d in HEAD_DIMS and q.shape[1] % kvh == 0
          and q.shape[1] // kvh <= MAX_GROUP)


def ragged_paged_attention_cpu(q, k_pages, v_pages, kv_lens, page_table,
                               cu_q_lens, num_seqs, *, sm_scale, layer=None,
                               sliding_window=None):
  """The native call (un-jitted, unvalidated; `load_cpu_attention()` must
  have returned True). q [T, Hq, D] f32 with Hq / KVH <= 16 and D in
  (64, 128, 256); pool [KVH, N, ps, D] or [L, KVH, N, ps, D] with `layer`
  -> f32 [T, Hq, D]."""
  if not supports(q, k_pages):
    raise ValueError(f"native CPU attention takes float32, head_dim in "
                     f"{HEAD_DIMS} and <= {MAX_GROUP} query heads per KV "
                     f"head; got q {q.dtype}{list(q.shape)}, pool "
                     f"{k_pages.dtype}{list(k_pages.shape)}.")
  scalar = lambda x, default: jnp.asarray(
      default if x is None else x, jnp.int32).reshape(())
  call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
  return call(q, k_pages, v_pages, kv_lens, page_table, cu_q_lens,
              scalar(num_seqs, 0), scalar(layer, 0),
              scalar(sliding_window, 0), sm_scale=np.float32(sm_scale))
