"""Native XLA:CPU kernels: compile a C++ source on first use and register it as an FFI target.

The CPU kernels (cpu_attention.cc, cpu_matmul.cc) are XLA FFI handlers. Each
is compiled with the system's C++ compiler against the installed jaxlib's FFI
headers into `~/.cache/jaxpaged/cpu_kernels/` (one shared object per source,
jaxlib, compiler, flags and CPU: `-march=native` builds are not portable),
then registered with XLA once per process. Without a compiler `load_target`
returns False and callers keep their XLA path.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import jax
import jaxlib

logger = logging.getLogger(__name__)

# -ffast-math's parts that let reductions vectorise, not the flag itself: with it GCC links
# crtfastmath.o, which turns on flush-to-zero for the whole process when the library loads.
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math",
         "-fassociative-math", "-fno-signed-zeros", "-freciprocal-math",
         "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC")


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


def build_library(source: Path, cache_dir: Path | None = None,
                  extra_flags: tuple[str, ...] = ()) -> Path:
  """Compiles `source` (once per source and the headers beside it, jaxlib,
  compiler, flags and CPU) -> .so path. `extra_flags` follow FLAGS (tests
  build the other vector widths with them, e.g. "-mno-avx512f").

  Raises RuntimeError (no compiler) or subprocess.CalledProcessError."""
  compiler = shutil.which("g++") or shutil.which("c++")
  if compiler is None:
    raise RuntimeError("no C++ compiler (g++ / c++) on PATH")
  headers = [h.read_bytes() for h in sorted(source.parent.glob("*.h"))]  # cpu_pool.h
  key = hashlib.sha256(b"\0".join([
      source.read_bytes(), *headers, jaxlib.__version__.encode(),
      compiler.encode(), " ".join(FLAGS + tuple(extra_flags)).encode(),
      _cpu_tag().encode()])).hexdigest()[:16]
  cache_dir = cache_dir or default_kernel_cache_dir()
  lib = cache_dir / f"{source.stem}-{key}.so"
  if lib.exists():
    return lib
  cache_dir.mkdir(parents=True, exist_ok=True)
  # One build per library: a second builder (a thread or a process; each open
  # is its own lock holder) waits here for the first, then finds the library.
  lock_path = cache_dir / f"{lib.name}.lock"
  with open(lock_path, "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if lib.exists():
      return lib
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
      out = Path(tmp) / lib.name
      cmd = [compiler, *FLAGS, *extra_flags, f"-I{jax.ffi.include_dir()}",
             str(source), "-o", str(out)]
      subprocess.run(cmd, check=True, capture_output=True, text=True)
      os.replace(out, lib)   # atomic: a reader never sees half a library
    lock_path.unlink()  # whoever opens it from now on finds the library first
  return lib


def build_in_background(sources: Sequence[Path],
                        cache_dir: Path | None = None) -> threading.Thread:
  """Starts `build_library(source)` (default flags) for each source in turn,
  on a daemon thread, and returns it. A cold start's compiles (seconds each)
  then run beside the caller's work (one compiler at a time: the caller keeps
  a core), not on its thread when each kernel is first asked for; list the
  sources in the order they will be. `load_target` waits on a build in flight
  (its lock) and reports any error itself, so this thread ignores them."""
  def build() -> None:
    for source in sources:
      try:
        build_library(source, cache_dir)
      except (RuntimeError, OSError, subprocess.CalledProcessError):
        pass  # load_target builds again and warns
  thread = threading.Thread(target=build, daemon=True, name="jaxpaged-kernel-builds")
  thread.start()
  return thread


@functools.cache
def load_target(source: Path, symbol: str, target: str,
                extra_flags: tuple[str, ...] = ()) -> bool:
  """Builds `source` and registers its handler `symbol` as the CPU FFI target
  `target`, once per process; False (with a warning) if it can't be built."""
  try:
    lib = ctypes.cdll.LoadLibrary(str(build_library(source, extra_flags=extra_flags)))
  except (RuntimeError, OSError, subprocess.CalledProcessError) as err:
    detail = getattr(err, "stderr", "") or err
    logger.warning("native CPU kernel %s unavailable, using the XLA path: %s",
                   source.name, str(detail)[-2000:])
    return False
  jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)),
                              platform="cpu")
  return True
