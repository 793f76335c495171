"""Compile Pallas-Triton kernels for a CUDA GPU on a machine without one.

`lower(...).as_text()` only proves that Pallas produced Triton IR (TTIR).
Whether that IR survives Triton's own pipeline (TTIR -> TTGIR -> LLVM -> PTX
-> cubin), and how much shared memory and how many registers the result
needs, is only known once Triton compiles it -- which XLA normally does on
the GPU. This module does it offline:

1. lower the jitted function for CUDA (on JAX >= 0.11 under an abstract
   H200 device, since no real GPU is there to ask for a compute capability),
2. capture the TTIR text of every `pallas_call` as Pallas lowers it,
3. compile each with the open-source `triton` package for `sm_90` and read
   registers and local memory (spills) off the cubin with `cuobjdump`.

XLA bundles its own Triton build, so this is a close proxy, not the exact
compiler the GPU runs. It is a development and test tool: serving never
imports it, and it needs the `triton` package (a test dependency).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import subprocess
import tempfile

import jax

# Hopper: 227 KiB of shared memory per block (opt-in maximum), 255 registers.
H200 = dict(device_kind="NVIDIA H200", num_cores=132, arch=90)
MAX_SHARED_BYTES = 232_448
# Hopper (sm_90) per-SM limits, for the occupancy calculation.
REGS_PER_SM, SMEM_PER_SM, MAX_WARPS_PER_SM, MAX_BLOCKS_PER_SM = (
    65536, 233_472, 64, 32)
SMEM_RESERVED_PER_BLOCK = 1024


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
  """One pallas_call compiled for a CUDA target."""
  name: str
  num_warps: int
  num_stages: int
  shared_bytes: int        # static shared memory the kernel needs per block
  registers: int           # per thread
  spill_bytes: int         # local memory per thread (register spills)
  ttir: str
  ttgir: str               # after Triton's GPU passes (layouts, pipelining)

  def blocks_per_sm(self) -> int:
    """Resident blocks per SM, as the CUDA occupancy calculator counts them
    (the lowest of the register, shared-memory, warp and block limits)."""
    regs_per_warp = math.ceil(self.registers * 32 / 256) * 256
    by_regs = REGS_PER_SM // (regs_per_warp * self.num_warps)
    by_smem = SMEM_PER_SM // (self.shared_bytes + SMEM_RESERVED_PER_BLOCK)
    return min(by_regs, by_smem, MAX_WARPS_PER_SM // self.num_warps,
               MAX_BLOCKS_PER_SM)

  def load_buffers(self) -> list[tuple[int, ...]]:
    """Shapes of the multi-buffered shared-memory tiles Triton's software
    pipeliner allocated for `cp.async` loads: [buffers, rows, cols] each."""
    return [tuple(map(int, m.group(1).split("x")))
            for m in _PIPELINE_BUFFER.finditer(self.ttgir)]


def _abstract_gpu_mesh(device_kind: str, num_cores: int):
  """A 1-device abstract mesh naming a GPU, for JAX versions that need one."""
  sharding = jax.sharding
  dev = sharding.AbstractDevice(device_kind=device_kind, num_cores=num_cores,
                                platform="gpu")
  return sharding.AbstractMesh((1,), ("_gpu",),
                               axis_types=(sharding.AxisType.Explicit,),
                               abstract_device=dev)


@contextlib.contextmanager
def _capture_ttir(out: list):
  """Records the TTIR text of each pallas_call Pallas lowers for Triton."""
  # Private hook: the only place the Triton module exists as text.
  from jax._src.pallas.triton import pallas_call_registration as reg
  original = reg.lowering.lower_jaxpr_to_triton_module

  def spy(*args, **kwargs):
    result = original(*args, **kwargs)
    out.append(result.module.operation.get_asm(enable_debug_info=False))
    return result

  reg.lowering.lower_jaxpr_to_triton_module = spy
  try:
    yield
  finally:
    reg.lowering.lower_jaxpr_to_triton_module = original


_CALL = "custom_call @__gpu$xla.gpu.triton"
# An empty (to be filled by async copies), mutable 3-D shared allocation.
_PIPELINE_BUFFER = re.compile(
    r"ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+x\d+x\d+)x\w+, [^>]*mutable>")


def _int_attr(cfg: str, key: str) -> int:
  m = re.search(rf"\b{key} = (\d+) : i32", cfg)
  if not m:
    raise ValueError(f"no {key} in a Triton custom call: {cfg[:200]}")
  return int(m.group(1))


def gpu_target(device=H200):
  """Context under which lowering for CUDA needs no GPU on this host (e.g. a
  whole engine step: `ModelRunner.lower(step, platforms=("cuda",))`)."""
  return _gpu_target(device)


def _gpu_target(device):
  """Context under which lowering for CUDA needs no GPU on this host."""
  if jax.__version_info__ < (0, 11):    # falls back to sm_90 by itself
    return contextlib.nullcontext()
  return jax.sharding.use_abstract_mesh(
      _abstract_gpu_mesh(device["device_kind"], device["num_cores"]))


def lower_for_cuda(fn, *args, device=H200, **kwargs) -> str:
  """StableHLO text of `jax.jit(fn)(*args, **kwargs)` lowered for CUDA.

  args/kwargs may be `jax.ShapeDtypeStruct`s.
  """
  with _gpu_target(device):
    return jax.jit(fn).trace(*args, **kwargs).lower(
        lowering_platforms=("cuda",)).as_text()


def lower_to_ttir(fn, *args, device=H200, **kwargs):
  """Lowers `fn` for CUDA; returns [(ttir_text, num_warps, num_stages)] for
  each pallas_call, in program order."""
  ttirs: list[str] = []
  with _capture_ttir(ttirs):
    text = lower_for_cuda(fn, *args, device=device, **kwargs)
  cfgs = text.split(_CALL)[1:]    # each call's attributes follow its name
  if len(cfgs) != len(ttirs):
    raise RuntimeError(f"found {len(cfgs)} Triton custom calls but captured "
                       f"{len(ttirs)} Triton modules")
  return [(ir, _int_attr(c, "num_warps"), _int_attr(c, "num_stages"))
          for ir, c in zip(ttirs, cfgs)]


def _resource_usage(cubin: bytes) -> tuple[int, int]:
  """(registers per thread, local-memory bytes per thread) of a cubin.

  Local memory is where ptxas spills registers (and puts arrays it cannot
  keep in registers); anything above 0 is a slow path.
  """
  from triton import knobs
  tool = os.path.join(os.path.dirname(knobs.nvidia.ptxas.path), "cuobjdump")
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "k.cubin")
    with open(path, "wb") as f:
      f.write(cubin)
    res = subprocess.run([tool, "--dump-resource-usage", path],
                         capture_output=True, text=True, check=False)
  usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)",
                    res.stdout)
  if res.returncode or not usage:
    raise RuntimeError(f"cuobjdump failed ({res.returncode}): "
                       f"{res.stdout}{res.stderr}")
  regs, stack, local = map(int, usage.groups())
  return regs, max(stack, local)


def compile_ttir(ttir: str, num_warps: int, num_stages: int,
                 arch: int = H200["arch"]) -> CompiledKernel:
  """Compiles one TTIR module to a cubin with the `triton` package."""
  import triton
  from triton.backends.compiler import GPUTarget
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "kernel.ttir")
    with open(path, "w") as f:
      f.write(ttir)
    kernel = triton.compile(
        path, target=GPUTarget("cuda", arch, 32),
        options={"num_warps": num_warps, "num_stages": num_stages,
                 "enable_fp_fusion": True})   # as XLA's Triton does
  regs, spills = _resource_usage(kernel.asm["cubin"])
  return CompiledKernel(name=kernel.metadata.name, num_warps=num_warps,
                        num_stages=num_stages,
                        shared_bytes=int(kernel.metadata.shared),
                        registers=regs, spill_bytes=spills, ttir=ttir,
                        ttgir=kernel.asm["ttgir"])


def compile_for_cuda(fn, *args, device=H200, **kwargs):
  """Lowers `fn` for CUDA and compiles each of its Pallas kernels to sm_XX."""
  return [compile_ttir(ir, w, s, arch=device["arch"])
          for ir, w, s in lower_to_ttir(fn, *args, device=device, **kwargs)]
