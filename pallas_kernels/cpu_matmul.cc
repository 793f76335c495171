// Matmul on the CPU for a decode step's rows: y [M, N] = x [M, K] @ w [K, N], float32, an XLA
// FFI custom call (see cpu_matmul.py). Weight-only int8 too (JaxpagedCpuMatmulInt8): w blocked as
// int8 q with a float32 scale per column and run of `group` rows (32: llama.cpp's Q8_0 blocks); each row
// of w is a quarter of the bytes, widened to float32 in registers (the same tiles; every FMA stays
// float32), and each run's sums go into y times its scales. On the Zen 3 (AVX2), SmolLM2's dots (30
// layers and the LM head, min of 11 interleaved rounds) float32 -> int8 (runs of 32 rows): 1 row 19.2 ->
// 5.2 ms, 4 rows 15.4 -> 9.3, 8 rows 18.1 -> 15.9, 16 rows 25.6 -> 28.2, 32 rows 45.9 -> 52.9, 64 rows
// 88.1 -> 100.1: while memory bounds the product int8 reads a quarter of it, once the FMAs do the
// widening costs ~10-15%. One scale per column (no runs) was ~2% faster at 32 rows and twice as far
// from float32 (docs/benchmarks.md, "Weight-only int8 (CPU)"). From kDequantisedFromGroups row groups on
// (19+ rows: prefill, many decodes) each chunk is instead dequantised once, times its scales, into a
// float32 chunk in L1 that the float tiles read (`block_dequantised`): on a Zen 4 (SmolLM2-shaped int8
// stacks, interleaved, median of 9) 0.90-0.94x the in-register time at 32-256 rows with AVX-512 and
// 0.83-0.90x with the AVX2 build, the same at 8-24 rows. (Session 28's Zen 3 found a variant that kept
// the per-run flush in the tiles slower from 8 rows on: 8 rows 18.4 vs 14.4 ms, 32 rows 61.7 vs 52.9.)
//
// XLA:CPU hands a 17-32-row dot to YNNPACK, whose GEMM packs w on every call: each weight
// byte is read, written and read again, and the step's dots ran at ~55% of the cores' FMA
// rate. Here w is read in place. A work item is one 64-column block of w. The block goes
// through in chunks of kChunk rows of w; each chunk serves every row of x, in near-equal
// groups of at most 6, each group one or more register tiles of up to 6 rows (accumulators
// kept in y between chunks): one tile of 6 x 4 vectors with AVX-512, four of 6 x 2 with AVX2
// (see Vec below; before AVX2 had its own tiles, the AVX-512 source did not build there and
// the steps kept XLA's dots: on a 2-core Zen 3, a decode step of 8 sequences 82.9 -> 41.6 ms).
// While a chunk is computed on, its tiles prefetch the next chunk into L2 between them, so
// reading w from memory overlaps the FMAs:
// without it the first group of a block waited on memory and the others computed with
// memory idle (32 rows: 31.9 -> 27.8 ms for SmolLM2's dots). Items are shared between the
// calling thread and XLA's intra-op thread pool (cpu_pool.h).
//
// w comes in one of two layouts: [K, N] (row-major; a block's rows 4 * N bytes apart) or blocked,
// [N / 64, K, 64] (each column block one contiguous run, `block_weight` in cpu_matmul.py), the latter
// possibly stacked [L, N / 64, K, 64] with a layer index (a layer scan reads its layer in place). Blocked,
// a block is one sequential stream (4 rows of x: 16.0 -> 13.4 ms for SmolLM2's dots on the Zen 5
// machine). The software prefetch runs for every step size: on Zen 5 the hardware prefetcher kept
// ahead of a one-group stream, but on the Intel (AVX-512, 2 MiB L2) machine it did not: with the
// weights on huge pages (jaxpaged/host_memory.py), the bare stack at 1 row 18.6 -> 15.7 ms and at
// 4 rows 23.3 -> 16.8 with the prefetch.

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>

#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The vector unit the build targets (-march=native): a register tile is kMaxRows rows of x by
// kTileVecs vectors of w's columns, the accumulators and one row of w in registers.
//   AVX-512: 16 lanes, 4 vectors a tile row: one tile spans a whole 64-column block (32 registers).
//   AVX2 + FMA: 8 lanes; its 16 registers hold 6 x 2 accumulators, 2 vectors of w and the broadcast,
//     so a block is 4 tiles of 16 columns, each over the same rows of w (in L1 after the first).
//   Otherwise (SSE, NEON): GCC's generic 4-lane vectors, 6 x 2 tiles, 8 to a block.
#if defined(__AVX512F__)
using Vec = __m512;
constexpr int kLanes = 16, kTileVecs = 4;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vset1(float s) { return _mm512_set1_ps(s); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vload(const int8_t* p) {  // 16 int8 -> 16 floats
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
constexpr int kLanes = 8, kTileVecs = 2;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vset1(float s) { return _mm256_set1_ps(s); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vload(const int8_t* p) {  // 8 int8 -> 8 floats (vpmovsxbd from memory, vcvtdq2ps)
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#else
typedef float Vec __attribute__((vector_size(16)));
constexpr int kLanes = 4, kTileVecs = 2;
inline Vec vzero() { return Vec{}; }
inline Vec vload(const float* p) { Vec v; std::memcpy(&v, p, sizeof v); return v; }
inline void vstore(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }
inline Vec vset1(float s) { return Vec{} + s; }
inline Vec vfma(Vec a, Vec b, Vec c) { return a * b + c; }  // fused under -ffp-contract=fast
inline Vec vmul(Vec a, Vec b) { return a * b; }
inline Vec vload(const int8_t* p) { return Vec{float(p[0]), float(p[1]), float(p[2]), float(p[3])}; }
#endif

constexpr int64_t kCols = 64;   // columns of w per work item (one blocked-layout block)
constexpr int kMaxRows = 6;     // rows of x per register tile
constexpr int64_t kChunk = 64;  // rows of w per chunk: 16 KiB of a block
constexpr int64_t kDequantisedFromGroups = 4;  // int8: row groups from which chunks are dequantised once
constexpr int64_t kTileCols = kLanes * kTileVecs;  // columns of a register tile: 64, 16 or 8
constexpr int64_t kTiles = kCols / kTileCols;      // register tiles across a block: 1, 4 or 8
static_assert(kCols % kTileCols == 0, "a block is whole register tiles");

// A block row of w in 64-byte cache lines (float32: 4, int8: 1), and w's elements in a line.
template <typename W>
constexpr int64_t kRowLines = kCols * int64_t(sizeof(W)) / 64;
template <typename W>
constexpr int64_t kLineElems = 64 / int64_t(sizeof(W));

template <typename W>
void prefetch_l2(const W* p) { __builtin_prefetch(p, 0, 2); }  // prefetcht1 on x86

// Keeps v in a register: GCC otherwise folds each use's load into its FMA, and a row of w then costs
// MR loads instead of one (Zen 3, AVX2, SmolLM2's dots at 8 rows: 43.3 -> 39.8 ms).
inline void pin(Vec& v) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+x"(v));
#elif defined(__aarch64__)
  asm("" : "+w"(v));
#endif
}

// One column block of w: its first row, and the distance between its rows (N, or 64 blocked), in
// elements of W: float, or int8_t (blocked only) with the block's scales, [ceil(K / group), 64]: one per
// column and run of `group` rows of w.
template <typename W>
struct Block {
  const W* w;
  int64_t ld;
  bool contiguous;  // blocked: its rows one run
  const float* scale = nullptr;
  int64_t group = 0;
};

// Rows [i0, i1) of the block for MR rows of x and its columns [c0, c0 + kTileCols):
// y[0:MR, n0+c0:...] = (first ? 0 : y) + x[:, i0:i1] @ w[i0:i1, c0:...]. It prefetches part `part` of
// `parts` of the next chunk, rows [i1, next_end) (parts = 0: none): an even share of its lines, spread
// evenly over the iterations. Every tile of every row group takes a share, so memory stays busy
// while the later groups compute. Before, the first 4 parts took the whole chunk, so with AVX2's 4
// tiles a block a second row group (7-12 rows) computed with memory idle. With pin() as well, on the
// Zen 3: SmolLM2's dots at 8 rows 40.8 -> 35.9 ms, 16 rows 59.8 -> 49.7, 1-4 rows unchanged. On
// AVX-512 the split changes only for 3 and for 5 or more row groups (not measured there).
// Blocked (kContig), the next chunk is one run: the tile's lines are [pf, pf_end), a line 64 bytes on,
// taken one every `every` iterations on a countdown (or, with a line or more an iteration, as many as
// are due). The [K, N] layout keeps the general schedule, which finds each line's row and column of w.
// Before, the blocked layout took it too, and that bookkeeping, not memory, held the FMAs back at two
// row groups (one thread, w in L2, 8 rows: ~2-3 G FMAs/s against ~5 without any prefetch). On the Zen 3
// (SmolLM2's dots on two threads, 13 interleaved rounds): 8 rows 34.6 -> 30.6 ms min, 41.1 -> 34.5
// median; 16 rows 47.8 -> 44.9 min; 1 and 4 rows unchanged within the noise (27.7 vs 29.2 at 1).
// int8 w: the accumulators start at zero and, each time a run of `group` rows of w ends (its scales'),
// go into y times those scales (y = acc * s the first time, when y holds nothing yet, else y += acc * s).
template <int MR, bool kContig, typename W>
void tile(const float* x, Block<W> b, int64_t c0, float* y, int64_t k, int64_t n, int64_t n0, int64_t i0,
          int64_t i1, bool first, int64_t part, int64_t parts, int64_t next_end) {
  constexpr bool kInt8 = std::is_same_v<W, int8_t>;
  Vec acc[MR][kTileVecs];
  float* yt = y + n0 + c0;
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < kTileVecs; ++c)
      acc[r][c] = first || kInt8 ? vzero() : vload(yt + r * n + kLanes * c);
  bool fresh = first;  // int8: y holds nothing of this tile yet
  int64_t left = kInt8 ? b.group - i0 % b.group : 0;  // int8: rows of w to the end of this scale group
  // This tile's share of the next chunk's lines (rows [i1, next_end), kRow lines a row), part `part` of
  // `parts` (0: none): lines [line, line_end), spread evenly over its iterations from the first on.
  constexpr int64_t kRow = kRowLines<W>, kLine = kLineElems<W>;
  const int64_t lines = parts ? kRow * (next_end - i1) : 0, share = parts ? (lines + parts - 1) / parts : 0;
  int64_t line = std::min(lines, part * share);
  const int64_t line_end = std::min(lines, line + share), mine = line_end - line, n_iter = i1 - i0;
  const W* pf = kContig ? b.w + i1 * b.ld + kLine * line : nullptr;
  const W* const pf_end = kContig ? pf + kLine * mine : nullptr;
  const int64_t every = mine ? std::max<int64_t>(1, n_iter / mine) : 0;  // mine <= n_iter / every
  int64_t due = 0, paid = 0;  // lines due and issued so far, both scaled by n_iter
  int64_t count = 1;          // iterations to the next line, on the countdown
  const W* wr = b.w + c0 + i0 * b.ld;
  for (int64_t i = i0; i < i1; ++i, wr += b.ld) {
    if (kContig && every > 1) {
      if (--count == 0) {
        count = every;
        if (pf < pf_end) prefetch_l2(pf);
        pf += kLine;
      }
    } else if (kContig) {
      for (due += mine; paid < due && pf < pf_end; pf += kLine, paid += n_iter) prefetch_l2(pf);
    } else {
      for (due += mine; paid < due && line < line_end; ++line, paid += n_iter)
        prefetch_l2(b.w + (i1 + line / kRow) * b.ld + kLine * (line % kRow));
    }
    Vec wv[kTileVecs];
    for (int c = 0; c < kTileVecs; ++c) {
      wv[c] = vload(wr + kLanes * c);
      pin(wv[c]);
    }
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const Vec xv = vset1(x[r * k + i]);
      for (int c = 0; c < kTileVecs; ++c) acc[r][c] = vfma(xv, wv[c], acc[r][c]);
    }
    if constexpr (kInt8) {
      if (--left == 0 || i + 1 == i1) {  // a scale group ends (a chunk ends on a group's end or at k)
        const float* s = b.scale + i / b.group * kCols + c0;
#pragma GCC unroll 6
        for (int r = 0; r < MR; ++r)
          for (int c = 0; c < kTileVecs; ++c) {
            float* yc = yt + r * n + kLanes * c;
            vstore(yc, vfma(acc[r][c], vload(s + kLanes * c), fresh ? vzero() : vload(yc)));
            acc[r][c] = vzero();
          }
        fresh = false;
        left = b.group;
      }
    }
  }
  if constexpr (!kInt8) {
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < kTileVecs; ++c) vstore(yt + r * n + kLanes * c, acc[r][c]);
  }
}

// One tile of `rows` (1-6) rows of x: tile<rows> for the layout.
template <bool kContig, typename W>
void row_tile(int64_t rows, const float* x, Block<W> b, int64_t c0, float* y, int64_t k, int64_t n, int64_t n0,
              int64_t i0, int64_t i1, bool first, int64_t part, int64_t parts, int64_t next_end) {
  switch (rows) {
    case 6: return tile<6, kContig, W>(x, b, c0, y, k, n, n0, i0, i1, first, part, parts, next_end);
    case 5: return tile<5, kContig, W>(x, b, c0, y, k, n, n0, i0, i1, first, part, parts, next_end);
    case 4: return tile<4, kContig, W>(x, b, c0, y, k, n, n0, i0, i1, first, part, parts, next_end);
    case 3: return tile<3, kContig, W>(x, b, c0, y, k, n, n0, i0, i1, first, part, parts, next_end);
    case 2: return tile<2, kContig, W>(x, b, c0, y, k, n, n0, i0, i1, first, part, parts, next_end);
    case 1: return tile<1, kContig, W>(x, b, c0, y, k, n, n0, i0, i1, first, part, parts, next_end);
  }
}

// The last, narrower column block: plain loops.
void edge(const float* x, const float* w, float* y, int64_t m, int64_t k, int64_t n, int64_t n0) {
  const int64_t cols = n - n0;
  for (int64_t r = 0; r < m; ++r) {
    float acc[kCols] = {};
    for (int64_t i = 0; i < k; ++i) {
      const float xv = x[r * k + i];
      for (int64_t c = 0; c < cols; ++c) acc[c] += xv * w[i * n + n0 + c];
    }
    std::memcpy(y + r * n + n0, acc, sizeof(float) * cols);
  }
}

// int8 w for several row groups: each chunk of the block is dequantised once (q times its scales) into a
// float chunk in L1, which every row group's float tiles then read; meanwhile the next chunk of q is
// prefetched. Widening in registers instead redoes it for every row group and flushes the accumulators
// into y at every run of scales.
void block_dequantised(const float* x, Block<int8_t> b, float* y, int64_t m, int64_t k, int64_t n, int64_t n0) {
  alignas(64) static thread_local float chunk[kChunk * kCols];
  const int64_t groups = (m + kMaxRows - 1) / kMaxRows;
  for (int64_t i0 = 0; i0 < k; i0 += kChunk) {
    const int64_t i1 = std::min(i0 + kChunk, k);
    for (int64_t i = i1; i < i1 + kChunk; ++i) prefetch_l2(b.w + i * kCols);  // past k: the next block's
    for (int64_t i = i0; i < i1; ++i) {
      const float* s = b.scale + i / b.group * kCols;
      for (int64_t c = 0; c < kCols; c += kLanes)
        vstore(chunk + (i - i0) * kCols + c, vmul(vload(b.w + i * kCols + c), vload(s + c)));
    }
    const Block<float> f{chunk, kCols, true};
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t r0 = m * g / groups, r1 = m * (g + 1) / groups;
      for (int64_t t = 0; t < kTiles; ++t)
        row_tile<true>(r1 - r0, x + r0 * k + i0, f, t * kTileCols, y + r0 * n, k, n, n0, 0, i1 - i0, i0 == 0, 0,
                       0, 0);
    }
  }
}

// Column block n0 (of `b`) for all m rows: chunk by chunk of w, every row group per chunk.
template <typename W>
void block(const float* x, Block<W> b, float* y, int64_t m, int64_t k, int64_t n, int64_t n0) {
  const int64_t groups = (m + kMaxRows - 1) / kMaxRows;
  if constexpr (std::is_same_v<W, int8_t>) {
    if (groups >= kDequantisedFromGroups) return block_dequantised(x, b, y, m, k, n, n0);
  }
  for (int64_t i = 0; i < std::min(kChunk, k); ++i)  // the first chunk: no chunk before fetched it
      for (int64_t c = 0; c < kRowLines<W>; ++c) prefetch_l2(b.w + i * b.ld + kLineElems<W> * c);
  for (int64_t i0 = 0; i0 < k; i0 += kChunk) {
    // Blocked, the rows past k are the next block's, which the same thread most likely takes next
    // (cpu_pool.h): the last chunk prefetches its first (a prefetch past the buffer never faults).
    const int64_t i1 = std::min(i0 + kChunk, k);
    const int64_t next_end = b.contiguous ? i1 + kChunk : std::min(i1 + kChunk, k);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t r0 = m * g / groups, r1 = m * (g + 1) / groups;
      const float* xr = x + r0 * k;
      float* yr = y + r0 * n;
      const bool first = i0 == 0;
      const int64_t parts = groups * kTiles;
      for (int64_t t = 0; t < kTiles; ++t) {
        const int64_t c0 = t * kTileCols, part = g * kTiles + t;
        if (b.contiguous)
          row_tile<true>(r1 - r0, xr, b, c0, yr, k, n, n0, i0, i1, first, part, parts, next_end);
        else
          row_tile<false>(r1 - r0, xr, b, c0, yr, k, n, n0, i0, i1, first, part, parts, next_end);
      }
    }
  }
}

// The rows of x [M, K] the product computes: the first `rows` (clamped to [0, M]; a padded step's real
// tokens, the rest padding). y's other rows, and all of y when K = 0 (no chunk writes it), are zeros.
int64_t live_rows(int64_t m, ffi::Buffer<ffi::S32> rows_buf, float* y, int64_t n, int64_t k) {
  const int64_t live = k == 0 ? 0 : std::clamp<int64_t>(rows_buf.typed_data()[0], 0, m);
  std::memset(y + live * n, 0, sizeof(float) * (m - live) * n);
  return live;
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::Buffer<ffi::S32> layer_buf, ffi::Buffer<ffi::S32> rows_buf, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  // Blocked weights may come stacked, [L, N / 64, K, 64]: the product reads layer `layer` in place (a
  // layer scan's weight without a slice copied out of the stack); clamped, as the attention's layer is.
  const bool stacked = wd.size() == 4;
  const size_t off = stacked ? 1 : 0;
  const bool blocked = wd.size() == 3 + off;
  if (xd.size() != 2 || (wd.size() != 2 && !(blocked && wd[2 + off] == kCols)) ||
      xd[1] != wd[blocked ? 1 + off : 0] || (stacked && wd[0] < 1))
    return ffi::Error::InvalidArgument(
        "cpu matmul: x [M, K] and w [K, N], blocked [N / 64, K, 64] or stacked [L, N / 64, K, 64]");
  const int64_t k = xd[1], n = blocked ? wd[off] * kCols : wd[1];
  const int64_t layer = stacked ? std::clamp<int64_t>(layer_buf.typed_data()[0], 0, wd[0] - 1) : 0;
  const float* xp = x.typed_data();
  const float* wp = w.typed_data() + layer * n * k;
  float* yp = y->typed_data();
  const int64_t m = live_rows(xd[0], rows_buf, yp, n, k);
  if (m == 0) return ffi::Error::Success();
  const int64_t total = (n + kCols - 1) / kCols;  // items: column blocks
  jaxpaged::run_items(pool, total, [=](int64_t i) {
    const int64_t n0 = i * kCols;
    if (blocked) return block(xp, Block<float>{wp + n0 * k, kCols, true}, yp, m, k, n, n0);
    if (n - n0 < kCols) return edge(xp, wp, yp, m, k, n, n0);
    block(xp, Block<float>{wp + n0, n, false}, yp, m, k, n, n0);
  });
  return ffi::Error::Success();
}

// Weight-only int8: q blocked [N / 64, K, 64] with scales [N / 64, ceil(K / group), 64], or stacked
// [L, N / 64, K, 64] with [L, N / 64, ceil(K / group), 64]; y = sum over groups of (x @ q_g) * scale_g,
// layer `layer` of a stack (clamped). group divides the 64-row chunk.
ffi::Error MatmulInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                      ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> layer_buf, ffi::Buffer<ffi::S32> rows_buf,
                      ffi::ResultBuffer<ffi::F32> y, int64_t group) {
  auto xd = x.dimensions();
  auto qd = q.dimensions();
  auto sd = scale.dimensions();
  const bool stacked = qd.size() == 4;
  const size_t off = stacked ? 1 : 0;
  const int64_t groups = group > 0 && qd.size() == 3 + off ? (qd[1 + off] + group - 1) / group : -1;
  if (xd.size() != 2 || qd.size() != 3 + off || qd[2 + off] != kCols || xd[1] != qd[1 + off] || group < 1 ||
      kChunk % group != 0 || sd.size() != qd.size() || sd[off] != qd[off] || sd[1 + off] != groups ||
      sd[2 + off] != kCols || (stacked && (qd[0] < 1 || sd[0] != qd[0])))
    return ffi::Error::InvalidArgument(
        "cpu int8 matmul: x [M, K], q [N / 64, K, 64] with scales [N / 64, ceil(K / group), 64], or stacked "
        "[L, N / 64, K, 64] with [L, N / 64, ceil(K / group), 64]; group divides 64");
  const int64_t k = xd[1], n = qd[off] * kCols;
  const int64_t layer = stacked ? std::clamp<int64_t>(layer_buf.typed_data()[0], 0, qd[0] - 1) : 0;
  const float* xp = x.typed_data();
  const int8_t* qp = q.typed_data() + layer * n * k;
  const float* sp = scale.typed_data() + layer * n * groups;
  float* yp = y->typed_data();
  const int64_t m = live_rows(xd[0], rows_buf, yp, n, k);
  if (m == 0) return ffi::Error::Success();
  jaxpaged::run_items(pool, n / kCols, [=](int64_t i) {
    block(xp, Block<int8_t>{qp + i * kCols * k, kCols, true, sp + i * groups * kCols, group}, yp, m, k, n,
          i * kCols);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedCpuMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer (stacked w)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows of x computed (the rest: padding)
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedCpuMatmulInt8, MatmulInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::S8>>()   // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer (stacked q)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // rows of x computed (the rest: padding)
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("group"));
