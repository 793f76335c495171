// The sampler's exact top_k / top_p cut on the CPU, per row, an XLA FFI custom call (see cpu_sampler.py);
// below it, lax.top_k of each row and the rows' argmax / log-sum-exp / finiteness (RowStats).
//
// threshold[r] = the largest logit keeping >= top_k[r] tokens of row r (the k-th largest), then the
// largest keeping probability mass >= top_p[r] of those survivors; -inf when both are off. XLA:CPU
// finds it by 32 bisection halvings, each a pass over the row (jaxpaged.sampler._bisect_threshold:
// 24 ms at 32 x 49k, ~0.75 ms a pass). Here each row is a radix select on the order-preserving
// u32 key of its logits: a 2048-bin histogram of the key's top 11 bits (counts for top_k, weights
// exp(x - max) for top_p), the bin where the running sum from the top reaches the target, then
// the next 11 and the last 10 bits over that bin's elements only: three passes, the last two over
// a fraction of the row. Sums are in double (XLA's are f32 in its own order): the two can differ
// only where a row's mass reaches top_p within rounding at a token. Rows are work items shared
// with XLA's intra-op thread pool (cpu_pool.h).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// u32 keys in the order of the f32 values (-inf lowest), as _sortable in sampler.py.
inline uint32_t sortable(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return (bits >> 31) ? ~bits : (bits | 0x80000000u);
}

inline float unsortable(uint32_t key) {
  const uint32_t bits = (key >> 31) ? (key & 0x7FFFFFFFu) : ~key;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// exp(x) for x <= 0, in a form the compiler vectorises (glibc's expf is a call per element): 2^n e^r with
// n = round(x / ln 2), |r| <= ln 2 / 2 and e^r by its degree-6 Taylor polynomial (relative error < 2e-7,
// against the float32 rounding of the sums the cut is exact to); 0 below -87 (and for -inf).
inline float exp_nonpositive(float x) {
  const float clamped = x < -87.0f ? -87.0f : x;
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  const float r = (clamped - n * 0.693145751953125f) - n * 1.428606765330187e-6f;
  const float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
  const int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.0f ? 0.0f : p * scale;
}

// The largest key t such that the sum of w[i] over keys[i] >= t is >= target (w null: all ones), for a
// target no larger than the row's total; the lowest key present if rounding leaves none reaching it.
uint32_t largest_key(const uint32_t* keys, const float* w, int64_t n, double target) {
  static constexpr int kBits[3] = {11, 11, 10};
  thread_local std::vector<uint32_t> bin_keys[2];
  thread_local std::vector<float> bin_w[2];
  double above = 0.0;  // weight of the keys above the bins looked at so far
  uint32_t prefix = 0;
  int consumed = 0;
  for (int level = 0; level < 3; ++level) {
    const int bits = kBits[level], shift = 32 - consumed - bits;
    const uint32_t mask = (1u << bits) - 1;
    double bins[2048] = {0.0};
    for (int64_t i = 0; i < n; ++i) bins[(keys[i] >> shift) & mask] += w ? double(w[i]) : 1.0;
    int chosen = -1, lowest = 0;
    for (int j = int(mask); j >= 0; --j) {
      if (bins[j] == 0.0) continue;
      lowest = j;
      if (above + bins[j] >= target) {
        chosen = j;
        break;
      }
      above += bins[j];
    }
    if (chosen < 0) chosen = lowest;  // rounding: no bin reached the target
    prefix |= uint32_t(chosen) << shift;
    consumed += bits;
    if (level == 2) break;
    std::vector<uint32_t>& next_keys = bin_keys[level];  // the chosen bin's elements, for the next level
    std::vector<float>& next_w = bin_w[level];
    next_keys.clear();
    next_w.clear();
    for (int64_t i = 0; i < n; ++i)
      if (((keys[i] >> shift) & mask) == uint32_t(chosen)) {
        next_keys.push_back(keys[i]);
        next_w.push_back(w ? w[i] : 1.0f);
      }
    keys = next_keys.data();
    w = next_w.data();
    n = int64_t(next_keys.size());
  }
  return prefix;
}

float row_threshold(const float* x, int64_t v, int32_t top_k, float top_p) {
  const bool k_on = top_k > 0 && top_k < v, p_on = top_p < 1.0f;
  if (!k_on && !p_on) return -std::numeric_limits<float>::infinity();
  thread_local std::vector<uint32_t> keys;
  thread_local std::vector<float> weights;
  keys.resize(v);
  uint32_t min_key = 0xFFFFFFFFu;
  float max_x = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < v; ++i) {
    keys[i] = sortable(x[i]);
    min_key = keys[i] < min_key ? keys[i] : min_key;
    max_x = x[i] > max_x ? x[i] : max_x;
  }
  const uint32_t k_key = k_on ? largest_key(keys.data(), nullptr, v, double(top_k)) : min_key;
  if (!p_on) return unsortable(k_key);
  weights.resize(v);
  double total = 0.0;
  for (int64_t i = 0; i < v; ++i) {
    weights[i] = keys[i] >= k_key ? exp_nonpositive(x[i] - max_x) : 0.0f;
    total += weights[i];
  }
  const uint32_t p_key = largest_key(keys.data(), weights.data(), v, double(top_p) * total);
  return unsortable(p_key > k_key ? p_key : k_key);
}

ffi::Error Threshold(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> top_k,
                     ffi::Buffer<ffi::F32> top_p, ffi::ResultBuffer<ffi::F32> threshold) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || top_k.dimensions().size() != 1 || top_k.dimensions()[0] != xd[0] ||
      top_p.dimensions().size() != 1 || top_p.dimensions()[0] != xd[0])
    return ffi::Error::InvalidArgument("cpu sampler threshold: x [R, V], top_k [R] and top_p [R]");
  const int64_t rows = xd[0], v = xd[1];
  const float* xp = x.typed_data();
  const int32_t* kp = top_k.typed_data();
  const float* pp = top_p.typed_data();
  float* out = threshold->typed_data();
  if (v == 0) {
    for (int64_t r = 0; r < rows; ++r) out[r] = -std::numeric_limits<float>::infinity();
    return ffi::Error::Success();
  }
  jaxpaged::run_items(pool, rows, [=](int64_t r) { out[r] = row_threshold(xp + r * v, v, kp[r], pp[r]); });
  return ffi::Error::Success();
}

// lax.top_k of one row: the k largest values, descending, equal values in index order (-0 equals +0).
// A bound first: the k-th largest of the maxima of the row's 32-value chunks is at most the k-th largest
// value (k chunks hold a value at or above it), so only the values at or above it, in the chunks whose
// maximum reaches it, are candidates (at SmolLM2's 49k logits and k = 256: 330-420 of them); the first k in
// (value descending, index ascending) order are selected, then sorted. With fewer whole chunks than k every
// value is a candidate; with more than 4k + 1024 candidates (that, or a weak bound: ties, many values near the
// top) the radix select of the threshold finds the k-th largest key among them first.
void row_top_k(const float* x, int64_t v, int64_t k, float* values, int32_t* ids) {
  constexpr int64_t kChunk = 32;
  thread_local std::vector<std::pair<uint32_t, int32_t>> chosen;
  const auto key = [x](int64_t i) { return sortable(x[i] == 0.0f ? 0.0f : x[i]); };
  const int64_t chunks = v / kChunk;  // whole chunks; the tail's values are always candidates
  chosen.clear();
  if (chunks >= k) {
    thread_local std::vector<uint32_t> maxima, order;
    maxima.resize(chunks);
    for (int64_t c = 0; c < chunks; ++c) {
      uint32_t m = 0;
      for (int64_t i = c * kChunk; i < (c + 1) * kChunk; ++i) m = std::max(m, key(i));
      maxima[c] = m;
    }
    order.assign(maxima.begin(), maxima.end());
    std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), std::greater<uint32_t>());
    const uint32_t bound = order[k - 1];
    for (int64_t c = 0; c < chunks; ++c) {
      if (maxima[c] < bound) continue;
      for (int64_t i = c * kChunk; i < (c + 1) * kChunk; ++i)
        if (key(i) >= bound) chosen.emplace_back(key(i), int32_t(i));
    }
    for (int64_t i = chunks * kChunk; i < v; ++i) chosen.emplace_back(key(i), int32_t(i));
  } else {
    for (int64_t i = 0; i < v; ++i) chosen.emplace_back(key(i), int32_t(i));
  }
  const auto first = [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  };
  if (int64_t(chosen.size()) > 4 * k + 1024) {  // many candidates (a weak bound, or no bound): the k-th
    thread_local std::vector<uint32_t> candidate_keys;  // key by the radix select over the candidates, then
    candidate_keys.resize(chosen.size());                // the keys above it and its first ties, in index order
    for (size_t j = 0; j < chosen.size(); ++j) candidate_keys[j] = chosen[j].first;
    const uint32_t kth = largest_key(candidate_keys.data(), nullptr, int64_t(chosen.size()), double(k));
    int64_t ties = k;
    for (const auto& c : chosen) ties -= c.first > kth;
    size_t kept = 0;
    for (const auto& c : chosen)
      if (c.first > kth || (c.first == kth && ties-- > 0)) chosen[kept++] = c;
    chosen.resize(kept);
  }
  if (int64_t(chosen.size()) > k) std::nth_element(chosen.begin(), chosen.begin() + k, chosen.end(), first);
  std::sort(chosen.begin(), chosen.begin() + k, first);
  for (int64_t j = 0; j < k; ++j) {
    ids[j] = chosen[j].second;
    values[j] = x[chosen[j].second];
  }
}

ffi::Error TopK(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> values,
                ffi::ResultBuffer<ffi::S32> ids) {
  auto xd = x.dimensions();
  auto vd = values->dimensions();
  if (xd.size() != 2 || vd.size() != 2 || vd[0] != xd[0] || vd[1] > xd[1] || ids->dimensions().size() != 2 ||
      ids->dimensions()[0] != vd[0] || ids->dimensions()[1] != vd[1])
    return ffi::Error::InvalidArgument("cpu sampler top_k: x [R, V], values and ids [R, k], k <= V");
  const int64_t rows = xd[0], v = xd[1], k = vd[1];
  if (k == 0) return ffi::Error::Success();
  const float* xp = x.typed_data();
  float* vp = values->typed_data();
  int32_t* ip = ids->typed_data();
  jaxpaged::run_items(pool, rows, [=](int64_t r) { row_top_k(xp + r * v, v, k, vp + r * k, ip + r * k); });
  return ffi::Error::Success();
}

inline bool is_finite(float x) {  // by its bits: the flags above let the compiler fold x - x to 0
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return (bits & 0x7F800000u) != 0x7F800000u;
}

// The largest non-NaN value of x[0:v] (-inf if none); *nan: whether x holds a NaN; *non_finite: whether it
// holds a NaN or an infinity. AVX-512 where built for it: GCC does not vectorise a NaN-aware max.
inline float scan(const float* x, int64_t v, int* nan, int* non_finite) {
#ifdef __AVX512F__
  const __m512 low = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i exponent = _mm512_set1_epi32(0x7F800000);
  __m512 m = low;
  __mmask16 seen_nan = 0, seen_non_finite = 0;
  for (int64_t i = 0; i < v; i += 16) {
    const __mmask16 k = v - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (v - i)) - 1);
    const __m512 a = _mm512_mask_loadu_ps(low, k, x + i);
    seen_nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
    seen_non_finite |= _mm512_mask_cmpeq_epi32_mask(
        k, _mm512_and_si512(_mm512_castps_si512(a), exponent), exponent);
    m = _mm512_max_ps(a, m);  // a NaN in a: m's lane kept
  }
  *nan = seen_nan != 0;
  *non_finite = seen_non_finite != 0;
  return _mm512_reduce_max_ps(m);
#else
  float m = -std::numeric_limits<float>::infinity();
  *nan = *non_finite = 0;
  for (int64_t i = 0; i < v; ++i) {
    *nan |= x[i] != x[i];
    *non_finite |= !is_finite(x[i]);
    if (x[i] > m) m = x[i];
  }
  return m;
#endif
}

// One row of jaxpaged.sampler._scale, as XLA:CPU computes it: y = x * inv_t (it turns x / t into a product
// by 1 / t), threshold = max(y) + log_min_p, then y where y >= threshold, else -inf. One pass writing y, one
// reading it for the maximum (from cache), and the cut only when the threshold is not -inf (min_p off). The
// maximum leaves NaNs out; XLA's may not, so a row holding a NaN can differ (the sampler fails such rows).
void row_scale(const float* x, int64_t v, float inv_t, float log_min_p, float* y, float* threshold) {
  for (int64_t i = 0; i < v; ++i) y[i] = x[i] * inv_t;
  int nan, non_finite;
  const float t = scan(y, v, &nan, &non_finite) + log_min_p;
  *threshold = t;
  if (t == -std::numeric_limits<float>::infinity()) return;
  for (int64_t i = 0; i < v; ++i) y[i] = y[i] >= t ? y[i] : -std::numeric_limits<float>::infinity();
}

ffi::Error Scale(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> inv_t,
                 ffi::Buffer<ffi::F32> log_min_p, ffi::ResultBuffer<ffi::F32> y,
                 ffi::ResultBuffer<ffi::F32> threshold) {
  auto xd = x.dimensions();
  if (xd.size() != 2 || inv_t.dimensions().size() != 1 || inv_t.dimensions()[0] != xd[0] ||
      log_min_p.dimensions().size() != 1 || log_min_p.dimensions()[0] != xd[0] || y->dimensions().size() != 2 ||
      y->dimensions()[0] != xd[0] || y->dimensions()[1] != xd[1] || threshold->dimensions().size() != 1 ||
      threshold->dimensions()[0] != xd[0])
    return ffi::Error::InvalidArgument("cpu sampler scale: x [R, V], inv_t [R], log_min_p [R] -> y [R, V], "
                                       "threshold [R]");
  const int64_t v = xd[1];
  const float* xp = x.typed_data();
  const float* ip = inv_t.typed_data();
  const float* lp = log_min_p.typed_data();
  float* yp = y->typed_data();
  float* tp = threshold->typed_data();
  jaxpaged::run_items(pool, xd[0], [=](int64_t r) { row_scale(xp + r * v, v, ip[r], lp[r], yp + r * v, tp + r); });
  return ffi::Error::Success();
}

// One row's statistics for a greedy or sampled token's log-prob, in three passes over the row (XLA:CPU
// makes six): the first maximum of x (sampler._argmax: v - 1 when x holds a NaN), and over raw the
// log-sum-exp (NaN when raw holds a NaN or its maximum is infinite, as max + log(sum(exp(raw - max)))
// gives in XLA) and whether every value is finite. Sums in double.
void row_stats(const float* x, const float* raw, int64_t v, int32_t* arg, float* lse, bool* finite) {
  int nan, non_finite;
  const float m = scan(x, v, &nan, &non_finite);
  int64_t first = v - 1;
  for (int64_t i0 = 0; !nan && i0 < v; i0 += 64) {  // the first maximum, 64 values at a time
    const int64_t i1 = std::min(i0 + 64, v);
    int hit = 0;
    for (int64_t i = i0; i < i1; ++i) hit |= x[i] == m;
    if (!hit) continue;
    first = i0;
    while (x[first] != m) ++first;
    break;
  }
  *arg = int32_t(first);
  int raw_nan;
  const float rm = scan(raw, v, &raw_nan, &non_finite);
  *finite = !non_finite;
  if (raw_nan || !is_finite(rm)) {
    *lse = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  double total = 0;
  for (int64_t i = 0; i < v; ++i) total += exp_nonpositive(raw[i] - rm);
  *lse = rm + float(std::log(total));
}

ffi::Error RowStats(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> raw,
                    ffi::ResultBuffer<ffi::S32> arg, ffi::ResultBuffer<ffi::F32> lse,
                    ffi::ResultBuffer<ffi::PRED> finite) {
  auto xd = x.dimensions();
  auto rd = raw.dimensions();
  if (xd.size() != 2 || rd.size() != 2 || xd[0] != rd[0] || xd[1] != rd[1] || xd[1] < 1)
    return ffi::Error::InvalidArgument("cpu sampler row stats: x and raw [R, V], V >= 1");
  const int64_t rows = xd[0], v = xd[1];
  const float* xp = x.typed_data();
  const float* rp = raw.typed_data();
  int32_t* ap = arg->typed_data();
  float* lp = lse->typed_data();
  bool* fp = finite->typed_data();
  jaxpaged::run_items(pool, rows, [=](int64_t r) { row_stats(xp + r * v, rp + r * v, v, ap + r, lp + r, fp + r); });
  return ffi::Error::Success();
}

// ---- Gumbel-max candidates over a whole row (GumbelCandidates) ----
//
// A random row's token is argmax over kept tokens (logit >= threshold) of logit + noise, the noise
// -log(-log(u)) of the row's Threefry-2x32 stream at the token id (jaxpaged.sampler._gumbel_noise_at).
// The integer stream is computed here bit for bit; the two logs are float32 polynomials (relative error
// ~1e-7), not XLA's. So this call only names candidates: each row's C best tokens by its approximate
// score, and ok when every other token scores below the best by more than kMargin (far above the two
// logs' disagreement): the exact argmax is then among the C, and XLA's own noise at them picks it.

inline uint32_t rotl(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

// hi ^ lo of Threefry-2x32 (20 rounds) of key (k0, k1) on the counter (0, c): jax.random.bits' word for
// element c of a vector (sampler.threefry2x32).
inline uint32_t threefry_bits(uint32_t k0, uint32_t k1, uint32_t c) {
  static constexpr int kRot[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  const uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
  uint32_t x0 = ks[0], x1 = c + ks[1];
  for (int block = 0; block < 5; ++block) {
    for (int i = 0; i < 4; ++i) {
      x0 += x1;
      x1 = rotl(x1, kRot[block % 2][i]) ^ x0;
    }
    x0 += ks[(block + 1) % 3];
    x1 += ks[(block + 2) % 3] + uint32_t(block + 1);
  }
  return x0 ^ x1;
}

// log(x) for normal x > 0, in a form the compiler vectorises: x = m 2^e with m in [sqrt(1/2), sqrt(2)),
// log(m) = f - f^2 / 2 + f^3 P(f), f = m - 1, P Cephes' logf polynomial (relative error ~1e-7).
inline float log_positive(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  int32_t e = int32_t(bits >> 23) - 127;
  const uint32_t mbits = (bits & 0x007FFFFFu) | 0x3F800000u;  // m in [1, 2)
  float m;
  std::memcpy(&m, &mbits, sizeof m);
  const bool high = m > 1.41421356f;
  m = high ? 0.5f * m : m;
  e += high ? 1 : 0;
  const float f = m - 1.0f, z = f * f;
  float p = 7.0376836292e-2f;
  p = p * f - 1.1514610310e-1f;
  p = p * f + 1.1676998740e-1f;
  p = p * f - 1.2420140846e-1f;
  p = p * f + 1.4249322787e-1f;
  p = p * f - 1.6668057665e-1f;
  p = p * f + 2.0000714765e-1f;
  p = p * f - 2.4999993993e-1f;
  p = p * f + 3.3333331174e-1f;
  return f + (f * z * p - 0.5f * z) + float(e) * 0.693147180559945f;
}

constexpr int kMaxCandidates = 16;

// Row r's candidates: the best c (<= kMaxCandidates) approximate scores' ids, descending; ok as above.
void gumbel_candidates(const float* x, int64_t v, float threshold, uint32_t k0, uint32_t k1, int c,
                       int32_t* ids, bool* ok) {
  constexpr int kChunk = 64;
  float best[kMaxCandidates + 1];
  int32_t best_id[kMaxCandidates + 1];
  int kept = 0;  // entries of best[] in use (<= c + 1), descending
  float score[kChunk];
  for (int64_t base = 0; base < v; base += kChunk) {
    const int n = int(std::min<int64_t>(kChunk, v - base));
    for (int j = 0; j < n; ++j) {
      const uint32_t b = threefry_bits(k0, k1, uint32_t(base + j));
      const float u = (float(b >> 9) + 0.5f) * (1.0f / 8388608.0f);
      const float noise = -log_positive(-log_positive(u));
      const float xj = x[base + j];
      score[j] = xj >= threshold ? xj + noise : -std::numeric_limits<float>::infinity();
    }
    for (int j = 0; j < n; ++j) {
      const float sj = score[j];
      if (!(sj > -std::numeric_limits<float>::infinity()) || (kept == c + 1 && !(sj > best[c]))) continue;
      int at = kept == c + 1 ? c : kept++;  // drop the last when full
      while (at > 0 && best[at - 1] < sj) {  // ties keep the lower id first
        best[at] = best[at - 1];
        best_id[at] = best_id[at - 1];
        --at;
      }
      best[at] = sj;
      best_id[at] = int32_t(base + j);
    }
  }
  const float margin = 1e-3f + 2e-6f * std::fabs(kept ? best[0] : 0.0f);
  *ok = kept >= 1 && (kept <= c || best[c] < best[0] - margin);
  for (int i = 0; i < c; ++i) ids[i] = kept ? best_id[std::min(i, kept - 1)] : 0;
}

ffi::Error GumbelCandidates(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> threshold,
                            ffi::Buffer<ffi::U32> keys, ffi::Buffer<ffi::PRED> need,
                            ffi::ResultBuffer<ffi::S32> ids, ffi::ResultBuffer<ffi::PRED> ok) {
  auto xd = x.dimensions();
  auto kd = keys.dimensions();
  auto od = ids->dimensions();
  if (xd.size() != 2 || threshold.dimensions().size() != 1 || threshold.dimensions()[0] != xd[0] ||
      kd.size() != 2 || kd[0] != xd[0] || kd[1] != 2 || need.dimensions().size() != 1 ||
      need.dimensions()[0] != xd[0] || od.size() != 2 || od[0] != xd[0] || od[1] < 1 ||
      od[1] > kMaxCandidates)
    return ffi::Error::InvalidArgument("cpu sampler gumbel candidates: x [R, V], threshold [R], keys [R, 2], "
                                       "need [R] -> ids [R, C <= 16], ok [R]");
  const int64_t v = xd[1];
  const int c = int(od[1]);
  const float* xp = x.typed_data();
  const float* tp = threshold.typed_data();
  const uint32_t* kp = keys.typed_data();
  const bool* np_ = need.typed_data();
  int32_t* ip = ids->typed_data();
  bool* op = ok->typed_data();
  jaxpaged::run_items(pool, xd[0], [=](int64_t r) {
    if (!np_[r]) {
      std::fill(ip + r * c, ip + (r + 1) * c, 0);
      op[r] = false;
      return;
    }
    gumbel_candidates(xp + r * v, v, tp[r], kp[2 * r], kp[2 * r + 1], c, ip + r * c, op + r);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedCpuSamplerTopK, TopK,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedCpuSamplerThreshold, Threshold,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedCpuSamplerScale, Scale,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedCpuSamplerRowStats, RowStats,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedCpuSamplerGumbelCandidates, GumbelCandidates,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::PRED>>());
