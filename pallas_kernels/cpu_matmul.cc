// Matmul on the CPU for a decode step's rows: y [M, N] = x [M, K] @ w [K, N], float32, an XLA
// FFI custom call (see cpu_matmul.py).
//
// XLA:CPU hands a 17-32-row dot to YNNPACK, whose GEMM packs w on every call: each weight
// byte is read, written and read again, and the step's dots ran at ~55% of the cores' FMA
// rate. Here w is read in place. A work item is one 64-column block of w (4 AVX-512
// vectors wide); its rows of x go through in near-equal groups of at most 6, each group a
// register tile of 6 x 4 accumulators fed one row of the block at a time (the block stays
// in this core's cache between groups; rows 8 ahead prefetched). Items are shared between
// the calling thread and XLA's intra-op thread pool (cpu_pool.h).

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

// y[0:MR, n0:n0+64] = x[0:MR, :] @ w[:, n0:n0+64], MR x 4 accumulators in registers.
template <int MR>
void tile(const float* x, const float* w, float* y, int64_t k, int64_t n, int64_t n0) {
  __m512 acc[MR][4];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  const float* wr = w + n0;
  for (int64_t i = 0; i < k; ++i, wr += n) {
    _mm_prefetch(reinterpret_cast<const char*>(wr + 8 * n), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wr + 8 * n + 16), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wr + 8 * n + 32), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(wr + 8 * n + 48), _MM_HINT_T0);
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

// Rows [r0, r1) (at most kMaxRows) of column block n0.
void item(const float* x, const float* w, float* y, int64_t r0, int64_t r1, int64_t k, int64_t n, int64_t n0) {
  const float* xr = x + r0 * k;
  float* yr = y + r0 * n;
  if (n - n0 < kCols) return edge(xr, w, yr, r1 - r0, k, n, n0);
  switch (r1 - r0) {
    case 6: tile<6>(xr, w, yr, k, n, n0); break;
    case 5: tile<5>(xr, w, yr, k, n, n0); break;
    case 4: tile<4>(xr, w, yr, k, n, n0); break;
    case 3: tile<3>(xr, w, yr, k, n, n0); break;
    case 2: tile<2>(xr, w, yr, k, n, n0); break;
    case 1: tile<1>(xr, w, yr, k, n, n0); break;
  }
}

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                  ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("cpu matmul: x [M, K] and w [K, N]");
  const int64_t m = xd[0], k = xd[1], n = wd[1];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  // Items: column blocks, each for all m rows in near-equal groups of <= kMaxRows (the block
  // stays in this core's cache between groups).
  const int64_t groups = (m + kMaxRows - 1) / kMaxRows;
  const int64_t total = (n + kCols - 1) / kCols;
  jaxpaged::run_items(pool, total, [=](int64_t i) {
    for (int64_t g = 0; g < groups; ++g)
      item(xp, wp, yp, m * g / groups, m * (g + 1) / groups, k, n, i * kCols);
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
