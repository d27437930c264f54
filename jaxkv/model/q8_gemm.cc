// x @ W^T for a weight W [N, K] kept as GGUF Q8_0 blocks (int8 q [N, K], one
// float32 scale d [N, K / 32] per 32 values along K), an XLA FFI custom call
// for the CPU backend (see jaxkv/model/q8.py for why and when it is used).
//
// Each weight is q * d: exact in float32 (d is a float16 widened, q has 8
// bits), so every product x * (q * d) is the one a float32 matmul of the
// dequantized weight forms; only the order of the sums differs. Few rows
// (decode): the int8 rows are read once, widened in registers, and every
// row of x accumulates against them; the weight's bytes are a quarter of
// float32's, and a decode step is bound by reading them. Many rows: tiles of
// W are widened into float32 scratch that stays in cache and MKL's sgemm
// multiplies them.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

extern "C" void cblas_sgemm(int layout, int transa, int transb, int m, int n, int k, float alpha,
                            const float* a, int lda, const float* b, int ldb, float beta, float* c,
                            int ldc);
extern "C" int MKL_Set_Num_Threads_Local(int n);

namespace {
constexpr int kBlock = 32;      // values per Q8_0 block
constexpr int kFewRows = 32;    // up to this many rows: the register path (in groups of 8)
constexpr int kTile = 64;       // W rows widened at a time on the sgemm path
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

// Rows [n0, n1) of y for T <= kFewRows rows of x: each block widened to
// float32 in registers (w = q * d, exact) and fused into every row's
// accumulators (A per row, so few rows still keep several FMA chains).
template <int T>
void few_rows_t(const float* x, const int8_t* q, const float* d, float* y, int K, int N, int n0,
                int n1) {
  constexpr int A = T <= 2 ? 4 : (T <= 4 ? 2 : 1);
  const int nb = K / kBlock;
  for (int n = n0; n < n1; ++n) {
    const int8_t* qn = q + int64_t(n) * K;
    const float* dn = d + int64_t(n) * nb;
#ifdef __AVX2__
    __m256 acc[T][A];
    for (int t = 0; t < T; ++t)
      for (int a = 0; a < A; ++a) acc[t][a] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
      const __m256 s = _mm256_set1_ps(dn[b]);
      const int8_t* qb = qn + b * kBlock;
      __m256 w[4];
      for (int j = 0; j < 4; ++j)
        w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qb + 8 * j)))),
                             s);
      for (int t = 0; t < T; ++t) {
        const float* xb = x + int64_t(t) * K + b * kBlock;
        for (int j = 0; j < 4; ++j)
          acc[t][j % A] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8 * j), w[j], acc[t][j % A]);
      }
    }
    for (int t = 0; t < T; ++t) {
      __m256 v = acc[t][0];
      for (int a = 1; a < A; ++a) v = _mm256_add_ps(v, acc[t][a]);
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, v);
      float sum = 0.0f;
      for (int i = 0; i < 8; ++i) sum += lanes[i];
      y[int64_t(t) * N + n] = sum;
    }
#else
    for (int t = 0; t < T; ++t) {
      const float* xt = x + int64_t(t) * K;
      float sum = 0.0f;
      for (int b = 0; b < nb; ++b)
        for (int i = 0; i < kBlock; ++i)
          sum += xt[b * kBlock + i] * (float(qn[b * kBlock + i]) * dn[b]);
      y[int64_t(t) * N + n] = sum;
    }
#endif
  }
}

void few_rows(const float* x, const int8_t* q, const float* d, float* y, int T, int K, int N,
              int n0, int n1) {
  for (; T > 8; T -= 8, x += 8 * int64_t(K), y += 8 * int64_t(N))  // groups of 8 rows
    few_rows_t<8>(x, q, d, y, K, N, n0, n1);
  switch (T) {
    case 1: return few_rows_t<1>(x, q, d, y, K, N, n0, n1);
    case 2: return few_rows_t<2>(x, q, d, y, K, N, n0, n1);
    case 3: return few_rows_t<3>(x, q, d, y, K, N, n0, n1);
    case 4: return few_rows_t<4>(x, q, d, y, K, N, n0, n1);
    case 5: return few_rows_t<5>(x, q, d, y, K, N, n0, n1);
    case 6: return few_rows_t<6>(x, q, d, y, K, N, n0, n1);
    case 7: return few_rows_t<7>(x, q, d, y, K, N, n0, n1);
    default: return few_rows_t<8>(x, q, d, y, K, N, n0, n1);
  }
}

// Rows [n0, n1) of y through float32 tiles of W and sgemm.
void many_rows(const float* x, const int8_t* q, const float* d, float* y, int T, int K, int N,
               int n0, int n1, std::vector<float>& tile) {
  const int nb = K / kBlock;
  tile.resize(size_t(kTile) * K);
  for (int r0 = n0; r0 < n1; r0 += kTile) {
    const int rows = std::min(kTile, n1 - r0);
    for (int r = 0; r < rows; ++r) {
      const int8_t* qn = q + int64_t(r0 + r) * K;
      const float* dn = d + int64_t(r0 + r) * nb;
      float* out = tile.data() + size_t(r) * K;
      for (int b = 0; b < nb; ++b) {
        const float s = dn[b];
#pragma omp simd
        for (int i = 0; i < kBlock; ++i) out[b * kBlock + i] = float(qn[b * kBlock + i]) * s;
      }
    }
    cblas_sgemm(kRowMajor, kNoTrans, kTrans, T, rows, K, 1.0f, x, K, tile.data(), K, 0.0f, y + r0,
                N);
  }
}

// x [T, K] float32, q [N, K] int8, d [N, K / 32] float32 -> y [T, N] float32.
ffi::Error Q8Matmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q, ffi::Buffer<ffi::F32> d,
                    ffi::ResultBuffer<ffi::F32> y) {
  auto dx = x.dimensions();
  auto dq = q.dimensions();
  auto dd = d.dimensions();
  if (dx.size() != 2 || dq.size() != 2 || dd.size() != 2 || dx[1] != dq[1] || dq[1] % kBlock ||
      dd[0] != dq[0] || dd[1] != dq[1] / kBlock) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jaxkv_q8_matmul: x [T, K], q [N, K] int8, d [N, K / 32] expected");
  }
  const int T = dx[0], K = dx[1], N = dq[0];
  if (T == 0 || N == 0) return ffi::Error::Success();
  const float* xp = x.typed_data();
  const int8_t* qp = q.typed_data();
  const float* dp = d.typed_data();
  float* yp = y->typed_data();
  // Threads: one per 2M weights (a parallel region costs microseconds).
  const int64_t weights = int64_t(N) * K;
  const int threads = int(std::clamp<int64_t>(weights >> 21, 1, omp_get_max_threads()));
  constexpr int kChunk = 256;  // W rows per scheduled piece
  const int pieces = (N + kChunk - 1) / kChunk;
#pragma omp parallel num_threads(threads)
  {
    const int prev = MKL_Set_Num_Threads_Local(1);
    std::vector<float> tile;
#pragma omp for schedule(dynamic, 4)
    for (int p = 0; p < pieces; ++p) {
      const int n0 = p * kChunk, n1 = std::min(N, n0 + kChunk);
      if (T <= kFewRows)
        few_rows(xp, qp, dp, yp, T, K, N, n0, n1);
      else
        many_rows(xp, qp, dp, yp, T, K, N, n0, n1, tile);
    }
    MKL_Set_Num_Threads_Local(prev);
  }
  return ffi::Error::Success();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(q8_matmul, Q8Matmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
