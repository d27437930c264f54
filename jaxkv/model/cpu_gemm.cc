// float32 matmul through MKL's sgemm, an XLA FFI custom call for the CPU
// backend (see jaxkv/model/cpu_gemm.py for why and when it is used).
#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

extern "C" void cblas_sgemm(int layout, int transa, int transb, int m, int n, int k, float alpha,
                            const float* a, int lda, const float* b, int ldb, float beta, float* c,
                            int ldc);

namespace {
constexpr int kRowMajor = 101, kNoTrans = 111;

// x [M, K] @ w [K, N] -> y [M, N], all row-major float32.
ffi::Error Sgemm(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  auto dx = x.dimensions();
  auto dw = w.dimensions();
  if (dx.size() != 2 || dw.size() != 2 || dx[1] != dw[0]) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxkv_sgemm: x [M, K] @ w [K, N] expected");
  }
  const int m = dx[0], k = dx[1], n = dw[1];
  if (m == 0 || n == 0) return ffi::Error::Success();
  cblas_sgemm(kRowMajor, kNoTrans, kNoTrans, m, n, k, 1.0f, x.typed_data(), k, w.typed_data(), n,
              0.0f, y->typed_data(), n);
  return ffi::Error::Success();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(sgemm, Sgemm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
