// Matmul on the CPU for a decode step's rows: y [M, N] = x [M, K] @ w [K, N], float32, an XLA
// FFI custom call (see cpu_matmul.py).
//
// XLA:CPU hands a 17-32-row dot to YNNPACK, whose GEMM packs w on every call: each weight
// byte is read, written and read again, and the step's dots ran at ~55% of the cores' FMA
// rate. Here w is read in place. A work item is one 64-column block of w (4 AVX-512
// vectors wide). The block goes through in chunks of kChunk rows of w; each chunk serves
// every row of x, in near-equal groups of at most 6, each group a register tile of 6 x 4
// accumulators (kept in y between chunks). While a chunk is computed on, its groups
// prefetch the next chunk into L2 between them, so reading w from memory overlaps the FMAs:
// without it the first group of a block waited on memory and the others computed with
// memory idle (32 rows: 31.9 -> 27.8 ms for SmolLM2's dots). Items are shared between the
// calling thread and XLA's intra-op thread pool (cpu_pool.h).
//
// w comes in one of two layouts: [K, N] (row-major; a block's rows 4 * N bytes apart) or blocked,
// [N / 64, K, 64] (each column block one contiguous run, `block_weight` in cpu_matmul.py). Blocked,
// a block is one sequential stream (4 rows of x: 16.0 -> 13.4 ms for SmolLM2's dots on the Zen 5
// machine). The software prefetch runs for every step size: on Zen 5 the hardware prefetcher kept
// ahead of a one-group stream, but on the Intel (AVX-512, 2 MiB L2) machine it did not: with the
// weights on huge pages (jaxpaged/host_memory.py), the bare stack at 1 row 18.6 -> 15.7 ms and at
// 4 rows 23.3 -> 16.8 with the prefetch.

#include <immintrin.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kCols = 64;   // columns of w per work item: 4 AVX-512 vectors
constexpr int kMaxRows = 6;     // rows of x per register tile: 6 x 4 accumulators
constexpr int64_t kChunk = 64;  // rows of w per chunk: 16 KiB of a block

void prefetch_l2(const float* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }

// One column block of w: its first row, and the distance between its rows (N, or 64 blocked).
struct Block {
  const float* w;
  int64_t ld;
  bool contiguous;  // blocked: its rows one run
};

// Rows [i0, i1) of the block for MR rows of x: y[0:MR, n0:n0+64] = (first ? 0 : y) + x[:, i0:i1] @ w[i0:i1].
// It prefetches part `part` of `parts` of the next chunk, rows [i1, next_end): its 4 lines a row,
// spread one or more an iteration (parts = 0: none).
template <int MR>
void tile(const float* x, Block b, float* y, int64_t k, int64_t n, int64_t n0, int64_t i0,
          int64_t i1, bool first, int64_t part, int64_t parts, int64_t next_end) {
  __m512 acc[MR][4];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < 4; ++c)
      acc[r][c] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + r * n + n0 + 16 * c);
  const int64_t per = parts ? (4 + parts - 1) / parts : 0;  // prefetches an iteration
  const float* wr = b.w + i0 * b.ld;
  for (int64_t i = i0; i < i1; ++i, wr += b.ld) {
    for (int64_t p = 0; p < per; ++p) {
      const int64_t line = (part * (i1 - i0) + (i - i0)) * per + p;  // of the next chunk's lines
      const int64_t row = i1 + line / 4;
      if (row < next_end) prefetch_l2(b.w + row * b.ld + 16 * (line % 4));
    }
    const __m512 w0 = _mm512_loadu_ps(wr), w1 = _mm512_loadu_ps(wr + 16);
    const __m512 w2 = _mm512_loadu_ps(wr + 32), w3 = _mm512_loadu_ps(wr + 48);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * k + i]);
      acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xv, w2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(xv, w3, acc[r][3]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(y + r * n + n0 + 16 * c, acc[r][c]);
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

// Column block n0 (of `b`) for all m rows: chunk by chunk of w, every row group per chunk.
void block(const float* x, Block b, float* y, int64_t m, int64_t k, int64_t n, int64_t n0) {
  const int64_t groups = (m + kMaxRows - 1) / kMaxRows;
  for (int64_t i = 0; i < std::min(kChunk, k); ++i)  // the first chunk: no chunk before fetched it
      for (int c = 0; c < 4; ++c) prefetch_l2(b.w + i * b.ld + 16 * c);
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
      const int64_t parts = groups;
      switch (r1 - r0) {
        case 6: tile<6>(xr, b, yr, k, n, n0, i0, i1, first, g, parts, next_end); break;
        case 5: tile<5>(xr, b, yr, k, n, n0, i0, i1, first, g, parts, next_end); break;
        case 4: tile<4>(xr, b, yr, k, n, n0, i0, i1, first, g, parts, next_end); break;
        case 3: tile<3>(xr, b, yr, k, n, n0, i0, i1, first, g, parts, next_end); break;
        case 2: tile<2>(xr, b, yr, k, n, n0, i0, i1, first, g, parts, next_end); break;
        case 1: tile<1>(xr, b, yr, k, n, n0, i0, i1, first, g, parts, next_end); break;
      }
    }
  }
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  const bool blocked = wd.size() == 3;
  if (xd.size() != 2 || (wd.size() != 2 && !(blocked && wd[2] == kCols)) || xd[1] != wd[blocked ? 1 : 0])
    return ffi::Error::InvalidArgument("cpu matmul: x [M, K] and w [K, N] or blocked [N / 64, K, 64]");
  const int64_t m = xd[0], k = xd[1], n = blocked ? wd[0] * kCols : wd[1];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  if (k == 0) {  // no chunk writes y
    std::memset(yp, 0, sizeof(float) * m * n);
    return ffi::Error::Success();
  }
  const int64_t total = (n + kCols - 1) / kCols;  // items: column blocks
  jaxpaged::run_items(pool, total, [=](int64_t i) {
    const int64_t n0 = i * kCols;
    if (blocked) return block(xp, Block{wp + n0 * k, kCols, true}, yp, m, k, n, n0);
    if (n - n0 < kCols) return edge(xp, wp, yp, m, k, n, n0);
    block(xp, Block{wp + n0, n, false}, yp, m, k, n, n0);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedCpuMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
