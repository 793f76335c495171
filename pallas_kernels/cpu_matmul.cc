// Matmul on the CPU for a decode step's rows: y [M, N] = x [M, K] @ w [K, N], float32, an XLA
// FFI custom call (see cpu_matmul.py). Weight-only int8 too (JaxpagedCpuMatmulInt8): w blocked as
// int8 q with a float32 scale per column and run of `group` rows (32: llama.cpp's Q8_0 blocks); each row
// of w is a quarter of the bytes, widened to float32 in registers (the same tiles; every FMA stays
// float32), and each run's sums go into y times its scales. On the Zen 3 (AVX2), SmolLM2's dots (30
// layers and the LM head, min of 11 interleaved rounds) float32 -> int8 (runs of 32 rows): 1 row 19.2 ->
// 5.2 ms, 4 rows 15.4 -> 9.3, 8 rows 18.1 -> 15.9, 16 rows 25.6 -> 28.2, 32 rows 45.9 -> 52.9, 64 rows
// 88.1 -> 100.1: while memory bounds the product int8 reads a quarter of it, once the FMAs do the
// widening costs ~10-15%. One scale per column (no runs) was ~2% faster at 32 rows and twice as far
// from float32 (docs/kernels.md). From kDequantisedFromGroups row groups on
// (19+ rows: prefill, many decodes) each chunk is instead dequantised once, times its scales, into a
// float32 chunk in L1 that the float tiles read (`block_dequantised`): on a Zen 4 (SmolLM2-shaped int8
// stacks, interleaved, median of 9) 0.90-0.94x the in-register time at 32-256 rows with AVX-512 and
// 0.83-0.90x with the AVX2 build, the same at 8-24 rows. (Session 28's Zen 3 found a variant that kept
// the per-run flush in the tiles slower from 8 rows on: 8 rows 18.4 vs 14.4 ms, 32 rows 61.7 vs 52.9.)
//
// W8A8 (the int8 call's `activations`): x quantised per row and run too, integer dots on AVX-512 VNNI (see
// "W8A8" below): 1.7-2.1x the weight-only int8 call from 8 rows on (Zen 4).
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
#include <cmath>
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
  const float* row_scale = nullptr;  // W8A8: x's rows' scales [rows, row_runs] (x holds their int8 values)
  int64_t row_runs = 0;
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
            const Vec sc = b.row_scale ? vmul(vload(s + kLanes * c), vset1(b.row_scale[r * b.row_runs + i / b.group]))
                                       : vload(s + kLanes * c);
            vstore(yc, vfma(acc[r][c], sc, fresh ? vzero() : vload(yc)));
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
    if (groups >= kDequantisedFromGroups && !b.row_scale) return block_dequantised(x, b, y, m, k, n, n0);
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
      Block<W> bg = b;
      if (b.row_scale) bg.row_scale = b.row_scale + r0 * b.row_runs;
      for (int64_t t = 0; t < kTiles; ++t) {
        const int64_t c0 = t * kTileCols, part = g * kTiles + t;
        if (b.contiguous)
          row_tile<true>(r1 - r0, xr, bg, c0, yr, k, n, n0, i0, i1, first, part, parts, next_end);
        else
          row_tile<false>(r1 - r0, xr, bg, c0, yr, k, n, n0, i0, i1, first, part, parts, next_end);
      }
    }
  }
}

// W8A8 (the int8 call's `activations`): x quantised too, each row per run of `group` values (the weights' runs,
// as llama.cpp's Q8_0 dots quantise theirs), so a run's dot is an integer sum, which goes into y times both
// scales. With AVX-512 VNNI `vpdpbusd` sums four u8 x s8 products a lane (the VNNI tiles below); elsewhere, and
// for one row (memory-bound: interleaving chunks for VNNI cost ~10% there), the float tiles above run over x's
// int8 values as floats, every product and partial sum an integer below 2^24, so exact, and flush each run as
// the VNNI tiles do: a row's result is the same to the bit on either path, in any batch.
//
// x's live rows as int8: per run of `group` values of a row, d = the run's max |x| / 127 and q = round(x / d)
// (x times 1 / d, to nearest even: quantize_rows_int8 in cpu_matmul.py; d = 0 gives zeros), with -128 times
// the run's sum of q (the VNNI tiles read w as u8, q_w + 128, and start each run's sums there to take the
// offset back out), and the values as floats for the float tiles. Rows run to whole chunks of zeros, so a
// chunk's quads never read past a row.
struct Int8Rows {
  int64_t ld = 0, runs = 0;           // q's row stride (K rounded up to kChunk), runs a row
  std::unique_ptr<int8_t[]> q;        // [m, ld]
  std::unique_ptr<float[]> scale;     // [m, runs]: d
  std::unique_ptr<int32_t[]> offset;  // [m, runs]
  std::unique_ptr<float[]> values;    // [m, k]: q as floats (float tiles only)
};

// One run of a row: d, and q written to `q` (and as floats to `f`, if given); returns the sum of q. Vector
// and scalar lanes do the same float32 operations (max |x|, d = max * (1 / 127), 1 / d, x * (1 / d) rounded
// to nearest even by the rounding mode), so every build quantises alike.
int32_t quantise_run(const float* x, int64_t len, int8_t* q, float* f, float& d) {
  constexpr float kInv127 = 1.0f / 127.0f;
  float amax = 0;
  int64_t j = 0;
#if defined(__AVX512F__)
  __m512 vmax = _mm512_setzero_ps();
  for (; j + 16 <= len; j += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(x + j)));
  amax = _mm512_reduce_max_ps(vmax);
#endif
  for (; j < len; ++j) {
    const float a = std::fabs(x[j]);
    amax = a > amax ? a : amax;
  }
  volatile float opaque = amax * kInv127;  // -freciprocal-math had folded 1 / d into 127 / max: rounds apart
  d = opaque;
  const float id = d > 0 ? 1.0f / d : 0.0f;
  int32_t sum = 0;
  j = 0;
#if defined(__AVX512F__)
  __m512i vsum = _mm512_setzero_si512();
  for (; j + 16 <= len; j += 16) {
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + j), _mm512_set1_ps(id)));
    vsum = _mm512_add_epi32(vsum, v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j), _mm512_cvtepi32_epi8(v));
    if (f) _mm512_storeu_ps(f + j, _mm512_cvtepi32_ps(v));
  }
  sum = _mm512_reduce_add_epi32(vsum);
#endif
  for (; j < len; ++j) {
    const int32_t v = int32_t(std::lrint(x[j] * id));
    q[j] = int8_t(v);
    sum += v;
    if (f) f[j] = float(v);
  }
  return sum;
}

std::shared_ptr<const Int8Rows> quantise_rows(const float* x, int64_t m, int64_t k, int64_t group, bool values) {
  auto out = std::make_shared<Int8Rows>();
  out->ld = (k + kChunk - 1) / kChunk * kChunk;
  out->runs = (k + group - 1) / group;
  out->q.reset(new int8_t[m * out->ld]());
  out->scale.reset(new float[m * out->runs]);
  out->offset.reset(new int32_t[m * out->runs]);
  if (values) out->values.reset(new float[m * k]);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < out->runs; ++g) {
      const int64_t i0 = g * group;
      float* f = values ? out->values.get() + r * k + i0 : nullptr;
      const int32_t sum = quantise_run(x + r * k + i0, std::min(group, k - i0), out->q.get() + r * out->ld + i0, f,
                                       out->scale[r * out->runs + g]);
      out->offset[r * out->runs + g] = -128 * sum;
    }
  return out;
}

// Column block n0 of int8 w for all m rows of quantised x (xr, values given) on the float tiles.
void block_w8a8_floats(const Int8Rows& xr, Block<int8_t> b, float* y, int64_t m, int64_t k, int64_t n, int64_t n0) {
  b.row_scale = xr.scale.get();
  b.row_runs = xr.runs;
  block(xr.values.get(), b, y, m, k, n, n0);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kVnni = true;
constexpr int kVnniRows = 4;  // rows of x per VNNI tile: 16 accumulators (6 rows: 24, spilled)

// `rows` (<= kChunk) rows of a block of int8 w (64 bytes a row) as u8 (q + 128) by quads of rows, for vpdpbusd:
// out[j][c][t] = w[4j + t][c] + 128; rows past `rows` read as q = 0 (their x is zero).
void interleave_quads(const int8_t* w, int64_t rows, uint8_t* out) {
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  for (int64_t j = 0; 4 * j < rows; ++j) {
    __m512i a[4];
    for (int t = 0; t < 4; ++t)
      a[t] = 4 * j + t < rows ? _mm512_loadu_si512(w + (4 * j + t) * kCols) : _mm512_setzero_si512();
    // In each 128-bit lane L (columns 16L..16L+15): bytes of rows 0, 1 and of rows 2, 3 interleaved, then
    // their pairs: v[h] holds columns 16L + 4h .. + 3, four bytes a column.
    const __m512i lo01 = _mm512_unpacklo_epi8(a[0], a[1]), hi01 = _mm512_unpackhi_epi8(a[0], a[1]);
    const __m512i lo23 = _mm512_unpacklo_epi8(a[2], a[3]), hi23 = _mm512_unpackhi_epi8(a[2], a[3]);
    const __m512i v0 = _mm512_unpacklo_epi16(lo01, lo23), v1 = _mm512_unpackhi_epi16(lo01, lo23);
    const __m512i v2 = _mm512_unpacklo_epi16(hi01, hi23), v3 = _mm512_unpackhi_epi16(hi01, hi23);
    // out vector L = lane L of v0..v3 (a 4 x 4 transpose of lanes): columns 16L..16L+15 in order.
    const __m512i t0 = _mm512_shuffle_i32x4(v0, v1, 0x44), t1 = _mm512_shuffle_i32x4(v2, v3, 0x44);
    const __m512i t2 = _mm512_shuffle_i32x4(v0, v1, 0xee), t3 = _mm512_shuffle_i32x4(v2, v3, 0xee);
    uint8_t* o = out + j * 4 * kCols;
    _mm512_storeu_si512(o, _mm512_xor_si512(_mm512_shuffle_i32x4(t0, t1, 0x88), flip));
    _mm512_storeu_si512(o + 64, _mm512_xor_si512(_mm512_shuffle_i32x4(t0, t1, 0xdd), flip));
    _mm512_storeu_si512(o + 128, _mm512_xor_si512(_mm512_shuffle_i32x4(t2, t3, 0x88), flip));
    _mm512_storeu_si512(o + 192, _mm512_xor_si512(_mm512_shuffle_i32x4(t2, t3, 0xdd), flip));
  }
}

// MR rows of x (from r0) over the 64 columns of one chunk (rows [i0, i0 + 4 * quads) of w, interleaved in wq),
// a run of `group` rows at a time: int32 sums from the run's offset, then y (+)= float(sums) * d_x * s_w
// (y = the first time, when `first`).
template <int MR>
void tile_w8a8(const Int8Rows& xr, int64_t r0, const uint8_t* wq, int64_t quads, const float* s, int64_t group,
               int64_t i0, float* y, int64_t n, bool first) {
  const int64_t run_quads = group / 4;
  for (int64_t j0 = 0; j0 < quads; j0 += run_quads) {
    const int64_t run = (i0 + 4 * j0) / group, j1 = std::min(quads, j0 + run_quads);
    __m512i acc[MR][kTileVecs];
    for (int r = 0; r < MR; ++r)
      for (int c = 0; c < kTileVecs; ++c) acc[r][c] = _mm512_set1_epi32(xr.offset[(r0 + r) * xr.runs + run]);
    const int8_t* xq = xr.q.get() + r0 * xr.ld + i0;
    for (int64_t j = j0; j < j1; ++j) {
      __m512i wv[kTileVecs];
      for (int c = 0; c < kTileVecs; ++c) wv[c] = _mm512_load_si512(wq + (j * kTileVecs + c) * 64);
      for (int r = 0; r < MR; ++r) {
        int32_t four;
        std::memcpy(&four, xq + r * xr.ld + 4 * j, 4);
        const __m512i xb = _mm512_set1_epi32(four);
        for (int c = 0; c < kTileVecs; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], wv[c], xb);
      }
    }
    const float* sr = s + (run - i0 / group) * kCols;
    const bool fresh = first && j0 == 0;
    for (int r = 0; r < MR; ++r) {
      const __m512 d = _mm512_set1_ps(xr.scale[(r0 + r) * xr.runs + run]);
      for (int c = 0; c < kTileVecs; ++c) {
        float* yc = y + r * n + kLanes * c;
        const __m512 v = _mm512_cvtepi32_ps(acc[r][c]), sc = _mm512_mul_ps(_mm512_loadu_ps(sr + kLanes * c), d);
        _mm512_storeu_ps(yc, fresh ? _mm512_mul_ps(v, sc) : _mm512_fmadd_ps(v, sc, _mm512_loadu_ps(yc)));
      }
    }
  }
}

// Column block n0 of int8 w for all m rows, x quantised (xr): each chunk interleaved once into L1 for every row
// group's VNNI tiles, the next chunk prefetched meanwhile.
void block_w8a8(const Int8Rows& xr, Block<int8_t> b, float* y, int64_t m, int64_t k, int64_t n, int64_t n0) {
  alignas(64) static thread_local uint8_t wq[kChunk * kCols];
  const int64_t groups = (m + kVnniRows - 1) / kVnniRows;
  for (int64_t i0 = 0; i0 < k; i0 += kChunk) {
    const int64_t i1 = std::min(i0 + kChunk, k), quads = (i1 - i0 + 3) / 4;
    for (int64_t i = i1; i < i1 + kChunk; ++i) prefetch_l2(b.w + i * kCols);  // past k: the next block's
    interleave_quads(b.w + i0 * kCols, i1 - i0, wq);
    const float* s = b.scale + i0 / b.group * kCols;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t r0 = m * g / groups, r1 = m * (g + 1) / groups;
      float* yr = y + r0 * n + n0;
      switch (r1 - r0) {
        case 4: tile_w8a8<4>(xr, r0, wq, quads, s, b.group, i0, yr, n, i0 == 0); break;
        case 3: tile_w8a8<3>(xr, r0, wq, quads, s, b.group, i0, yr, n, i0 == 0); break;
        case 2: tile_w8a8<2>(xr, r0, wq, quads, s, b.group, i0, yr, n, i0 == 0); break;
        case 1: tile_w8a8<1>(xr, r0, wq, quads, s, b.group, i0, yr, n, i0 == 0); break;
      }
    }
  }
}
static_assert(kTileVecs * kLanes == kCols, "a VNNI tile spans a block");

#else
constexpr bool kVnni = false;
#endif

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
                      ffi::ResultBuffer<ffi::F32> y, int64_t group, bool activations) {
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
  if (activations) {  // W8A8: VNNI tiles where built and runs are whole quads, else float tiles over x's values
    const bool vnni = kVnni && m > 1 && group % 4 == 0;
    auto xr = quantise_rows(xp, m, k, group, !vnni);
    jaxpaged::run_items(pool, n / kCols, [=](int64_t i) {
      const Block<int8_t> b{qp + i * kCols * k, kCols, true, sp + i * groups * kCols, group};
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      if (vnni) return block_w8a8(*xr, b, yp, m, k, n, i * kCols);
#endif
      block_w8a8_floats(*xr, b, yp, m, k, n, i * kCols);
    });
    return ffi::Error::Success();
  }
  jaxpaged::run_items(pool, n / kCols, [=](int64_t i) {
    block(xp, Block<int8_t>{qp + i * kCols * k, kCols, true, sp + i * groups * kCols, group}, yp, m, k, n,
          i * kCols);
  });
  return ffi::Error::Success();
}

}  // namespace

// Whether this build's W8A8 products run on VNNI tiles (the same results as the float tiles), for cpu_matmul.py.
extern "C" int JaxpagedCpuMatmulVnni() { return kVnni; }

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
                                  .Attr<int64_t>("group")
                                  .Attr<bool>("activations"));  // W8A8: x quantised too
