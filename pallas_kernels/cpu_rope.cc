// RoPE's cos / sin tables of a step on the CPU, an XLA FFI custom call (see cpu_rope.py).
//
// cos[u, t, h] = cos[u, t, h + H] = cos(float(positions[t]) * inv_freq[u, h]), likewise sin: the angle is
// the float32 product XLA's cos_sin forms, its cosine and sine taken in double and rounded once. As one
// call the tables are made once a step; XLA:CPU instead sinks the cosines into every layer's RoPE fusion
// and evaluates them per head. Rows (u, t) are work items shared with XLA's intra-op threads (cpu_pool.h).

#include <cmath>
#include <cstdint>

#include "cpu_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error RopeTables(ffi::ThreadPool pool, ffi::Buffer<ffi::S32> positions, ffi::Buffer<ffi::F32> inv_freq,
                      ffi::ResultBuffer<ffi::F32> cos, ffi::ResultBuffer<ffi::F32> sin) {
  auto pd = positions.dimensions();
  auto fd = inv_freq.dimensions();
  if (pd.size() != 1 || fd.size() != 2)
    return ffi::Error::InvalidArgument("cpu rope tables: positions [T], inv_freq [U, H]");
  const int64_t t_len = pd[0], u_len = fd[0], h_len = fd[1];
  const int32_t* pos = positions.typed_data();
  const float* freq = inv_freq.typed_data();
  float* cp = cos->typed_data();
  float* sp = sin->typed_data();
  jaxpaged::run_items(pool, u_len * t_len, [=](int64_t row) {  // row = u * T + t
    const int64_t u = row / t_len, t = row % t_len;
    const float p = static_cast<float>(pos[t]);
    float* c = cp + row * 2 * h_len;
    float* s = sp + row * 2 * h_len;
    for (int64_t h = 0; h < h_len; ++h) {
      const double angle = static_cast<double>(p * freq[u * h_len + h]);  // the float32 product, as XLA's
      c[h] = c[h + h_len] = static_cast<float>(std::cos(angle));
      s[h] = s[h + h_len] = static_cast<float>(std::sin(angle));
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedCpuRopeTables, RopeTables,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
