"""The native CPU attention kernel (cpu_attention.cc): its build, its fallbacks, bad inputs.

Its numerics against the float64 oracle run with every other backend in
test_ragged_paged_attention.py (backend "cpu")."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_attention, cpu_build, ragged_paged_attention
from pallas_kernels.reference import ragged_paged_attention_reference

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the native kernel is XLA:CPU's")


def _batch(rng, q_lens, kv_lens, *, kvh=3, group=3, d=64, ps=16, layers=None, pages=None):
  s = len(q_lens)
  p = max(-(-k // ps) for k in kv_lens) + 1
  n = pages or s * p + 1
  pool = (kvh, n, ps, d) if layers is None else (layers, kvh, n, ps, d)
  k = rng.standard_normal(pool, np.float32)
  v = rng.standard_normal(pool, np.float32)
  table = rng.permutation(np.arange(1, n))[:s * p].reshape(s, p).astype(np.int32)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  q = rng.standard_normal((int(cu[-1]) + 2, kvh * group, d), np.float32)
  return [jnp.asarray(x) for x in (q, k, v, np.asarray(kv_lens, np.int32), table, cu)] + [jnp.int32(s)]


def test_the_library_is_built_once_per_source_and_reused(tmp_path):
  first = cpu_build.build_library(cpu_attention.SOURCE, tmp_path)
  stamp = first.stat().st_mtime_ns
  assert cpu_build.build_library(cpu_attention.SOURCE, tmp_path) == first
  assert first.stat().st_mtime_ns == stamp
  assert [x.name for x in tmp_path.iterdir()] == [first.name]  # no temporary folder left


def test_loading_the_kernels_keeps_subnormal_floats():
  """The build must not link GCC's crtfastmath.o (-ffast-math does): it would turn on flush-to-zero for
  the whole process when the library loads, changing every float computation in it."""
  from pallas_kernels import cpu_matmul
  assert cpu_attention.load_cpu_attention() and cpu_matmul.load_cpu_matmul()
  tiny = np.float32(np.finfo(np.float32).tiny)
  assert tiny / np.float32(4) > 0


def test_no_compiler_is_a_clear_error_and_the_xla_path_stays(monkeypatch, tmp_path):
  monkeypatch.setattr(cpu_build.shutil, "which", lambda name: None)
  with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
    cpu_build.build_library(cpu_attention.SOURCE, tmp_path)


def test_the_default_cpu_backend_is_the_native_kernel():
  assert cpu_attention.load_cpu_attention()  # CI has g++: losing the kernel must fail here
  args = _batch(np.random.default_rng(0), [1, 3], [20, 3])
  lowered = jax.jit(functools.partial(ragged_paged_attention, sm_scale=0.125)).lower(*args)
  assert cpu_attention.TARGET in lowered.as_text()


@pytest.mark.parametrize("what", ["bf16", "head_dim_320", "group_32"])
def test_what_it_does_not_take_runs_on_the_xla_path(what):
  rng = np.random.default_rng(1)
  kw = {"head_dim_320": dict(d=320), "group_32": dict(kvh=1, group=32)}.get(what, {})
  args = _batch(rng, [1, 4], [30, 9], **kw)
  if what == "bf16":
    args[:3] = [x.astype(jnp.bfloat16) for x in args[:3]]
  assert not cpu_attention.supports(args[0], args[1])
  f = functools.partial(ragged_paged_attention, sm_scale=0.125)
  assert cpu_attention.TARGET not in jax.jit(functools.partial(f, backend="cpu")).lower(*args).as_text()
  np.testing.assert_array_equal(np.asarray(f(*args, backend="cpu")), np.asarray(f(*args, backend="xla")))


@pytest.mark.parametrize("d", [16, 40, 64, 128, 256])
def test_every_head_dim_up_to_256(d):
  """64, 128 and 256 are compiled as constants, the others through the generic loop."""
  rng = np.random.default_rng(d)
  q, k, v, kv, table, cu, ns = _batch(rng, [1, 1, 9], [40, 3, 30], d=d)
  want = ragged_paged_attention_reference(q, k, v, kv, table, cu, ns, sm_scale=0.3)
  got = cpu_attention.ragged_paged_attention_cpu(q, k, v, kv, table, cu, ns, sm_scale=0.3)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


def test_many_sequences_over_the_thread_pool_match_the_reference():
  """64 decodes, 2 chunks and a layer-stacked pool: many work items on every thread."""
  rng = np.random.default_rng(2)
  q_lens = [1] * 64 + [37, 5]
  kv_lens = list(rng.integers(1, 300, 64)) + [37, 200]
  q, k, v, kv, table, cu, ns = _batch(rng, q_lens, kv_lens, layers=2)
  for layer in (0, 1):
    want = ragged_paged_attention_reference(q, k, v, kv, table, cu, ns, sm_scale=0.125, layer=jnp.int32(layer))
    got = cpu_attention.ragged_paged_attention_cpu(q, k, v, kv, table, cu, ns, sm_scale=0.125, layer=layer)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


def test_a_bad_step_input_gives_wrong_rows_not_a_crash():
  """Page ids past the pool, contexts past the table, query offsets past T, layers past the stack: the kernel
  clamps or skips (as XLA's gather clamps) instead of reading or writing out of bounds."""
  rng = np.random.default_rng(3)
  q, k, v, kv, table, cu, ns = _batch(rng, [1, 2, 1], [10, 20, 5])
  table = table.at[0, 0].set(10**6).at[1, 0].set(-7)
  kv = kv.at[2].set(10**6)
  cu = cu.at[3].set(q.shape[0] + 50)
  out = cpu_attention.ragged_paged_attention_cpu(q, k, v, kv, table, cu, ns, sm_scale=0.125)
  assert np.isfinite(np.asarray(out)).all()
  q, k, v, kv, table, cu, ns = _batch(rng, [1, 2], [10, 20], layers=2)
  for layer in (-5, 2, 10**6):
    out = cpu_attention.ragged_paged_attention_cpu(q, k, v, kv, table, cu, ns, sm_scale=0.125, layer=layer)
    assert np.isfinite(np.asarray(out)).all()


def test_the_kernel_cache_folder_follows_xdg_cache_home(monkeypatch, tmp_path):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert cpu_build.default_kernel_cache_dir() == tmp_path / "jaxpaged" / "cpu_kernels"


# cpu_attention.cc's query tiles per vector unit: the flags (after -march=native) that select each, and the CPU
# flag it needs to run. A machine runs the widest it has by default; the others are built here.
WIDTHS = [
    ("avx512", ("-mavx512f",), "avx512f"),  # tiles of 16 rows
    ("avx2", ("-mno-avx512f",), "avx2"),  # tiles of 8 rows
    ("generic", ("-mno-avx512f", "-mno-avx2", "-mno-fma"), None),  # no tiles: one query token after another
]


@functools.cache
def _width_target(name: str, flags: tuple[str, ...]) -> str:
  target = f"jaxpaged_cpu_attention_{name}"
  assert cpu_build.load_target(cpu_attention.SOURCE, "JaxpagedCpuAttention", target, flags)
  return target


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 flags select the widths")
@pytest.mark.parametrize("name, flags, needs", WIDTHS, ids=[w[0] for w in WIDTHS])
@pytest.mark.parametrize("group, d", [(1, 64), (2, 128), (3, 64), (4, 256), (5, 64), (7, 64), (8, 128), (16, 64)])
@pytest.mark.parametrize("window", [None, 7, 40])
def test_query_tiles_match_the_reference(name, flags, needs, group, d, window):
  """Several query tokens of a sequence run in tiles of up to 16 (AVX-512) or 8 (AVX2) rows (tokens x the group's
  heads; from TileOps::kMinRows rows): one token (a group of 16: a tile), 2 and 5 tokens, 37 (tiles of
  near-equal size) and 100 tokens, decodes beside them; windows that cut into a tile's keys for some of its rows
  only. Each width is built on any x86 machine and run where the CPU has its unit."""
  cpu_build.build_library(cpu_attention.SOURCE, extra_flags=flags)  # a compile error fails here
  if needs is not None and needs not in Path("/proc/cpuinfo").read_text().split():
    pytest.skip(f"built, not run: this CPU lacks {needs}")
  target = _width_target(name, flags)
  rng = np.random.default_rng(group * 1000 + d + (window or 0))
  q_lens, kv_lens = [1, 2, 5, 37, 100, 1], [40, 2, 60, 37, 130, 9]
  q, k, v, kv, table, cu, ns = _batch(rng, q_lens, kv_lens, kvh=2, group=group, d=d, layers=2)
  w = None if window is None else jnp.int32(window)
  want = ragged_paged_attention_reference(q, k, v, kv, table, cu, ns, sm_scale=d ** -0.5, layer=jnp.int32(1),
                                          sliding_window=w)
  got = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
      q, k, v, kv, table, cu, ns, jnp.int32(1), jnp.int32(window or 0), sm_scale=np.float32(d ** -0.5),
      query_tiles=True)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
