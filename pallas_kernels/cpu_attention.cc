// Ragged paged attention on the CPU: an XLA FFI custom call (see cpu_attention.py).
//
// Work items are shared between the calling thread and XLA's intra-op thread
// pool (cpu_pool.h). A decode's item is one (sequence, KV head): its query's
// G heads read their keys page by page straight from the pool: scores for the
// whole span, one max, one exp pass, then V accumulated row by row. Every K/V
// byte a query needs is read once, with no gathered copy (the XLA path copies
// each block before its dots). With AVX-512 or AVX2, a sequence of several
// query tokens (a prefill chunk, a verification of drafts) is cut into tiles
// of up to 16 or 8 rows (tokens x the group's heads), one item each: a tile
// reads each key's row once for all its rows, its rows in the lanes of one
// vector (attend_tile), and the tiles share the threads however few the
// sequences and KV heads are.
//
// Shapes (f32): q [T, Hq, D]; k_pages, v_pages [L?, KVH, N, ps, D];
// kv_lens [S]; page_table [S, P]; cu_q_lens [S+1]; scalars num_seqs, layer,
// window (<= 0: none) -> out [T, Hq, D]; tokens past cu_q_lens[num_seqs] get
// zeros. A prefill chunk's tiles re-read the keys from cache, not memory.
// An fp8 pool (JaxpagedCpuAttentionFp8): k_pages, v_pages hold e4m3 bytes (u8)
// and k_scale, v_scale f32 [KVH] come with them; each key and value row a query
// reads is turned into floats (a 256-entry table times its head's scale) in a
// buffer of the worker thread's, and the float code runs over those rows.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// exp(x) for x <= 0 (scores minus their max), vectorisable: 2^n * p(f), n = round(x / ln 2), f = x - n ln 2
// (ln 2 in two parts), p of degree 6 (its coefficients, highest first). Relative error ~2e-7 on
// [-ln2/2, ln2/2]. exp_lanes computes the same in vector lanes.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693145751953125f, kLn2Lo = 1.42860682030941723e-6f;
constexpr float kExpPoly[] = {1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};

inline float fast_exp(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * kLog2e + 0.5f);
  const float f = x - n * kLn2Hi - n * kLn2Lo;
  float p = kExpPoly[0];
  for (int i = 1; i < 7; ++i) p = p * f + kExpPoly[i];
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// scores[0:span] -> their softmax, in place: one max, one exp pass, one scaling.
inline void softmax(float* scores, int64_t span) {
  float m = scores[0];
  for (int64_t i = 1; i < span; ++i) m = std::max(m, scores[i]);
  float l = 0.f;
  for (int64_t i = 0; i < span; ++i) {
    const float e = fast_exp(scores[i] - m);
    scores[i] = e;
    l += e;
  }
  const float inv = 1.f / l;
  for (int64_t i = 0; i < span; ++i) scores[i] *= inv;
}

// Pages are scattered in the pool: fetch the next one while this one is read.
inline void prefetch_page(const float* page, int64_t floats) {
  for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(page + i);
}

constexpr int64_t kMaxGroup = 16;     // query heads per KV head this kernel takes
constexpr int64_t kMaxHeadDim = 256;  // and head dim

struct Problem {
  const float* q;
  const float* k;  // this layer's [KVH, N, ps, D] (a float pool)
  const float* v;
  const uint8_t* k8 = nullptr;  // or this layer's e4m3 bytes [KVH, N, ps, D] (an fp8 pool)
  const uint8_t* v8 = nullptr;
  const float* k_scale = nullptr;  // an fp8 pool's scales [KVH]: a byte e of head h stands for e4m3(e) * scale[h]
  const float* v_scale = nullptr;
  const int32_t* kv_lens;
  const int32_t* page_table;
  const int32_t* cu;
  float* out;
  int64_t t, hq, kvh, n, ps, d, p;
  int32_t window;
  float scale;
  bool query_tiles;  // false: every query token on its own (attend_query), whatever its sequence's q_len
};

// Page `page` of KV head h in a [KVH, N, ps, D] pool; ids outside the pool are
// clamped (as XLA's gather does): a bad page table gives wrong rows, not a crash.
template <typename T>
inline const T* page_ptr(const T* pool, const Problem& pr, int64_t h, int64_t page) {
  page = std::clamp<int64_t>(page, 0, pr.n - 1);
  return pool + (h * pr.n + page) * pr.ps * pr.d;
}

// The value of each e4m3 byte (float8_e4m3fn: sign, 4 exponent bits with bias 7, 3 mantissa bits; exponent 0
// subnormal; S.1111.111 NaN, no infinities).
const float* e4m3_values() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int b = 0; b < 256; ++b) {
      const int exponent = (b >> 3) & 15, mantissa = b & 7;
      float x = exponent == 0 ? std::ldexp(mantissa / 8.0f, -6) : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
      if (exponent == 15 && mantissa == 7) x = NAN;
      t[b] = (b & 128) ? -x : x;
    }
    return t;
  }();
  return table.data();
}

// An fp8 pool's for_each_key: each key's row of bytes turned into floats (times the head's scale) in this thread's
// buffer for K (value = false) or V, rows lo..pos at [0, span), valid until the thread's next call for the same.
template <typename Fn>
inline void for_each_fp8_key(bool value, const Problem& pr, int64_t h, const int32_t* row, int64_t lo, int64_t pos,
                             int64_t d, Fn&& fn) {
  thread_local std::vector<float> stage[2];
  std::vector<float>& buf = stage[value];
  buf.resize(static_cast<size_t>((pos + 1 - lo) * d));
  const uint8_t* pool = value ? pr.v8 : pr.k8;
  const float scale = (value ? pr.v_scale : pr.k_scale)[h];
  const float* values = e4m3_values();
  const int64_t ps = pr.ps;
  for (int64_t first = lo - lo % ps; first <= pos; first += ps) {
    const uint8_t* page = page_ptr(pool, pr, h, row[first / ps]);
    if (first + ps <= pos) {
      const uint8_t* next = page_ptr(pool, pr, h, row[first / ps + 1]);
      for (int64_t i = 0; i < ps * d; i += 64) __builtin_prefetch(next + i);
    }
    const int64_t k1 = std::min(pos + 1, first + ps);
    for (int64_t kk = std::max(lo, first); kk < k1; ++kk) {
      const uint8_t* src = page + (kk - first) * d;
      float* dst = buf.data() + (kk - lo) * d;
      for (int64_t e = 0; e < d; ++e) dst[e] = values[src[e]] * scale;
      fn(kk, static_cast<const float*>(dst));
    }
  }
}

// fn(key index, its row of D floats) for the keys lo..pos of KV head h in the pool of keys (value = false) or
// values, page by page, the next page prefetched.
template <typename Fn>
inline void for_each_key(bool value, const Problem& pr, int64_t h, const int32_t* row,
                         int64_t lo, int64_t pos, int64_t d, Fn&& fn) {
  if (pr.k8 != nullptr) return for_each_fp8_key(value, pr, h, row, lo, pos, d, fn);
  const float* pool = value ? pr.v : pr.k;
  const int64_t ps = pr.ps;
  for (int64_t first = lo - lo % ps; first <= pos; first += ps) {
    const float* page = page_ptr(pool, pr, h, row[first / ps]);
    if (first + ps <= pos) prefetch_page(page_ptr(pool, pr, h, row[first / ps + 1]), ps * d);
    const int64_t k1 = std::min(pos + 1, first + ps);
    for (int64_t kk = std::max(lo, first); kk < k1; ++kk) fn(kk, page + (kk - first) * d);
  }
}

#ifdef __AVX512F__
// r[i] = the sum of v[i]'s 16 lanes, i < 16: a transposing add tree (45 shuffles and adds for 16 dot
// products, against ~8 instructions each for one horizontal sum).
inline __m512 lane_sums16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [v2i 0+2, v2i+1 0+2, v2i 1+3, v2i+1 1+3]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's sum of v4i .. v4i+3
    const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes: [b2i lanes 0+1, b2i lanes 2+3, b2i+1 0+1, b2i+1 2+3]
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// attend_query for head dims of whole vectors (DC = 64, 128, 256), AVX-512: the keys' rows gathered as
// pointers first, then per query head the scores 16 keys at a time (16 partial-product vectors summed
// by lane_sums16) and out = probs @ V with the head's accumulators in registers.
template <int DC>
void attend_query_avx512(const Problem& pr, int64_t s, int64_t h, int64_t token, int64_t pos,
                         std::vector<float>& scores) {
  thread_local std::vector<const float*> rows;
  constexpr int DV = DC / 16;  // vectors a row
  const int64_t g = pr.hq / pr.kvh;
  const int64_t lo = pr.window > 0 ? std::max<int64_t>(0, pos - pr.window + 1) : 0;
  const int64_t span = pos + 1 - lo, padded = (span + 15) / 16 * 16;
  scores.resize(static_cast<size_t>(g * padded));
  rows.resize(static_cast<size_t>(2 * padded));
  const float** krows = rows.data();
  const float** vrows = krows + padded;
  const int32_t* row = pr.page_table + s * pr.p;
  for_each_key(false, pr, h, row, lo, pos, DC, [&](int64_t kk, const float* kr) { krows[kk - lo] = kr; });
  for (int64_t i = span; i < padded; ++i) krows[i] = krows[span - 1];  // a block's tail: any valid row
  const float* qh = pr.q + (token * pr.hq + h * g) * DC;
  const __m512 scale = _mm512_set1_ps(pr.scale);
  for (int64_t j = 0; j < g; ++j) {
    __m512 q[DV];
    for (int c = 0; c < DV; ++c) q[c] = _mm512_mul_ps(_mm512_loadu_ps(qh + j * DC + 16 * c), scale);
    float* sj = scores.data() + j * padded;
    for (int64_t b = 0; b < padded; b += 16) {
      __m512 part[16];
      for (int i = 0; i < 16; ++i) {
        const float* kr = krows[b + i];
        __m512 acc = _mm512_mul_ps(q[0], _mm512_loadu_ps(kr));
        for (int c = 1; c < DV; ++c) acc = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(kr + 16 * c), acc);
        part[i] = acc;
      }
      _mm512_storeu_ps(sj + b, lane_sums16(part));
    }
    softmax(sj, span);
  }
  for_each_key(true, pr, h, row, lo, pos, DC, [&](int64_t kk, const float* vr) { vrows[kk - lo] = vr; });
  float* out = pr.out + (token * pr.hq + h * g) * DC;
  for (int64_t j = 0; j < g; ++j) {
    const float* sj = scores.data() + j * padded;
    __m512 acc[DV];
    for (int c = 0; c < DV; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t i = 0; i < span; ++i) {
      const __m512 w = _mm512_set1_ps(sj[i]);
      const float* vr = vrows[i];
      for (int c = 0; c < DV; ++c) acc[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr + 16 * c), acc[c]);
    }
    for (int c = 0; c < DV; ++c) _mm512_storeu_ps(out + j * DC + 16 * c, acc[c]);
  }
}

#endif

// Query tiles: the vector ops attend_tile needs, for the widths it is built for (JAXPAGED_QUERY_TILES).
//   AVX-512: 16 rows a tile, P @ V by groups of 6 rows x up to 4 vectors (24 of 32 registers accumulate).
//   AVX2 + FMA: 8 rows a tile, groups of 2 rows x up to 4 vectors (8 of 16 registers).
#if defined(__AVX512F__)
#define JAXPAGED_QUERY_TILES 1
struct TileOps {
  using F = __m512;
  using I = __m512i;
  static constexpr int kLanes = 16, kRowGroup = 6;
  // Fewer rows than this: one query token after another. Session 32, Zen 4 (2 cores), 30 layers, the tile
  // path against per-query tokens: 9 / 3 heads, D = 64, 8 tokens at context 500: 3.2 vs 5.3 ms, 2,048 tokens
  // of prefill 0.94 vs 2.20 s; Llama-3-8B's 32 / 8 heads, D = 128, one token (4 rows) 10.3 vs 7.6 ms, two (8
  // rows) 11.6 vs 11.0; Gemma 3's 4 / 1, D = 256, one token 1.72 vs 1.27, two 2.07 vs 2.34.
  static constexpr int64_t kMinRows = 8;
  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F floor(F x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static F pow2(F p, F n) { return _mm512_scalef_ps(p, n); }  // p * 2^n
  static I iload(const int32_t* p) { return _mm512_loadu_si512(p); }
  static I iset1(int32_t x) { return _mm512_set1_epi32(x); }
  static I isub(I a, I b) { return _mm512_sub_epi32(a, b); }
  // x where first <= key <= pos (lane by lane), else -inf.
  static F keep(F x, I key, I pos, I first) {
    const __mmask16 ok = _mm512_cmple_epi32_mask(key, pos) & _mm512_cmpge_epi32_mask(key, first);
    return _mm512_mask_blend_ps(ok, _mm512_set1_ps(-INFINITY), x);
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define JAXPAGED_QUERY_TILES 1
struct TileOps {
  using F = __m256;
  using I = __m256i;
  static constexpr int kLanes = 8, kRowGroup = 2;
  // Session 33, this Zen 4 running the AVX2 build (2 cores, 30 layers): one token of a group of 4 (4 rows) as a
  // tile against per query: Llama-3-8B's 32 / 8 heads, D = 128, 7.71 vs 6.48 ms; Gemma 3's 4 / 1, D = 256,
  // 2.92 vs 2.77; from 5 rows tiles won (Qwen-like 14 / 2, one token, 7 rows: 0.82 vs 1.06 ms).
  static constexpr int64_t kMinRows = 5;
  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F floor(F x) { return _mm256_floor_ps(x); }
  static F pow2(F p, F n) {  // p * 2^n, n >= -126 (the exponent bits built directly, as fast_exp does)
    const I bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  }
  static I iload(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I iset1(int32_t x) { return _mm256_set1_epi32(x); }
  static I isub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static F keep(F x, I key, I pos, I first) {
    const I out = _mm256_or_si256(_mm256_cmpgt_epi32(key, pos), _mm256_cmpgt_epi32(first, key));
    return _mm256_blendv_ps(x, _mm256_set1_ps(-INFINITY), _mm256_castsi256_ps(out));
  }
};
#endif

#ifdef JAXPAGED_QUERY_TILES
constexpr int64_t kTileRows = TileOps::kLanes;  // a tile's query rows (tokens x heads of the group): its lanes

// exp(x) for x <= 0, lane by lane: fast_exp's steps and constants (x below -87 gives ~1.6e-38, as there).
inline TileOps::F exp_lanes(TileOps::F x) {
  using O = TileOps;
  using F = O::F;
  x = O::max(x, O::set1(-87.0f));
  const F n = O::floor(O::fma(x, O::set1(kLog2e), O::set1(0.5f)));
  F f = O::fnma(n, O::set1(kLn2Hi), x);
  f = O::fnma(n, O::set1(kLn2Lo), f);
  F p = O::set1(kExpPoly[0]);
  for (int i = 1; i < 7; ++i) p = O::fma(p, f, O::set1(kExpPoly[i]));
  return O::pow2(p, n);
}

// A tile: nq consecutive query tokens of sequence s (token0.., positions pos0..) with the G heads of KV head h,
// nq * G <= kTileRows rows, one row per vector lane. The scores are kept transposed, st [span, kTileRows]: key
// kk's scores for all rows come from D broadcast-FMAs over a transposed copy of the rows' queries,
// qt [D, kTileRows], 8 keys at a time, each key's row of K read once for all the tile's rows (no horizontal
// sums); the softmax runs across keys with the rows in lanes (causal and window masks per lane); then
// out = P @ V by groups of kRowGroup rows and up to 4 vectors of D, normalised at the end.
template <int DC>
void attend_tile(const Problem& pr, int64_t s, int64_t h, int64_t token0, int64_t pos0, int64_t nq,
                 std::vector<float>& st) {
  using O = TileOps;
  using F = O::F;
  using I = O::I;
  thread_local std::vector<const float*> rows;
  constexpr int L = O::kLanes, DV = DC / L, CV = DV < 4 ? DV : 4, RG = O::kRowGroup;
  const int64_t g = pr.hq / pr.kvh, live = nq * g, last = pos0 + nq - 1;
  const int64_t lo = pr.window > 0 ? std::max<int64_t>(0, pos0 - pr.window + 1) : 0;
  const int64_t span = last + 1 - lo, padded = (span + 7) / 8 * 8;
  rows.resize(static_cast<size_t>(2 * padded));
  const float** krows = rows.data();
  const float** vrows = krows + padded;
  const int32_t* row = pr.page_table + s * pr.p;
  for_each_key(false, pr, h, row, lo, last, DC, [&](int64_t kk, const float* kr) { krows[kk - lo] = kr; });
  for (int64_t i = span; i < padded; ++i) krows[i] = krows[span - 1];
  alignas(64) float qt[DC * kTileRows] = {};  // padding lanes: zero queries, finite scores, never stored
  alignas(64) int32_t row_pos[kTileRows];
  for (int64_t r = 0; r < kTileRows; ++r) {
    const int64_t t = r < live ? r / g : nq - 1;
    row_pos[r] = static_cast<int32_t>(pos0 + t);
    if (r >= live) continue;
    const float* qr = pr.q + ((token0 + t) * pr.hq + h * g + r % g) * DC;
    for (int d = 0; d < DC; ++d) qt[d * kTileRows + r] = qr[d] * pr.scale;
  }
  const I pos = O::iload(row_pos);
  const I first = pr.window > 0 ? O::isub(pos, O::iset1(pr.window - 1)) : O::iset1(0);  // rows' first keys
  // + RG: P @ V's last group reads up to RG - 1 lanes past a key's row (the next row's, or this tail)
  st.resize(static_cast<size_t>(padded * kTileRows + RG));
  F m = O::set1(-INFINITY);
  for (int64_t b = 0; b < padded; b += 8) {
    F acc[8];
    for (int u = 0; u < 8; ++u) acc[u] = O::zero();
    for (int d = 0; d < DC; ++d) {
      const F qd = O::load(qt + d * kTileRows);
      for (int u = 0; u < 8; ++u) acc[u] = O::fma(O::set1(krows[b + u][d]), qd, acc[u]);
    }
    for (int u = 0; u < 8 && b + u < span; ++u) {
      const F sc = O::keep(acc[u], O::iset1(static_cast<int32_t>(lo + b + u)), pos, first);
      m = O::max(m, sc);
      O::store(st.data() + (b + u) * kTileRows, sc);
    }
  }
  F l = O::zero();
  for (int64_t i = 0; i < span; ++i) {
    const F e = exp_lanes(O::sub(O::load(st.data() + i * kTileRows), m));
    l = O::add(l, e);
    O::store(st.data() + i * kTileRows, e);
  }
  alignas(64) float inv[kTileRows];
  O::store(inv, O::div(O::set1(1.0f), l));
  for_each_key(true, pr, h, row, lo, last, DC, [&](int64_t kk, const float* vr) { vrows[kk - lo] = vr; });
  for (int64_t r0 = 0; r0 < live; r0 += RG) {
    for (int c0 = 0; c0 < DV; c0 += CV) {
      F acc[RG][CV];
      for (int r = 0; r < RG; ++r)
        for (int c = 0; c < CV; ++c) acc[r][c] = O::zero();
      for (int64_t i = 0; i < span; ++i) {
        const float* vr = vrows[i] + L * c0;
        const float* p = st.data() + i * kTileRows + r0;  // lanes past kTileRows: padding, never stored
        F vv[CV];
        for (int c = 0; c < CV; ++c) vv[c] = O::load(vr + L * c);
        for (int r = 0; r < RG; ++r) {
          const F w = O::set1(p[r]);
          for (int c = 0; c < CV; ++c) acc[r][c] = O::fma(w, vv[c], acc[r][c]);
        }
      }
      for (int64_t r = 0; r < RG && r0 + r < live; ++r) {
        const int64_t rr = r0 + r;
        float* out = pr.out + ((token0 + rr / g) * pr.hq + h * g + rr % g) * DC + L * c0;
        const F scale = O::set1(inv[rr]);
        for (int c = 0; c < CV; ++c) O::store(out + L * c, O::mul(acc[r][c], scale));
      }
    }
  }
}
#endif

// One query token's G heads against KV head h, keys lo..pos: scores [G, span]
// page by page, softmax, then out [G, D] = probs @ V, accumulated locally.
// DC: the head dim as a compile-time constant (64, 128, 256), or 0 for any other (<= kMaxHeadDim);
// built for AVX-512, DC > 0 goes to attend_query_avx512.
template <int DC>
void attend_query(const Problem& pr, int64_t s, int64_t h, int64_t token, int64_t pos,
                  std::vector<float>& scores) {
#ifdef __AVX512F__
  if constexpr (DC > 0) return attend_query_avx512<DC>(pr, s, h, token, pos, scores);
#endif
  constexpr int64_t kBuf = DC > 0 ? DC : kMaxHeadDim;
  const int64_t D = DC > 0 ? DC : pr.d;
  const int64_t g = pr.hq / pr.kvh;
  const int64_t lo = pr.window > 0 ? std::max<int64_t>(0, pos - pr.window + 1) : 0;
  const int64_t span = pos + 1 - lo;
  scores.resize(static_cast<size_t>(g * span));
  float* sc = scores.data();
  const int32_t* row = pr.page_table + s * pr.p;
  alignas(64) float qloc[kMaxGroup * kBuf];
  const float* qh = pr.q + (token * pr.hq + h * g) * D;
  for (int64_t i = 0; i < g * D; ++i) qloc[i] = qh[i] * pr.scale;
  for_each_key(false, pr, h, row, lo, pos, D, [&](int64_t kk, const float* kr) {
    for (int64_t j = 0; j < g; ++j) {
      const float* qj = qloc + j * D;
      float acc = 0.f;
      for (int e = 0; e < D; ++e) acc += qj[e] * kr[e];
      sc[j * span + (kk - lo)] = acc;
    }
  });
  for (int64_t j = 0; j < g; ++j) softmax(sc + j * span, span);
  alignas(64) float acc[kMaxGroup * kBuf] = {};
  for_each_key(true, pr, h, row, lo, pos, D, [&](int64_t kk, const float* vr) {
    for (int64_t j = 0; j < g; ++j) {
      const float w = sc[j * span + (kk - lo)];
      float* aj = acc + j * D;
      for (int e = 0; e < D; ++e) aj[e] += w * vr[e];
    }
  });
  std::memcpy(pr.out + (token * pr.hq + h * g) * D, acc, sizeof(float) * g * D);
}

// A work item: query tokens begin .. begin + count - 1 (offsets in sequence s) against KV head h, as one tile
// (attend_tile) or one query token after another (attend_query).
struct Item {
  int32_t s, h, begin, count;
  bool tile;
};

// Whether sequence s's q_len queries run as tiles here (AVX-512 or AVX2, head dims of whole vectors, at
// least TileOps::kMinRows rows in a tile), and how many tokens a tile takes.
inline int64_t tile_tokens(const Problem& pr, int64_t q_len) {
#ifdef JAXPAGED_QUERY_TILES
  const int64_t g = pr.hq / pr.kvh, most = kTileRows / g;
  if ((pr.d == 64 || pr.d == 128 || pr.d == 256) && most >= 1 && std::min(q_len, most) * g >= TileOps::kMinRows)
    return most;
#endif
  return 0;
}

// The items of sequences 0 .. num_seqs - 1: per KV head, the tiles of a sequence's queries cut into near-equal
// runs of at most tile_tokens tokens, or all its queries as one item.
std::vector<Item> work_items(const Problem& pr, int64_t num_seqs) {
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = pr.cu[s + 1] - pr.cu[s];
    if (q_len < 1) continue;
    const bool malformed = pr.cu[s] < 0 || pr.cu[s + 1] > pr.t;  // one item each, which attend_item skips
    // Without query tiles (batch-invariant mode) a token's result does not depend on how its prompt was
    // chunked: a tile's rows and a lone query reduce in different orders.
    const int64_t most = malformed || !pr.query_tiles ? 0 : tile_tokens(pr, q_len);
    const int64_t tiles = most > 0 ? (q_len + most - 1) / most : 1;
    for (int64_t h = 0; h < pr.kvh; ++h)
      for (int64_t i = 0; i < tiles; ++i) {
        const int64_t begin = q_len * i / tiles, end = q_len * (i + 1) / tiles;
        items.push_back({static_cast<int32_t>(s), static_cast<int32_t>(h), static_cast<int32_t>(begin),
                         static_cast<int32_t>(end - begin), most > 0});
      }
  }
  return items;
}

void attend_item(const Problem& pr, const Item& item, std::vector<float>& scores) {
  const int64_t s = item.s, h = item.h;
  const int64_t begin = pr.cu[s], q_len = pr.cu[s + 1] - begin;
  if (begin < 0 || begin + q_len > pr.t) return;  // malformed: leave zeros
  const int64_t kv_len = pr.kv_lens[s], pos0 = kv_len - q_len + item.begin, last = pos0 + item.count - 1;
#ifdef JAXPAGED_QUERY_TILES
  if (item.tile && pos0 >= 0 && last / pr.ps < pr.p) {
    switch (pr.d) {
      case 64: return attend_tile<64>(pr, s, h, begin + item.begin, pos0, item.count, scores);
      case 128: return attend_tile<128>(pr, s, h, begin + item.begin, pos0, item.count, scores);
      case 256: return attend_tile<256>(pr, s, h, begin + item.begin, pos0, item.count, scores);
    }
  }
#endif
  for (int64_t i = item.begin; i < item.begin + item.count; ++i) {
    const int64_t pos = kv_len - q_len + i;
    if (pos < 0 || pos / pr.ps >= pr.p) continue;  // malformed: leave zeros
    switch (pr.d) {
      case 64: attend_query<64>(pr, s, h, begin + i, pos, scores); break;
      case 128: attend_query<128>(pr, s, h, begin + i, pos, scores); break;
      case 256: attend_query<256>(pr, s, h, begin + i, pos, scores); break;
      default: attend_query<0>(pr, s, h, begin + i, pos, scores); break;
    }
  }
}

// The call's common part: shapes checked, the problem set up, the work items run. k_data, v_data: this call's pools,
// float or (with k_scale, v_scale [KVH]) e4m3 bytes.
ffi::Error Run(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Span<const int64_t> kd, const void* k_data,
               const void* v_data, const float* k_scale, const float* v_scale, ffi::Buffer<ffi::S32> kv_lens,
               ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs_buf,
               ffi::Buffer<ffi::S32> layer_buf, ffi::Buffer<ffi::S32> window_buf, float sm_scale, bool query_tiles,
               ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  if (qd.size() != 3 || (kd.size() != 4 && kd.size() != 5))
    return ffi::Error::InvalidArgument("cpu attention: q must be 3-D and the pool 4-D or 5-D");
  if (qd[2] < 1 || qd[2] > kMaxHeadDim)
    return ffi::Error::InvalidArgument("cpu attention: head_dim must be 1..256");
  if (qd[1] % kd[kd.size() - 4] || qd[1] / kd[kd.size() - 4] > kMaxGroup)
    return ffi::Error::InvalidArgument("cpu attention: at most 16 query heads per KV head");
  const int64_t r = kd.size();
  Problem pr;
  pr.t = qd[0];
  pr.hq = qd[1];
  pr.d = qd[2];
  pr.kvh = kd[r - 4];
  pr.n = kd[r - 3];
  pr.ps = kd[r - 2];
  pr.p = page_table.dimensions()[1];
  // A layer outside the stack is clamped, as page ids are: wrong rows, never a read past the pool.
  const int64_t layer = r == 5 ? std::clamp<int64_t>(layer_buf.typed_data()[0], 0, kd[0] - 1) : 0;
  const int64_t layer_elems = pr.kvh * pr.n * pr.ps * pr.d;
  pr.q = q.typed_data();
  if (k_scale != nullptr) {
    pr.k8 = static_cast<const uint8_t*>(k_data) + layer * layer_elems;
    pr.v8 = static_cast<const uint8_t*>(v_data) + layer * layer_elems;
    pr.k_scale = k_scale;
    pr.v_scale = v_scale;
  } else {
    pr.k = static_cast<const float*>(k_data) + layer * layer_elems;
    pr.v = static_cast<const float*>(v_data) + layer * layer_elems;
  }
  pr.kv_lens = kv_lens.typed_data();
  pr.page_table = page_table.typed_data();
  pr.cu = cu_q_lens.typed_data();
  pr.out = out->typed_data();
  pr.window = window_buf.typed_data()[0];
  pr.scale = sm_scale;
  pr.query_tiles = query_tiles;
  std::memset(pr.out, 0, sizeof(float) * qd[0] * qd[1] * qd[2]);
  const int64_t num_slots = kv_lens.dimensions()[0];
  const int64_t num_seqs = std::clamp<int64_t>(num_seqs_buf.typed_data()[0], 0, num_slots);

  // Work items: per sequence this call attends and KV head, its queries' tiles or all its queries.
  auto items = std::make_shared<const std::vector<Item>>(work_items(pr, num_seqs));
  jaxpaged::run_items(pool, static_cast<int64_t>(items->size()), [pr, items](int64_t i) {
    thread_local std::vector<float> scores;
    attend_item(pr, (*items)[i], scores);
  });
  return ffi::Error::Success();
}

ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                     ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> kv_lens,
                     ffi::Buffer<ffi::S32> page_table, ffi::Buffer<ffi::S32> cu_q_lens,
                     ffi::Buffer<ffi::S32> num_seqs_buf, ffi::Buffer<ffi::S32> layer_buf,
                     ffi::Buffer<ffi::S32> window_buf, float sm_scale, bool query_tiles,
                     ffi::ResultBuffer<ffi::F32> out) {
  return Run(pool, q, k_pages.dimensions(), k_pages.typed_data(), v_pages.typed_data(), nullptr, nullptr, kv_lens,
             page_table, cu_q_lens, num_seqs_buf, layer_buf, window_buf, sm_scale, query_tiles, out);
}

ffi::Error AttentionFp8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::U8> k_pages,
                        ffi::Buffer<ffi::U8> v_pages, ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                        ffi::Buffer<ffi::S32> kv_lens, ffi::Buffer<ffi::S32> page_table,
                        ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs_buf,
                        ffi::Buffer<ffi::S32> layer_buf, ffi::Buffer<ffi::S32> window_buf, float sm_scale,
                        bool query_tiles, ffi::ResultBuffer<ffi::F32> out) {
  const auto kd = k_pages.dimensions();
  if (kd.size() < 4 || k_scale.element_count() != kd[kd.size() - 4] || v_scale.element_count() != kd[kd.size() - 4])
    return ffi::Error::InvalidArgument("cpu attention: k_scale and v_scale must hold one value per KV head");
  return Run(pool, q, kd, k_pages.typed_data(), v_pages.typed_data(), k_scale.typed_data(), v_scale.typed_data(),
             kv_lens, page_table, cu_q_lens, num_seqs_buf, layer_buf, window_buf, sm_scale, query_tiles, out);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedCpuAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_pages
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Attr<float>("sm_scale")
                                  .Attr<bool>("query_tiles")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedCpuAttentionFp8, AttentionFp8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::U8>>()   // k_pages: e4m3 bytes
                                  .Arg<ffi::Buffer<ffi::U8>>()   // v_pages
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_scale [KVH]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_scale [KVH]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // kv_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page_table
                                  .Arg<ffi::Buffer<ffi::S32>>()  // cu_q_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // num_seqs
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // window
                                  .Attr<float>("sm_scale")
                                  .Attr<bool>("query_tiles")
                                  .Ret<ffi::Buffer<ffi::F32>>());
