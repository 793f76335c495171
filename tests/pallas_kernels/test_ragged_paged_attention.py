"""Ragged paged attention: Pallas kernel vs pure-JAX reference vs f64 NumPy.

Kernel runs go through the kernel's private entry point with
`poison_output=True`: the kernel's output buffers start NaN (aliased in), so
any element the kernel fails to write shows up as NaN. Pools
are filled with NaN/huge garbage in free pages, in page 0, and past kv_len in
used pages: a masking bug turns into NaN or a large error.
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import ragged_paged_attention
from pallas_kernels import reference
from pallas_kernels import triton_attention

try:
  import hypothesis
  from hypothesis import strategies as st
except ImportError:  # GPU machine may lack it
  hypothesis = None

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 5e-3}
TF32_TOL = 1e-2  # the compiled kernel runs f32 dots as TF32 on the GPU


def tolerance(dtype, backend, interpret):
  """Max abs error vs the float64 oracle for this dtype and path."""
  dtype = jnp.dtype(dtype).type
  if dtype == jnp.float32 and backend == "pallas" and not interpret:
    return TF32_TOL
  return TOL[dtype]


@dataclasses.dataclass
class Batch:
  q: np.ndarray            # [T, Hq, D]
  k_pages: np.ndarray      # [KVH, N, ps, D] or [L, KVH, N, ps, D]
  v_pages: np.ndarray
  kv_lens: np.ndarray      # int32 [S]
  page_table: np.ndarray   # int32 [S, P]
  cu_q_lens: np.ndarray    # int32 [S+1]
  num_seqs: int
  layer: int | None
  sm_scale: float
  sliding_window: int | None = None   # <= 0: no window

  def args(self):
    return (jnp.asarray(self.q), jnp.asarray(self.k_pages),
            jnp.asarray(self.v_pages), jnp.asarray(self.kv_lens),
            jnp.asarray(self.page_table), jnp.asarray(self.cu_q_lens),
            jnp.int32(self.num_seqs))



BACKENDS = ("reference", "xla", "cpu", "pallas")  # every backend must match the oracle

def make_batch(rng, q_lens, kv_lens, *, kvh=2, group=4, d=64, ps=16,
               num_slots=None, extra_tokens=3, dtype=jnp.float32,
               layers=None, garbage=np.nan, extra_pages=5):
  """Random batch; pages shuffled over the pool; garbage where unused."""
  ns = len(q_lens)
  s = num_slots or ns
  pages_per_seq = [-(-kv // ps) for kv in kv_lens]
  p = max(pages_per_seq + [1]) + 1       # + a column of 0-padding
  n = 1 + sum(pages_per_seq) + extra_pages
  perm = rng.permutation(np.arange(1, n)).astype(np.int32)
  page_table = np.zeros((s, p), np.int32)
  used = np.zeros((n, ps), bool)         # slot holds a real key/value
  off = 0
  for i, (kv, npg) in enumerate(zip(kv_lens, pages_per_seq)):
    page_table[i, :npg] = perm[off:off + npg]
    off += npg
    for j in range(kv):
      used[page_table[i, j // ps], j % ps] = True
  cu = np.zeros(s + 1, np.int32)
  cu[1:ns + 1] = np.cumsum(q_lens)
  cu[ns + 1:] = cu[ns]
  t = int(cu[ns]) + extra_tokens
  lead = () if layers is None else (layers,)
  shape = lead + (kvh, n, ps, d)

  def pool():
    x = rng.standard_normal(shape).astype(np.float32)
    x = np.where(used[:, :, None], x, garbage)
    return np.asarray(jnp.asarray(x, dtype))

  kvl = np.zeros(s, np.int32)
  kvl[:ns] = kv_lens
  q = np.asarray(jnp.asarray(rng.standard_normal((t, kvh * group, d)), dtype))
  return Batch(q, pool(), pool(), kvl, page_table, cu, ns,
               None if layers is None else layers - 1, d ** -0.5)


def window_start(pos, window):
  """First key position the query at `pos` sees (transformers' sliding
  window: kv_idx > q_idx - window)."""
  return 0 if window is None or window <= 0 else max(0, pos - window + 1)


def drop_out_of_window(b: Batch, garbage=np.nan) -> Batch:
  """What an engine may do with keys no query of a sequence can see any more
  (those before its first query's window): its pages wholly before the window
  leave the table (null page 0), the slots before it hold garbage."""
  k, v, table = b.k_pages.copy(), b.v_pages.copy(), b.page_table.copy()
  ps = k.shape[-2]
  for s in range(b.num_seqs):
    q_len = b.cu_q_lens[s + 1] - b.cu_q_lens[s]
    first = window_start(b.kv_lens[s] - q_len, b.sliding_window)
    for key in range(first):
      page = table[s, key // ps]
      k[..., page, key % ps, :] = garbage
      v[..., page, key % ps, :] = garbage
    table[s, :first // ps] = 0
  return dataclasses.replace(b, k_pages=k, v_pages=v, page_table=table)


def oracle(b: Batch) -> np.ndarray:
  """float64 NumPy attention, one sequence / token at a time."""
  q = np.asarray(b.q, np.float64)
  kp = np.asarray(b.k_pages, np.float64)
  vp = np.asarray(b.v_pages, np.float64)
  if b.layer is not None:
    kp, vp = kp[b.layer], vp[b.layer]
  kvh, _, ps, d = kp.shape
  g = q.shape[1] // kvh
  out = np.zeros_like(q)
  for s in range(b.num_seqs):
    lo, hi, kv = b.cu_q_lens[s], b.cu_q_lens[s + 1], b.kv_lens[s]
    pages = b.page_table[s, :-(-kv // ps)]
    k = kp[:, pages].reshape(kvh, -1, d)[:, :kv]
    v = vp[:, pages].reshape(kvh, -1, d)[:, :kv]
    for j in range(hi - lo):
      pos = kv - (hi - lo) + j
      first = window_start(pos, b.sliding_window)
      for h in range(q.shape[1]):
        sc = k[h // g, first:pos + 1] @ q[lo + j, h] * b.sm_scale
        w = np.exp(sc - sc.max())
        out[lo + j, h] = (w / w.sum()) @ v[h // g, first:pos + 1]
  return out


_PALLAS_DEFAULTS = dict(
    layer=None, sliding_window=None, block_q=None, pages_per_block=None,
    num_splits=None, num_warps=None, num_stages=None,
    max_num_partial_prefills=None)


def _poisoned_pallas(*args, **kw):
  """The Pallas backend with NaN-filled output buffers (a test-only hook,
  not in the public function's signature)."""
  return triton_attention._ragged_paged_attention_pallas(  # pylint: disable=protected-access
      *args, **{**_PALLAS_DEFAULTS, **kw}, poison_output=True)


_STATIC = ("sm_scale", "interpret", "block_q", "pages_per_block", "num_splits",
           "num_warps", "num_stages", "max_num_partial_prefills")
poisoned_pallas = jax.jit(_poisoned_pallas, static_argnames=_STATIC)
# Interpret mode emulates the GPU kernel with ordinary XLA:CPU ops, and these
# tests are bound by compiling them: this jit alone (never the engine's, nor
# the --kernel-mode=gpu runs) compiles at LLVM -O0, which computes the same.
# test_scenarios_f32 on a cold cache (2-core Zen 3): 91.5 -> 71.7 s.
poisoned_pallas_interpret = jax.jit(
    _poisoned_pallas, static_argnames=_STATIC,
    compiler_options={"xla_backend_optimization_level": 0})


def run(b: Batch, backend, interpret=True, **kw):
  layer = None if b.layer is None else jnp.int32(b.layer)
  if b.sliding_window is not None:
    kw["sliding_window"] = jnp.int32(b.sliding_window)
  if backend == "pallas":
    fn = poisoned_pallas_interpret if interpret else poisoned_pallas
    out = fn(*b.args(), sm_scale=b.sm_scale, layer=layer, interpret=interpret, **kw)
  else:
    out = ragged_paged_attention(*b.args(), sm_scale=b.sm_scale, layer=layer,
                                 backend=backend, **kw)
  return np.asarray(out.astype(jnp.float32))


def check(b: Batch, interpret, tol=None, **kw):
  """Kernel and reference both match the oracle; padding rows exactly 0."""
  want = oracle(b)
  live = int(b.cu_q_lens[b.num_seqs])
  for backend in BACKENDS:
    got = run(b, backend, interpret, **kw)
    assert not np.isnan(got).any(), f"{backend}: NaN in output"
    assert np.all(got[live:] == 0), f"{backend}: padding rows not zero"
    err = np.abs(got - want).max()
    limit = tol or tolerance(b.q.dtype, backend, interpret)
    assert err <= limit, f"{backend}: max abs err {err} > {limit}"
  return want


SCENARIOS = {
    # name: (q_lens, kv_lens, extra make_batch kwargs)
    # T <= S selects the kernel's decode tiling (rows = G padded to 16).
    "decode": ([1, 1, 1, 1, 1], [1, 15, 16, 17, 70], dict(num_slots=8)),
    "prefill": ([16, 45, 3], [16, 45, 3], {}),
    "mixed": ([1, 20, 1, 33], [40, 52, 9, 33], {}),
    "page_edges": ([1, 1, 2, 16, 17, 1], [31, 32, 33, 47, 64, 65], {}),
    # Small steps (T <= 16, 3 padding tokens included) with multi-token
    # sequences, e.g. speculative verifications: the XLA path's one-tile-at-
    # a-time call beside its decode call, for T <= S and T > S.
    "small_step": ([4, 1, 1, 3], [40, 17, 70, 130], dict(num_slots=16)),
    "small_step_few_slots": ([5, 2, 1], [64, 33, 9], dict(num_slots=3)),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("group", [1, 4, 8])
def test_scenarios_f32(name, group, interpret):
  q_lens, kv_lens, kw = SCENARIOS[name]
  rng = np.random.default_rng(zlib.crc32(f"{name}{group}".encode()))
  check(make_batch(rng, q_lens, kv_lens, group=group, kvh=2, **kw),
        interpret)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("d,ps", [(64, 32), (128, 16), (128, 64)])
def test_dtypes_head_dims_page_sizes(dtype, d, ps, interpret):
  rng = np.random.default_rng(d + ps)
  b = make_batch(rng, [1, 30, 1], [100, 30, 64], d=d, ps=ps, group=3,
                 kvh=2, dtype=dtype)
  check(b, interpret)


def test_decode_next_to_long_chunk_over_cached_prefix(interpret):
  """1-token decode beside a 300-token chunk over a 500-token prefix."""
  rng = np.random.default_rng(7)
  b = make_batch(rng, [1, 300], [129, 800], kvh=1, group=4, d=64)
  check(b, interpret)


@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_mixed_batch_split_at_the_decode_tile_boundary(group, interpret):
  """A mixed batch runs decodes and prefill chunks as two kernel calls; the
  split is at the decode tile's query count (16 rows // G). Chunks of exactly
  that many queries, and one more, sit on either side of it."""
  bq_d = max(16, 1 << (group - 1).bit_length()) // group
  rng = np.random.default_rng(group)
  b = make_batch(rng, [1, bq_d, bq_d + 1, 40, 1, 2],
                 [33, 100, 17 + bq_d, 300, 16, 2], group=group, num_slots=8)
  assert b.q.shape[0] > 8   # T > S: the split path
  check(b, interpret)
  # Every slot just past the boundary (the decode call has one tile a slot).
  b = make_batch(rng, [bq_d + 1] * 7 + [bq_d], [64] * 7 + [bq_d],
                 group=group, num_slots=8)
  check(b, interpret)


@pytest.mark.parametrize("num_prefills", [1, 3])
def test_max_num_partial_prefills_bounds_the_prefill_tiles(num_prefills, interpret):
  """With the scheduler's promise of at most N multi-query sequences, the
  prefill call gets only N sequences' worth of tiles, wherever they sit."""
  rng = np.random.default_rng(num_prefills)
  q_lens = [1] * 8
  kv_lens = [40 + 9 * i for i in range(8)]
  for i in rng.choice(8, num_prefills, replace=False):
    q_lens[i], kv_lens[i] = 37, kv_lens[i] + 36
  b = make_batch(rng, q_lens, kv_lens, num_slots=16)
  check(b, interpret, max_num_partial_prefills=num_prefills)


def test_padding_slots_and_tokens(interpret):
  """num_seqs < S; junk cu_q_lens / kv_lens / tables in padding slots."""
  rng = np.random.default_rng(3)
  b = make_batch(rng, [1, 9, 1], [20, 9, 5], num_slots=6, extra_tokens=7)
  b.cu_q_lens[4:] = [999, -5, 3]       # garbage past num_seqs is ignored
  b.kv_lens[3:] = [77, 0, 1000]
  b.page_table[3:] = 0
  check(b, interpret)


def test_zero_live_sequences(interpret):
  rng = np.random.default_rng(4)
  b = make_batch(rng, [2, 3], [5, 6])
  b.num_seqs = 0
  for backend in BACKENDS:
    assert np.all(run(b, backend, interpret) == 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layer_stacked_pool(dtype, interpret):
  rng = np.random.default_rng(11)
  b = make_batch(rng, [1, 12, 1], [33, 40, 16], layers=3, group=4,
                 dtype=dtype)
  check(b, interpret)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 8])
def test_split_kv_matches(num_splits, interpret):
  rng = np.random.default_rng(5)
  b = make_batch(rng, [1, 1, 4, 1], [200, 17, 130, 1], group=4,
                 num_slots=16)
  check(b, interpret, num_splits=num_splits)


@pytest.mark.parametrize("block_q,ppb", [(1, 1), (8, 2), (32, 4)])
def test_tiling_overrides(block_q, ppb, interpret):
  rng = np.random.default_rng(block_q)
  b = make_batch(rng, [5, 1, 40], [70, 3, 40], group=2, kvh=2)
  check(b, interpret, block_q=block_q, pages_per_block=ppb)


@pytest.mark.parametrize("garbage", [np.nan, 1e30, -np.inf])
def test_garbage_in_unused_slots_does_not_change_result(garbage, interpret):
  rng = np.random.default_rng(9)
  clean = make_batch(rng, [1, 25, 1], [47, 49, 16], garbage=0.0)
  dirty = dataclasses.replace(clean)
  used = np.asarray(clean.k_pages != 0)
  dirty.k_pages = np.where(used, clean.k_pages, garbage).astype(clean.q.dtype)
  dirty.v_pages = np.where(used, clean.v_pages, garbage).astype(clean.q.dtype)
  for backend in BACKENDS:
    np.testing.assert_array_equal(run(clean, backend, interpret),
                                  run(dirty, backend, interpret))


def test_inside_jit_and_scan_over_layers(interpret):
  """Traced num_seqs and layer (scan index) on a stacked pool."""
  rng = np.random.default_rng(12)
  b = make_batch(rng, [1, 6], [20, 6], layers=2)
  q, kp, vp, kvl, pt, cu, ns = b.args()

  @functools.partial(jax.jit, static_argnames="backend")
  def step(ns, backend):
    def body(carry, layer):
      o = ragged_paged_attention(q, kp, vp, kvl, pt, cu, ns, layer=layer,
                                 sm_scale=b.sm_scale, backend=backend,
                                 interpret=interpret)
      return carry, o
    return jax.lax.scan(body, 0, jnp.arange(2, dtype=jnp.int32))[1]

  for backend in BACKENDS:
    outs = np.asarray(step(ns, backend))
    for layer in range(2):
      want = oracle(dataclasses.replace(b, layer=layer))
      limit = tolerance(jnp.float32, backend, interpret)
      assert np.abs(outs[layer] - want).max() <= limit


def test_auto_backend_is_the_native_kernel_off_gpu():
  if jax.default_backend() == "gpu":
    pytest.skip("auto picks pallas on GPU")
  rng = np.random.default_rng(1)
  b = make_batch(rng, [2], [2])
  np.testing.assert_array_equal(run(b, "auto"), run(b, "cpu"))
  lowered = jax.jit(functools.partial(
      ragged_paged_attention, sm_scale=b.sm_scale)).lower(*b.args())
  assert "jaxpaged_cpu_attention" in lowered.as_text()


@pytest.mark.parametrize("ppb", [1, 2, 5])
def test_xla_blocks_match_reference_across_block_sizes(ppb):
  """Several loop iterations, a partial last block, contexts of different lengths."""
  rng = np.random.default_rng(21)
  b = make_batch(rng, [1, 30, 1, 7], [200, 90, 3, 7], group=4, num_slots=8)
  want = oracle(b)
  got = run(b, "xla", pages_per_block=ppb)
  assert np.abs(got - want).max() <= 2e-5


def test_validation_errors():
  rng = np.random.default_rng(0)
  b = make_batch(rng, [2], [2])
  q, kp, vp, kvl, pt, cu, ns = b.args()
  f = functools.partial(ragged_paged_attention, sm_scale=0.1)
  with pytest.raises(ValueError, match="backend"):
    f(q, kp, vp, kvl, pt, cu, ns, backend="cuda")
  with pytest.raises(ValueError, match="not divisible"):
    f(q[:, :7], kp, vp, kvl, pt, cu, ns)
  with pytest.raises(ValueError, match="head_dim"):
    f(q[..., :32], kp, vp, kvl, pt, cu, ns)
  with pytest.raises(ValueError, match="must equal q dtype"):
    f(q.astype(jnp.bfloat16), kp, vp, kvl, pt, cu, ns)
  with pytest.raises(ValueError, match="kv_lens"):
    f(q, kp, vp, kvl.astype(jnp.float32), pt, cu, ns)
  with pytest.raises(ValueError, match="cu_q_lens"):
    f(q, kp, vp, kvl, pt, cu[:-1], ns)
  with pytest.raises(ValueError, match="layer"):
    f(q, kp, vp, kvl, pt, cu, ns, layer=jnp.int32(0))
  with pytest.raises(ValueError, match="max_num_partial_prefills"):
    f(q, kp, vp, kvl, pt, cu, ns, max_num_partial_prefills=0)
  with pytest.raises(ValueError, match="power-of-two head_dim"):
    d = 48
    f(q[..., :d], kp[..., :d], vp[..., :d], kvl, pt, cu, ns,
      backend="pallas", interpret=True)
  huge = jax.ShapeDtypeStruct((1, 2**27, 16, 16), jnp.float32)  # 2^31 slots
  with pytest.raises(ValueError, match="int32 row indices"):
    jax.eval_shape(functools.partial(f, backend="pallas", interpret=True),
                   jax.ShapeDtypeStruct((2, 1, 16), jnp.float32), huge, huge,
                   kvl, pt, cu, ns)


def _random_layout_case(interpret, seqs, pad_slots, group, ps):
  """q_len in [1, 40], cached prefix in [0, 40], random padding slots."""
  q_lens = [q for q, _ in seqs]
  kv_lens = [q + c for q, c in seqs]
  rng = np.random.default_rng(sum(kv_lens) * 31 + group)
  b = make_batch(rng, q_lens, kv_lens, group=group, ps=ps, kvh=1,
                 num_slots=len(seqs) + pad_slots, d=16)
  check(b, interpret)


if hypothesis is not None:
  _LAYOUTS = dict(
      seqs=st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)),
                    min_size=1, max_size=4),
      pad_slots=st.integers(0, 2),
      group=st.sampled_from([1, 2, 3]),
      ps=st.sampled_from([16, 32]),
  )

  @hypothesis.settings(max_examples=6, deadline=None, derandomize=True)
  @hypothesis.given(**_LAYOUTS)
  def test_property_random_ragged_layouts(interpret, seqs, pad_slots, group,
                                          ps):
    _random_layout_case(interpret, seqs, pad_slots, group, ps)

  @pytest.mark.slow
  @hypothesis.settings(max_examples=60, deadline=None)
  @hypothesis.given(**_LAYOUTS)
  def test_property_random_ragged_layouts_many(interpret, seqs, pad_slots,
                                               group, ps):
    _random_layout_case(interpret, seqs, pad_slots, group, ps)

else:

  def test_property_random_ragged_layouts():
    pytest.skip("hypothesis not installed")


@pytest.mark.slow
@pytest.mark.parametrize("num_slots", [4, 16])
def test_llama3_8b_shapes_bf16(num_slots, interpret):
  """Real GQA shape (32 q / 8 kv heads, D=128), decode-like and mixed."""
  rng = np.random.default_rng(num_slots)
  b = make_batch(rng, [1, 1, 40, 1], [300, 17, 200, 64], kvh=8, group=4,
                 d=128, num_slots=num_slots, dtype=jnp.bfloat16)
  check(b, interpret)


# --------------------------------------------------------------------------
# Sliding windows.
# --------------------------------------------------------------------------

# Ragged mixed batches: decodes and prefill chunks (some over a cached
# prefix), several sequences, contexts 1..130.
WINDOW_BATCHES = {
    "mixed": ([1, 20, 1, 33, 1], [40, 52, 9, 33, 130], dict(num_slots=8)),
    "decode": ([1] * 6, [1, 15, 16, 17, 70, 130], dict(num_slots=8)),
    "prefill": ([45, 3, 70], [45, 50, 130], {}),
    "small_step": ([4, 1, 3, 1], [40, 17, 130, 66], dict(num_slots=8)),
}
# Smaller than, equal to and larger than the contexts; <= 0: no window.
WINDOWS = [1, 7, 16, 130, 1000, -3]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("name", list(WINDOW_BATCHES))
def test_sliding_window_matches_oracle(name, window, interpret):
  """Every backend against the float64 oracle; keys before each sequence's
  first window are garbage and pages wholly before it are off the table."""
  q_lens, kv_lens, kw = WINDOW_BATCHES[name]
  rng = np.random.default_rng(zlib.crc32(f"{name}{window}".encode()))
  b = make_batch(rng, q_lens, kv_lens, group=4, kvh=2, **kw)
  check(drop_out_of_window(dataclasses.replace(b, sliding_window=window)),
        interpret)


@pytest.mark.parametrize("group", [1, 3, 8])
def test_sliding_window_gqa_and_page_size(group, interpret):
  rng = np.random.default_rng(group)
  b = make_batch(rng, [1, 40, 1, 5], [300, 100, 64, 77], group=group, kvh=1,
                 ps=32, num_slots=6)
  for window in (31, 64, 65):
    check(drop_out_of_window(dataclasses.replace(b, sliding_window=window)),
          interpret)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_sliding_window_split_kv(num_splits, interpret):
  """Flash-decoding splits share out only the window's blocks."""
  rng = np.random.default_rng(num_splits)
  b = make_batch(rng, [1, 1, 4, 1], [500, 17, 230, 90], group=4,
                 num_slots=16)
  for window in (20, 100):
    check(drop_out_of_window(dataclasses.replace(b, sliding_window=window)),
          interpret, num_splits=num_splits)


@pytest.mark.parametrize("block_q,ppb", [(1, 1), (8, 2), (32, 4)])
def test_sliding_window_tiling_overrides(block_q, ppb, interpret):
  """Tall tiles with windows narrower than a tile, a block, and both."""
  rng = np.random.default_rng(block_q + 100)
  b = make_batch(rng, [5, 1, 60], [70, 3, 90], group=2, kvh=2)
  for window in (3, 20, 50):
    check(drop_out_of_window(dataclasses.replace(b, sliding_window=window)),
          interpret, block_q=block_q, pages_per_block=ppb)


def test_sliding_window_in_bf16(interpret):
  rng = np.random.default_rng(77)
  b = make_batch(rng, [1, 30, 1], [200, 90, 64], d=128, group=4,
                 dtype=jnp.bfloat16)
  check(drop_out_of_window(dataclasses.replace(b, sliding_window=48)),
        interpret)


def test_traced_per_layer_windows_in_a_scan(interpret):
  """A mixed local/global stack in one step: the scan picks each layer's
  window (0: global) from an array, so the window is traced."""
  rng = np.random.default_rng(13)
  b = make_batch(rng, [1, 30, 1, 9], [90, 60, 33, 9], layers=3, num_slots=6)
  windows = np.array([8, 0, 33], np.int32)
  q, kp, vp, kvl, pt, cu, ns = b.args()

  @functools.partial(jax.jit, static_argnames="backend")
  def step(windows, backend):
    def body(carry, xs):
      layer, window = xs
      if backend == "pallas":
        o = poisoned_pallas(q, kp, vp, kvl, pt, cu, ns, layer=layer,
                            sliding_window=window, sm_scale=b.sm_scale,
                            interpret=interpret)
      else:
        o = ragged_paged_attention(q, kp, vp, kvl, pt, cu, ns, layer=layer,
                                   sliding_window=window, sm_scale=b.sm_scale,
                                   backend=backend)
      return carry, o
    layers = jnp.arange(3, dtype=jnp.int32)
    return jax.lax.scan(body, 0, (layers, windows))[1]

  for backend in BACKENDS:
    outs = np.asarray(step(jnp.asarray(windows), backend))
    for layer, window in enumerate(windows):
      want = oracle(dataclasses.replace(b, layer=layer,
                                        sliding_window=int(window)))
      err = np.abs(outs[layer] - want).max()
      assert err <= tolerance(jnp.float32, backend, interpret), (
          backend, layer, err)


def test_no_window_and_non_positive_window_agree(interpret):
  """sliding_window=None (static) and a traced 0 are the same attention."""
  rng = np.random.default_rng(2)
  b = make_batch(rng, [1, 12, 1], [50, 40, 16])
  for backend in BACKENDS:
    np.testing.assert_allclose(
        run(dataclasses.replace(b, sliding_window=0), backend, interpret),
        run(b, backend, interpret), atol=1e-6)


def test_sliding_window_validation():
  rng = np.random.default_rng(0)
  b = make_batch(rng, [2], [2])
  f = functools.partial(ragged_paged_attention, *b.args(), sm_scale=0.1)
  with pytest.raises(ValueError, match="sliding_window"):
    f(sliding_window=jnp.float32(4.0))
  with pytest.raises(ValueError, match="sliding_window"):
    f(sliding_window=jnp.array([4, 4], jnp.int32))


@pytest.mark.parametrize("budget_tokens", [1, 4, 1000])
def test_reference_in_token_groups_matches_oracle(budget_tokens, monkeypatch):
  """The reference gathers all tokens' rows at once where they fit, else
  maps over groups of tokens (a remainder group included)."""
  rng = np.random.default_rng(8)
  b = make_batch(rng, [1, 9, 1], [20, 30, 5], extra_tokens=2)
  b = dataclasses.replace(b, sliding_window=6)
  row = b.k_pages.shape[0] * b.page_table.size // b.page_table.shape[0] * (
      b.k_pages.shape[2] * b.q.shape[2])
  monkeypatch.setattr(reference, "_GATHER_BUDGET", budget_tokens * row)
  got = reference.ragged_paged_attention_reference(
      *b.args(), sm_scale=b.sm_scale, sliding_window=jnp.int32(6))
  live = int(b.cu_q_lens[b.num_seqs])
  assert np.abs(np.asarray(got)[:live] - oracle(b)[:live]).max() < 2e-5
  assert np.all(np.asarray(got)[live:] == 0)
