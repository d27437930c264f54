// The BLAS of jaxkv's native CPU kernels, chosen per CPU at load time
// (pallas_kernels/native.py, `blas`): Intel MKL (linked; the default) or
// another CBLAS with 64-bit integers (numpy's bundled OpenBLAS, whose
// DYNAMIC_ARCH build picks its kernels for the CPU it runs on), whose entry
// points `jaxkv_blas_use` installs. Every kernel calls `jaxkv::sgemm` and,
// inside its own OpenMP regions, `jaxkv::blas_threads_local(1)` so the BLAS
// runs on the calling thread alone.

#pragma once

#include <cstdint>

extern "C" {
void cblas_sgemm(int layout, int transa, int transb, int m, int n, int k, float alpha,
                 const float* a, int lda, const float* b, int ldb, float beta, float* c, int ldc);
int MKL_Set_Num_Threads_Local(int nth);
}

namespace jaxkv {

using Sgemm64 = void (*)(int, int, int, int64_t, int64_t, int64_t, float, const float*, int64_t,
                         const float*, int64_t, float, float*, int64_t);
using ThreadsLocal = int (*)(int);

inline Sgemm64 g_sgemm64 = nullptr;         // null: MKL's cblas_sgemm
inline ThreadsLocal g_threads_local = nullptr;

inline void sgemm(int layout, int transa, int transb, int m, int n, int k, float alpha,
                  const float* a, int lda, const float* b, int ldb, float beta, float* c,
                  int ldc) {
  if (g_sgemm64 != nullptr)
    g_sgemm64(layout, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  else
    cblas_sgemm(layout, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// Sets the calling thread's BLAS thread count; returns the previous one.
inline int blas_threads_local(int n) {
  return g_threads_local != nullptr ? g_threads_local(n) : MKL_Set_Num_Threads_Local(n);
}

}  // namespace jaxkv

// Both null: back to MKL. Each library built with this header exports it.
extern "C" __attribute__((visibility("default"))) void jaxkv_blas_use(void* sgemm64,
                                                                     void* threads_local) {
  jaxkv::g_sgemm64 = reinterpret_cast<jaxkv::Sgemm64>(sgemm64);
  jaxkv::g_threads_local = reinterpret_cast<jaxkv::ThreadsLocal>(threads_local);
}
