"""The native CPU matmul (cpu_matmul.cc) for decode-sized dots: numerics, shapes it takes, the step."""

from __future__ import annotations

import platform
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_build, cpu_matmul

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the native kernel is XLA:CPU's")


def w8a8_product(x, q, scale):
  """float64 x [M, K] @ int8 weights q [K, N] (scales [ceil(K / G), N]) as matmul_w8a8 takes them: x's values
  quantised per row and run of G (`quantize_rows_int8`) times their scales, @ the dequantised weights."""
  q, scale = np.asarray(q), np.asarray(scale)
  group = cpu_matmul._group_size(q.shape[0], scale.shape[0])
  xq, d = cpu_matmul.quantize_rows_int8(jnp.asarray(x), group)
  values = np.asarray(xq, np.float64) * np.repeat(np.asarray(d, np.float64), group, axis=1)[:, :q.shape[0]]
  return values @ np.asarray(cpu_matmul.dequantize_int8(q, scale), np.float64)


@pytest.mark.parametrize("m", [17, 23, 30, 32, 61, 128])
@pytest.mark.parametrize("k, n", [(576, 960), (1536, 576), (64, 100), (7, 64), (33, 200), (130, 128), (0, 64)])
def test_matches_a_float64_product(m, k, n):
  """Row counts that split into uneven register tiles, widths with a narrow last column block, depths
  of whole and partial 64-row chunks of w (the accumulators carried in y between chunks), and none."""
  assert cpu_matmul.load_cpu_matmul()
  rng = np.random.default_rng(m * 1000 + n)
  x = rng.standard_normal((m, k), np.float32)
  w = rng.standard_normal((k, n), np.float32)
  got = np.asarray(jax.jit(cpu_matmul.matmul_cpu)(jnp.asarray(x), jnp.asarray(w)))
  want = x.astype(np.float64) @ w.astype(np.float64)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(k))


@pytest.mark.parametrize("shape, dtype, ok", [
    ((17, 8), jnp.float32, True), ((32, 8), jnp.float32, True), ((1, 8), jnp.float32, False),
    ((16, 8), jnp.float32, False), ((128, 8), jnp.float32, True), ((129, 8), jnp.float32, False),
    ((20, 8), jnp.bfloat16, False)])
def test_it_takes_decode_sized_float32_dots_only(shape, dtype, ok):
  x = jnp.zeros(shape, dtype)
  w = jnp.zeros((shape[1], 4), dtype)
  assert cpu_matmul.supports(x, w) == ok
  if not ok:
    with pytest.raises(ValueError, match="native CPU matmul"):
      cpu_matmul.matmul_cpu(x, w)


@pytest.mark.parametrize("m", [1, 4, 6, 7, 32, 200])
@pytest.mark.parametrize("k, n", [(576, 960), (64, 64), (130, 192), (0, 64)])
def test_blocked_weights_match_a_float64_product(m, k, n):
  """The blocked layout [N / 64, K, 64] at every row count (one group, prefetching groups, many),
  whole and partial chunks of w."""
  assert cpu_matmul.load_cpu_matmul()
  rng = np.random.default_rng(m * 7 + k)
  x = rng.standard_normal((m, k), np.float32)
  w = rng.standard_normal((k, n), np.float32)
  blocked = cpu_matmul.block_weight(jnp.asarray(w))
  assert blocked.shape == (n // 64, k, 64)
  np.testing.assert_array_equal(np.asarray(blocked[1 % (n // 64)]), w[:, 64 * (1 % (n // 64)):][:, :64])
  got = np.asarray(jax.jit(cpu_matmul.matmul_cpu)(jnp.asarray(x), blocked))
  want = x.astype(np.float64) @ w.astype(np.float64)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(max(k, 1)))


def test_stacked_blocks_are_read_at_the_layer_given():
  """Stacked layers' blocks [L, N / 64, K, 64] with a layer index, traced inside a scan as the engine's
  step gives it: each layer's product is that layer's weight's, read in place (no slice in the program);
  an index outside the stack is clamped, as the attention's layer is, never a read past it."""
  assert cpu_matmul.load_cpu_matmul()
  rng = np.random.default_rng(3)
  x = rng.standard_normal((5, 96), np.float32)
  w = rng.standard_normal((3, 96, 192), np.float32)  # [L, K, N]
  stacked = cpu_matmul.block_weight(jnp.asarray(w))
  assert stacked.shape == (3, 3, 96, 64)
  np.testing.assert_array_equal(np.asarray(stacked[2]), np.asarray(cpu_matmul.block_weight(jnp.asarray(w[2]))))

  def per_layer(x, stacked):
    return jax.lax.scan(lambda c, layer: (c, cpu_matmul.matmul_cpu(x, stacked, layer)), 0,
                        jnp.arange(3, dtype=jnp.int32))[1]  # [L, M, N]

  program = jax.jit(per_layer).lower(jnp.asarray(x), stacked).compile()
  assert not re.search(r"f32\[[\d,]*\]\{[\d,]*\} dynamic-slice", program.as_text())  # only the index is sliced
  got = np.asarray(program(jnp.asarray(x), stacked))
  want = np.einsum("mk,lkn->lmn", x.astype(np.float64), w.astype(np.float64))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(cpu_matmul.matmul_cpu(jnp.asarray(x), stacked, 7)), want[2], rtol=1e-5,
                             atol=1e-4)
  with pytest.raises(ValueError, match="layer index"):
    cpu_matmul.matmul_cpu(jnp.asarray(x), stacked)
  with pytest.raises(ValueError, match="layer index"):
    cpu_matmul.matmul_cpu(jnp.asarray(x), stacked[0], 1)


@pytest.mark.parametrize("layout", ["k_n", "blocked", "stacked", "int8", "int8_stacked", "w8a8_stacked"])
@pytest.mark.parametrize("m, rows", [(32, 32), (32, 19), (32, 1), (32, 0), (17, 20), (17, -3), (128, 97)])
def test_only_the_live_rows_are_computed(layout, m, rows):
  """`rows` (a padded step's real tokens, traced as the step gives it): x's first `rows` rows are the
  product's, the others zeros whatever x's padding rows hold (NaN here: a computed one would show);
  clamped to [0, M]. Every weight layout and both handlers, W8A8 too (NaN rows would spoil no live row's x)."""
  assert cpu_matmul.load_cpu_matmul()
  rng = np.random.default_rng(m * 100 + rows)
  k, n = 130, 192
  x = rng.standard_normal((m, k), np.float32)
  live = min(max(rows, 0), m)
  x[live:] = np.nan
  w = rng.standard_normal((2, k, n), np.float32)  # [L, K, N]: layer 1 is read where stacked
  layer = jnp.int32(1) if layout.endswith("stacked") else None
  scale = None
  call = cpu_matmul.matmul_cpu
  if layout.startswith(("int8", "w8a8")):
    q, s = cpu_matmul.quantize_int8(w if layer is not None else w[1])
    weight, scale = cpu_matmul.block_weight(jnp.asarray(q)), cpu_matmul.block_weight(jnp.asarray(s))
    q1, s1 = (q[1], s[1]) if layer is not None else (q, s)
    if layout.startswith("w8a8"):
      call, want = cpu_matmul.matmul_w8a8, w8a8_product(x[:live], q1, s1)
    else:
      want = x[:live].astype(np.float64) @ np.asarray(cpu_matmul.dequantize_int8(q1, s1), np.float64)
  else:
    weight = {"k_n": jnp.asarray(w[1]), "blocked": cpu_matmul.block_weight(jnp.asarray(w[1])),
              "stacked": cpu_matmul.block_weight(jnp.asarray(w))}[layout]
    want = x[:live].astype(np.float64) @ w[1].astype(np.float64)
  got = np.asarray(jax.jit(lambda x, wt, sc, r: call(x, wt, layer, sc, r))(
      jnp.asarray(x), weight, scale, jnp.int32(rows)))
  np.testing.assert_allclose(got[:live], want, rtol=1e-5, atol=1e-4)
  np.testing.assert_array_equal(got[live:], 0.0)


def test_what_blocks():
  assert cpu_matmul.blockable(jnp.zeros((8, 128), jnp.float32))
  assert not cpu_matmul.blockable(jnp.zeros((8, 96), jnp.float32))  # N not a multiple of 64
  assert not cpu_matmul.blockable(jnp.zeros((8, 128), jnp.bfloat16))
  assert cpu_matmul.blockable(jnp.zeros((3, 8, 64), jnp.float32))  # stacked layers [L, K, N]
  assert not cpu_matmul.blockable(jnp.zeros((3, 8, 2, 64), jnp.float32))  # the 2-D views are the caller's
  with pytest.raises(ValueError, match="multiple of 64"):
    cpu_matmul.block_weight(jnp.zeros((8, 96), jnp.float32))
  x = jnp.zeros((3, 8), jnp.float32)
  assert cpu_matmul.supports(x, jnp.zeros((2, 8, 64), jnp.float32))  # blocked: any row count
  assert not cpu_matmul.supports(x, jnp.zeros((2, 9, 64), jnp.float32))  # K mismatch
  assert not cpu_matmul.supports(x, jnp.zeros((2, 8, 32), jnp.float32))  # not 64-wide blocks
  assert not cpu_matmul.supports(x, jnp.zeros((8, 64), jnp.float32))  # [K, N] at 3 rows: XLA's dots


@pytest.mark.parametrize("blocks", [1, 2, 3, 5, 64, 97])
@pytest.mark.parametrize("m", [1, 32])
def test_every_column_block_once_however_the_threads_split_them(blocks, m):
  """cpu_pool.h's ranges: each thread walks its own run of blocks and steals halves of the others';
  a chain of dependent calls (a helper task often starts late) over odd and even block counts gives
  every column, the same bits in every run, and the blocked next-block prefetch of the last block
  reads nothing it should not."""
  assert cpu_matmul.load_cpu_matmul()
  rng = np.random.default_rng(blocks * 10 + m)
  k, n = 64, 64 * blocks
  x = rng.standard_normal((m, k), np.float32)
  ws = [rng.standard_normal((k, n), np.float32) / np.sqrt(k) for _ in range(3)]
  back = rng.standard_normal((n, k), np.float32) / np.sqrt(n)  # back to width k between the calls

  def chain(x, blocked):
    for b in blocked:
      x = cpu_matmul.matmul_cpu(x, b) @ back
    return x

  blocked = [cpu_matmul.block_weight(jnp.asarray(w)) for w in ws]
  run = jax.jit(chain)
  got = np.asarray(run(jnp.asarray(x), blocked))
  want = x.astype(np.float64)
  for w in ws:
    want = want @ w.astype(np.float64) @ back.astype(np.float64)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
  for _ in range(3):
    np.testing.assert_array_equal(np.asarray(run(jnp.asarray(x), blocked)), got)


@pytest.mark.parametrize("m", [1, 4, 6, 7, 13, 32, 128])
@pytest.mark.parametrize("k, n", [(576, 960), (130, 192), (64, 64), (20, 64), (0, 64)])
@pytest.mark.parametrize("group", [32, 64, 16])
def test_int8_weights_match_a_float64_product_of_their_values(m, k, n, group):
  """Weight-only int8: the blocked int8 values times their runs' scales equal the float64 product of the
  dequantised values, at one row group, uneven groups and many (from 4 groups, 19+ rows, the chunks are
  dequantised once for the float tiles: 32 and 128 rows), whole and partial chunks and runs of rows
  (K = 130: a last chunk of 2 rows; K = 20: one short run); stacked layers read at each layer with that
  layer's scales."""
  assert cpu_matmul.load_cpu_matmul()
  rng = np.random.default_rng(m * 7 + k + n + group)
  x = rng.standard_normal((m, k), np.float32)
  w = rng.standard_normal((3, k, n), np.float32) * np.linspace(0.01, 3, n, dtype=np.float32)  # column ranges
  w[:, : k // 3] *= 20  # and runs of rows with their own ranges
  q, scale = cpu_matmul.quantize_int8(w, group)
  assert q.dtype == np.int8 and scale.shape == (3, -(-k // group), n) and scale.dtype == np.float32
  values = np.asarray(cpu_matmul.dequantize_int8(q, scale), np.float64)
  want = np.einsum("mk,lkn->lmn", x.astype(np.float64), values)
  tol = 1e-6 * np.sqrt(k) * 127 * scale.max(initial=0)  # float32 sums of terms up to 127 |x| scale
  blocked_q, blocked_s = cpu_matmul.block_weight(jnp.asarray(q)), cpu_matmul.block_weight(jnp.asarray(scale))
  one = jax.jit(cpu_matmul.matmul_cpu)(jnp.asarray(x), blocked_q[1], None, blocked_s[1])
  np.testing.assert_allclose(np.asarray(one), want[1], rtol=1e-5, atol=tol)
  run = jax.jit(lambda x, q, s: jax.lax.map(lambda layer: cpu_matmul.matmul_cpu(x, q, layer, s), jnp.arange(3)))
  got = np.asarray(run(jnp.asarray(x), blocked_q, blocked_s))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=tol)
  ref = cpu_matmul.reference_int8(jnp.asarray(x), jnp.asarray(q[2]), jnp.asarray(scale[2]))
  np.testing.assert_allclose(np.asarray(ref), want[2], rtol=1e-5, atol=tol)


@pytest.mark.parametrize("m", [1, 2, 4, 5, 13, 32, 128])
@pytest.mark.parametrize("k, n", [(576, 960), (130, 192), (64, 64), (20, 64), (7, 64), (0, 64)])
@pytest.mark.parametrize("group", [32, 64, 16, 2])
def test_w8a8_matches_a_float64_product_of_the_quantised_values(m, k, n, group):
  """W8A8 (`matmul_w8a8`): the float64 product of x's quantised values (per row and run) and the weights'
  at one row (the float tile over x's values), 2-5 rows (one or two VNNI tiles of up to 4 where built), many,
  whole and partial chunks, quads and runs (K = 130: a last chunk of 2 rows; K = 7: a short quad; K = 20:
  one short run; runs of 2 rows: no whole quads, the float tiles everywhere); stacked layers read at each
  layer with that layer's scales; reference_w8a8 the same."""
  assert cpu_matmul.load_cpu_matmul()
  rng = np.random.default_rng(m * 11 + k + n + group)
  x = rng.standard_normal((m, k), np.float32)
  x[:, k // 2:] *= 10  # runs of x with their own ranges
  x[:, :1] *= 100  # and an outlier channel
  w = rng.standard_normal((3, k, n), np.float32) * np.linspace(0.01, 3, n, dtype=np.float32)
  w[:, : k // 3] *= 20
  q, scale = cpu_matmul.quantize_int8(w, group)
  want = np.stack([w8a8_product(x, q[layer], scale[layer]) for layer in range(3)])
  tol = 1e-5 * np.abs(want).max(initial=0)  # exact integer sums; each run's float32 flush rounds
  blocked_q, blocked_s = cpu_matmul.block_weight(jnp.asarray(q)), cpu_matmul.block_weight(jnp.asarray(scale))
  run = jax.jit(lambda x, q, s: jax.lax.map(lambda layer: cpu_matmul.matmul_w8a8(x, q, layer, s), jnp.arange(3)))
  np.testing.assert_allclose(np.asarray(run(jnp.asarray(x), blocked_q, blocked_s)), want, rtol=1e-5, atol=tol)
  one = jax.jit(cpu_matmul.matmul_w8a8)(jnp.asarray(x), blocked_q[1], None, blocked_s[1])
  np.testing.assert_allclose(np.asarray(one), want[1], rtol=1e-5, atol=tol)
  ref = cpu_matmul.reference_w8a8(jnp.asarray(x), jnp.asarray(q[2]), jnp.asarray(scale[2]))
  np.testing.assert_allclose(np.asarray(ref), want[2], rtol=1e-5, atol=tol)
  if m and k:  # the weight-only product would fail these checks: x's rounding shows
    weight_only = x.astype(np.float64) @ np.asarray(cpu_matmul.dequantize_int8(q[2], scale[2]), np.float64)
    assert not np.allclose(weight_only, want[2], rtol=1e-5, atol=tol)


@pytest.mark.parametrize("k, n, group", [(576, 960, 32), (130, 192, 16), (1536, 128, 64), (20, 64, 2)])
def test_w8a8_rows_come_out_the_same_in_any_batch(k, n, group):
  """A row's W8A8 product does not depend on the rows beside it, to the bit: alone (the float tile over its
  values), in 2-7 rows (VNNI tiles of up to 4 where built) and 19-33 (the same tiles over more row groups): a
  request's tokens do not change with the batch it runs in."""
  assert cpu_matmul.load_cpu_matmul()
  rng = np.random.default_rng(k + n)
  x = rng.standard_normal((33, k), np.float32)
  x[:, 3] *= 50  # an outlier channel
  q, scale = cpu_matmul.quantize_int8(rng.standard_normal((k, n), np.float32), group)
  bq, bs = cpu_matmul.block_weight(jnp.asarray(q)), cpu_matmul.block_weight(jnp.asarray(scale))
  call = jax.jit(lambda x: cpu_matmul.matmul_w8a8(x, bq, None, bs))
  full = np.asarray(call(jnp.asarray(x)))
  for m in [1, 2, 3, 5, 7, 19, 24]:
    np.testing.assert_array_equal(np.asarray(call(jnp.asarray(x[:m]))), full[:m], err_msg=f"{m} rows")
  for r in (7, 32):
    np.testing.assert_array_equal(np.asarray(call(jnp.asarray(x[r:r + 1]))), full[r:r + 1], err_msg=f"row {r}")


def test_quantize_rows_int8_rounds_each_run_of_a_row_to_its_own_scale():
  """x's runs: d = max |x| / 127, so a run's extreme is exactly +-127 and each value within half a step; an
  all-zero run d = 0 and zeros; a short last run its own d; ties round to even."""
  rng = np.random.default_rng(3)
  x = rng.standard_normal((3, 40), np.float32) * rng.uniform(0.01, 100, (3, 40)).astype(np.float32)
  x[1, :32] = 0
  q, d = cpu_matmul.quantize_rows_int8(jnp.asarray(x), 32)
  q, d = np.asarray(q), np.asarray(d)
  assert q.dtype == np.int8 and q.shape == (3, 40) and d.shape == (3, 2)
  assert d[1, 0] == 0 and not q[1, :32].any()
  np.testing.assert_allclose(d[:, 1], np.abs(x[:, 32:]).max(axis=1) / 127, rtol=1e-6)
  magnitudes = np.abs(q.astype(np.int32))
  assert (magnitudes[[0, 2], :32].max(axis=1) == 127).all() and (magnitudes[:, 32:].max(axis=1) == 127).all()
  step = np.repeat(d, 32, axis=1)[:, :40]
  assert np.all(np.abs(q * step - x) <= step / 2 * (1 + 1e-5))
  ties = np.array([[127.0, 0.5, 1.5, 2.5, -0.5]], np.float32)  # d = 1
  np.testing.assert_array_equal(np.asarray(cpu_matmul.quantize_rows_int8(jnp.asarray(ties), 32)[0]),
                                [[127, 0, 2, 2, 0]])


def test_quantize_int8_rounds_each_run_of_rows_to_its_own_scale():
  """scale = the run's max |w| / 127 (so its extreme is exactly +-127), error at most half a step, an all-zero
  run gets scale 1 and zeros, a short last run its own scale; a JAX input gives the same; non-float input and
  a run length that does not divide the 64-row chunk are refused."""
  rng = np.random.default_rng(0)
  w = rng.standard_normal((2, 40, 64)).astype(np.float32) * rng.uniform(0.001, 10, (40, 64)).astype(np.float32)
  w[1, :32, 5] = 0
  q, scale = cpu_matmul.quantize_int8(w)  # runs of 32 rows: 32 + 8
  assert scale.shape == (2, 2, 64)
  magnitudes = np.abs(q.astype(np.int32))
  extremes = np.stack([magnitudes[:, :32].max(axis=1), magnitudes[:, 32:].max(axis=1)], 1)
  assert (np.delete(extremes.reshape(4, 64), 2 * 64 + 5) == 127).all()  # all but the zero run
  assert scale[1, 0, 5] == 1 and not q[1, :32, 5].any()
  np.testing.assert_allclose(scale[:, 1], np.abs(w[:, 32:]).max(axis=1) / 127, rtol=1e-6)
  step = np.repeat(scale, 32, axis=1)[:, :40]
  assert np.all(np.abs(q * step - w) <= step / 2 * (1 + 1e-6))
  jq, js = cpu_matmul.quantize_int8(jnp.asarray(w))
  np.testing.assert_array_equal(jq, q)
  np.testing.assert_array_equal(js, scale)
  with pytest.raises(ValueError, match="float w"):
    cpu_matmul.quantize_int8(q)
  with pytest.raises(ValueError, match="must divide 64"):
    cpu_matmul.quantize_int8(w, 48)


def test_int8_call_refuses_what_it_cannot_read():
  assert cpu_matmul.load_cpu_matmul()
  x = jnp.zeros((2, 64), jnp.float32)
  q = jnp.zeros((2, 64, 64), jnp.int8)  # N = 128, K = 64
  s = jnp.ones((2, 2, 64), jnp.float32)  # runs of 32 rows
  for bad_q, bad_s, layer in [(q, s[:1], None),                           # scales for half the columns
                              (q.astype(jnp.float32), s, None),           # not int8
                              (jnp.zeros((64, 128), jnp.int8), s, None),  # not blocked
                              (q, s.astype(jnp.bfloat16), None),          # scales not float32
                              (q, jnp.ones((2, 3, 64)), None),            # 3 runs of rows fit no run length
                              (q, s, 1)]:                                 # a layer without a stack
    with pytest.raises(ValueError, match="int8"):
      cpu_matmul.matmul_cpu(x, bad_q, layer, bad_s)
  with pytest.raises(ValueError, match="int8 matmul"):  # a stack without its layer
    cpu_matmul.matmul_cpu(x, q[None], None, s[None])


# cpu_matmul.cc's register tiles per vector unit: the flags (after -march=native) that select each, and
# the CPU flag it needs to run. A machine runs the widest it has by default; the others are built here.
WIDTHS = [
    ("avx512_vnni", ("-mavx512f", "-mavx512bw", "-mavx512vnni"), "avx512_vnni"),  # W8A8 on VNNI tiles
    ("avx512", ("-mavx512f", "-mno-avx512vnni"), "avx512f"),
    ("avx2", ("-mno-avx512f",), "avx2"),
    ("generic", ("-mno-avx512f", "-mno-avx2", "-mno-fma"), None),  # GCC's 4-lane vectors (SSE here)
]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86 flags select the widths")
@pytest.mark.parametrize("name, flags, needs", WIDTHS, ids=[w[0] for w in WIDTHS])
def test_every_vector_width_builds_and_each_this_cpu_runs_matches(name, flags, needs):
  """The AVX-512 tile (one per 64-column block), the AVX2 one (4 a block) and the generic one (8) all
  compile on any x86 machine, as do the VNNI tiles of W8A8 products; each this CPU can run matches a float64
  product over uneven row groups, blocked and [K, N] weights with a narrow last block, whole and partial
  chunks of w, and its W8A8 products equal this machine's default build's to the bit (integer sums, exact in
  float32 tiles as in VNNI ones; the generic build has no FMA, so its flushes round once more). (The AVX-512 tile runs only where the CPU has AVX-512: the Intel, Zen 4 and
  Zen 5 machines did, the Zen 3 one does not; VNNI: the Zen 4.)"""
  assert cpu_matmul.vnni(flags) == (name == "avx512_vnni")
  assert cpu_matmul.load_cpu_matmul()  # the default build, for its W8A8 results
  lib = cpu_build.build_library(cpu_matmul.SOURCE, extra_flags=flags)  # a compile error fails here
  assert lib.exists()
  if needs is not None and needs not in Path("/proc/cpuinfo").read_text().split():
    return  # built, not run: this CPU lacks the unit
  target = f"jaxpaged_cpu_matmul_{name}"
  assert cpu_build.load_target(cpu_matmul.SOURCE, "JaxpagedCpuMatmul", target, flags)
  rng = np.random.default_rng(len(name))
  for m, k, n in [(1, 576, 960), (7, 130, 192), (13, 64, 128), (32, 576, 200)]:
    x = rng.standard_normal((m, k), np.float32)
    w = rng.standard_normal((k, n), np.float32)
    weights = [jnp.asarray(w)] + ([cpu_matmul.block_weight(jnp.asarray(w))] if n % 64 == 0 else [])
    if n % 64 == 0:  # stacked layers, read at layer 1
      weights.append(cpu_matmul.block_weight(jnp.asarray(np.stack([np.zeros_like(w), w]))))
    for wj in weights:
      layer = jnp.int32(1 if wj.ndim == 4 else 0)
      got = np.asarray(jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((m, n), jnp.float32))(jnp.asarray(x), wj,
                                                                                            layer, jnp.int32(m)))
      np.testing.assert_allclose(got, x.astype(np.float64) @ w.astype(np.float64), rtol=1e-5,
                                 atol=1e-5 * np.sqrt(k), err_msg=f"{name}: m {m}, k {k}, n {n}, w {wj.shape}")
  # the int8 handler at the same width: widened in that unit's registers up to 18 rows, chunks dequantised
  # into float tiles from 19 on (a stack of two, read at layer 1)
  assert cpu_build.load_target(cpu_matmul.SOURCE, "JaxpagedCpuMatmulInt8", f"{target}_int8", flags)
  for m, k, n in [(1, 576, 960), (7, 130, 192), (13, 64, 128), (32, 130, 192), (19, 576, 64)]:
    x = rng.standard_normal((m, k), np.float32)
    q, scale = cpu_matmul.quantize_int8(rng.standard_normal((2, k, n), np.float32))
    got = np.asarray(jax.ffi.ffi_call(f"{target}_int8", jax.ShapeDtypeStruct((m, n), jnp.float32))(
        jnp.asarray(x), cpu_matmul.block_weight(jnp.asarray(q)), cpu_matmul.block_weight(jnp.asarray(scale)),
        jnp.int32(1), jnp.int32(m), group=np.int64(cpu_matmul.GROUP_SIZE), activations=False))
    want = x.astype(np.float64) @ np.asarray(cpu_matmul.dequantize_int8(q[1], scale[1]), np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * np.sqrt(k) * 127 * scale.max(),
                               err_msg=f"{name} int8: m {m}, k {k}, n {n}")
    w8a8 = jax.ffi.ffi_call(f"{target}_int8", jax.ShapeDtypeStruct((m, n), jnp.float32))(
        jnp.asarray(x), cpu_matmul.block_weight(jnp.asarray(q)), cpu_matmul.block_weight(jnp.asarray(scale)),
        jnp.int32(1), jnp.int32(m), group=np.int64(cpu_matmul.GROUP_SIZE), activations=True)
    default = cpu_matmul.matmul_w8a8(jnp.asarray(x), cpu_matmul.block_weight(jnp.asarray(q)),
                                     jnp.int32(1), cpu_matmul.block_weight(jnp.asarray(scale)))
    if name == "generic":  # no FMA unit: each run's flush rounds its product apart from the sum
      np.testing.assert_allclose(np.asarray(w8a8), np.asarray(default), rtol=1e-5, atol=1e-5,
                                 err_msg=f"{name} w8a8: m {m}, k {k}")
    else:
      np.testing.assert_array_equal(np.asarray(w8a8), np.asarray(default), err_msg=f"{name} w8a8: m {m}, k {k}")
