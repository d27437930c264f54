// The CPU matmuls jaxkv calls as XLA FFI custom calls (one library, built
// on first use by pallas_kernels.native):
//
// sgemm: float32 x [M, K] @ w [K, N] through MKL's sgemm (see
// jaxkv/model/cpu_gemm.py for why and when it is used).
//
// grouped_sgemm: rows x [M, K] sorted by group, w [G, K, N], sizes [G]: group
// g's rows times w[g], each piece (a group's rows, a slice of N) one sgemm,
// the pieces over the threads; rows past the groups are zeros (a mixture of
// experts' grouped matmul, jaxkv/model/moe.py, as jax.lax.ragged_dot).
//
// block_matmul: x @ W^T for a weight W [N, K] kept in its GGUF file's blocks, as shipped:
// each row is K / V blocks of one type, V = 32 values (Q4_0, Q4_1, Q5_0, Q8_0) or a
// 256-value K-quant super-block (Q4_K, Q5_K, Q6_K; K % 256 == 0), an XLA FFI
// custom call for the CPU backend (see jaxkv/model/blocks.py; the tied Q8_0
// embedding as the head: jaxkv/model/q8.py).
//
// A block widens, 32 values at a time, to the float32 values the gguf library's
// dequantization gives (Q4_0: (q - 8) d; Q4_1: q d + m; Q5_0: (q - 16) d with a
// fifth bit per value; Q8_0: q d; Q4_K and Q5_K: q (d sc) - dmin m, sc and m the
// 6-bit scale and min of each 32 values, q of 4 or 5 bits; Q6_K: (q - 32) (d sc),
// sc an int8 scale per 16 values), and every row of x accumulates against them:
// few rows in registers (a decode step reads the blocks once: Q4_1 is 20 bytes
// per 32 values, Q4_K 144 per 256, against float32's 128 per 32), many rows
// through float32 tiles that stay in cache and MKL's sgemm. Every product and
// difference above is exact in float32 or rounded once, as numpy rounds it.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include "blas.h"
#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;


namespace {
constexpr int kPart = 32;  // values widened at a time: a block, or 1/8 of a super-block
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8;  // ggml's type ids
constexpr int kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;
constexpr int kFewRows = 32;  // up to this many rows: the register path (groups of 8)
constexpr int kTile = 64;     // the fewest W rows widened at a time on the sgemm path
constexpr int kTileFloats = 1 << 20;  // and the most floats (4 MB) of one tile
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

constexpr int block_values(int type) { return type >= kQ4_K ? 256 : 32; }

constexpr int block_bytes(int type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ8_0: return 34;
    case kQ4_K: return 144;  // d, dmin (fp16), 12 bytes of scales and mins, 128 of nibbles
    case kQ5_K: return 176;  // as Q4_K, then 32 bytes of fifth bits before the nibbles
    case kQ6_K: return 210;  // 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d
    default: return 0;
  }
}

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// The few-rows paths read W a row at a time and stream it from memory once
// per call. Each row asks for the row kAheadRows on (JAXKV_PREFETCH_ROWS,
// default 8; 0 turns it off). Measured A/B, SmolLM2 Q4_1 batch-1 decode: on
// the 2-core Xeon VM 66-71 -> 98-103 tok/s (a 70 MB weight set streamed by
// one thread: 9 -> 22 GB/s); on the 2-core EPYC VM no change (123-146 with
// 0, 128-147 with 8), its hardware prefetcher already keeps up.
static const int kAheadRows = [] {
  const char* v = std::getenv("JAXKV_PREFETCH_ROWS");
  return v ? std::max(0, std::atoi(v)) : 8;
}();
inline void prefetch_ahead(const uint8_t* row, int64_t row_bytes, int n, int n1) {
  if (kAheadRows == 0 || n + kAheadRows >= n1) return;
  const uint8_t* ahead = row + kAheadRows * row_bytes;
  for (int64_t o = 0; o < row_bytes; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(ahead + o), _MM_HINT_T0);
}

inline __m128i load16(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// Bits [shift, shift + width) of 32 bytes p[0..31], as bytes q[0] (0-15), q[1] (16-31).
inline void bits(const uint8_t* p, int shift, int width, __m128i q[2]) {
  const __m128i s = _mm_cvtsi32_si128(shift), m = _mm_set1_epi8(char((1 << width) - 1));
  q[0] = _mm_and_si128(_mm_srl_epi16(load16(p), s), m);
  q[1] = _mm_and_si128(_mm_srl_epi16(load16(p + 16), s), m);
}

// 32 bytes q (as from `bits`; int8 where SIGNED, else uint8) as 4 x 8 floats.
template <bool SIGNED>
inline void floats(const __m128i q[2], __m256 f[4]) {
  for (int j = 0; j < 4; ++j) {
    const __m128i h = j % 2 ? _mm_srli_si128(q[j / 2], 8) : q[j / 2];
    f[j] = _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(h) : _mm256_cvtepu8_epi32(h));
  }
}

// One block of TYPE at b, read as block_values / 32 parts of 32 floats
// (`widen(p, w)`: value 32 p + 8 j + i in w[j] lane i). The 32-value types:
template <int TYPE>
struct Block {
  const uint8_t* b;
  explicit Block(const uint8_t* b) : b(b) {}

  void widen(int, __m256 w[4]) const {
    const __m256 d = _mm256_set1_ps(half(b));
    if constexpr (TYPE == kQ8_0) {
      for (int j = 0; j < 4; ++j)
        w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                 _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * j)))),
                             d);
    } else {
      const uint8_t* qs = b + (TYPE == kQ4_0 ? 2 : TYPE == kQ4_1 ? 4 : 6);  // after d (m; qh)
      const __m128i v = load16(qs);
      const __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0F));
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
      __m256i q[4] = {_mm256_cvtepu8_epi32(lo), _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)),
                      _mm256_cvtepu8_epi32(hi), _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))};
      if constexpr (TYPE == kQ5_0) {
        uint32_t qh;
        std::memcpy(&qh, b + 2, 4);
        const __m256i high = _mm256_set1_epi32(int(qh));
        for (int j = 0; j < 4; ++j) {
          const __m256i shift = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                 _mm256_set1_epi32(8 * j));
          const __m256i h = _mm256_and_si256(_mm256_srlv_epi32(high, shift), _mm256_set1_epi32(1));
          q[j] = _mm256_sub_epi32(_mm256_or_si256(q[j], _mm256_slli_epi32(h, 4)),
                                  _mm256_set1_epi32(16));
        }
      } else if constexpr (TYPE == kQ4_0) {
        for (int j = 0; j < 4; ++j) q[j] = _mm256_sub_epi32(q[j], _mm256_set1_epi32(8));
      }
      if constexpr (TYPE == kQ4_1) {
        const __m256 m = _mm256_set1_ps(half(b + 2));
        for (int j = 0; j < 4; ++j)
          w[j] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(q[j]), d), m);
      } else {
        for (int j = 0; j < 4; ++j) w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(q[j]), d);
      }
    }
  }
};

// Q4_K and Q5_K: 8 parts of 32, each with a 6-bit scale sc and min m packed
// in 12 bytes (parts 0-3: the low 6 bits of bytes 0-3 and 4-7; parts 4-7:
// the nibbles of bytes 8-11 below the top 2 bits of bytes 0-3 and 4-7).
// Part p's nibbles are those (low for even p) of bytes 32 (p / 2) to
// 32 (p / 2) + 31; Q5_K's fifth bit of value i of part p is bit p of qh[i].
// d sc and dmin m are exact in float32, so q (d sc) - dmin m is rounded once.
template <int TYPE>
struct KBlock {
  static constexpr int kQs = TYPE == kQ5_K ? 48 : 16;
  const uint8_t* b;
  alignas(32) float ds[8];
  alignas(32) float dm[8];

  explicit KBlock(const uint8_t* b) : b(b) {
    uint32_t u[3], sc[2], m[2];
    std::memcpy(u, b + 4, 12);
    sc[0] = u[0] & 0x3F3F3F3F;
    m[0] = u[1] & 0x3F3F3F3F;
    sc[1] = (u[2] & 0x0F0F0F0F) | ((u[0] >> 2) & 0x30303030);
    m[1] = ((u[2] >> 4) & 0x0F0F0F0F) | ((u[1] >> 2) & 0x30303030);
    const auto eight = [](const uint32_t* v) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(v));
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
    };
    _mm256_store_ps(ds, _mm256_mul_ps(eight(sc), _mm256_set1_ps(half(b))));
    _mm256_store_ps(dm, _mm256_mul_ps(eight(m), _mm256_set1_ps(half(b + 2))));
  }

  void widen(int p, __m256 w[4]) const {
    __m128i q[2];
    bits(b + kQs + 32 * (p / 2), 4 * (p & 1), 4, q);
    if constexpr (TYPE == kQ5_K) {
      __m128i h[2];
      bits(b + 16, p, 1, h);
      for (int i = 0; i < 2; ++i) q[i] = _mm_or_si128(q[i], _mm_slli_epi16(h[i], 4));
    }
    const __m256 s = _mm256_broadcast_ss(ds + p), m = _mm256_broadcast_ss(dm + p);
    floats<false>(q, w);
    for (int j = 0; j < 4; ++j) w[j] = _mm256_fmsub_ps(w[j], s, m);
  }
};
template <>
struct Block<kQ4_K> : KBlock<kQ4_K> {
  using KBlock::KBlock;
};
template <>
struct Block<kQ5_K> : KBlock<kQ5_K> {
  using KBlock::KBlock;
};

// Q6_K: parts 4 h + k (h, k < 4) take the nibbles (low for even k) of ql
// bytes 64 h + 32 (k % 2) + i over bits 2 k of qh byte 32 h + i, less 32;
// one int8 scale per 16 values, times d (exact in float32, as is every value).
template <>
struct Block<kQ6_K> {
  const uint8_t* b;
  alignas(32) float ds[16];

  explicit Block(const uint8_t* b) : b(b) {
    const __m256 d = _mm256_set1_ps(half(b + 208));
    const __m128i sc = load16(b + 192);
    for (int i = 0; i < 2; ++i) {
      const __m128i half_sc = i ? _mm_srli_si128(sc, 8) : sc;
      const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(half_sc));
      _mm256_store_ps(ds + 8 * i, _mm256_mul_ps(v, d));
    }
  }

  void widen(int p, __m256 w[4]) const {
    const int h = p / 4, k = p % 4;
    __m128i q[2], hi[2];
    bits(b + 64 * h + 32 * (k % 2), 4 * (k / 2), 4, q);
    bits(b + 128 + 32 * h, 2 * k, 2, hi);
    for (int i = 0; i < 2; ++i)  // 0..63 less 32, as int8
      q[i] = _mm_sub_epi8(_mm_or_si128(q[i], _mm_slli_epi16(hi[i], 4)), _mm_set1_epi8(32));
    const __m256 s0 = _mm256_broadcast_ss(ds + 2 * p), s1 = _mm256_broadcast_ss(ds + 2 * p + 1);
    floats<true>(q, w);
    for (int j = 0; j < 4; ++j) w[j] = _mm256_mul_ps(w[j], j < 2 ? s0 : s1);
  }
};

// Rows [n0, n1) of y for T <= 8 rows of x (A accumulators per row).
template <int TYPE, int T>
void few_rows_t(const float* x, const uint8_t* w, float* y, int K, int N, int n0, int n1) {
  constexpr int A = T <= 2 ? 4 : (T <= 4 ? 2 : 1);
  constexpr int V = block_values(TYPE), bb = block_bytes(TYPE);
  const int nb = K / V;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* row = w + int64_t(n) * nb * bb;
    prefetch_ahead(row, int64_t(nb) * bb, n, n1);
    __m256 acc[T][A];
    for (int t = 0; t < T; ++t)
      for (int a = 0; a < A; ++a) acc[t][a] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) {
      const Block<TYPE> block(row + b * bb);
#pragma GCC unroll 8  // a K super-block's parts: constant shifts and offsets
      for (int p = 0; p < V / kPart; ++p) {
        __m256 v[4];
        block.widen(p, v);
        for (int t = 0; t < T; ++t) {
          const float* xb = x + int64_t(t) * K + b * V + p * kPart;
          for (int j = 0; j < 4; ++j)
            acc[t][j % A] = _mm256_fmadd_ps(_mm256_loadu_ps(xb + 8 * j), v[j], acc[t][j % A]);
        }
      }
    }
    for (int t = 0; t < T; ++t) {
      __m256 s = acc[t][0];
      for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[t][a]);
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, s);
      float sum = 0.0f;
      for (int i = 0; i < 8; ++i) sum += lanes[i];
      y[int64_t(t) * N + n] = sum;
    }
  }
}

template <int TYPE>
void few_rows(const float* x, const uint8_t* w, float* y, int T, int K, int N, int n0, int n1) {
  for (; T > 8; T -= 8, x += 8 * int64_t(K), y += 8 * int64_t(N))
    few_rows_t<TYPE, 8>(x, w, y, K, N, n0, n1);
  switch (T) {
    case 1: return few_rows_t<TYPE, 1>(x, w, y, K, N, n0, n1);
    case 2: return few_rows_t<TYPE, 2>(x, w, y, K, N, n0, n1);
    case 3: return few_rows_t<TYPE, 3>(x, w, y, K, N, n0, n1);
    case 4: return few_rows_t<TYPE, 4>(x, w, y, K, N, n0, n1);
    case 5: return few_rows_t<TYPE, 5>(x, w, y, K, N, n0, n1);
    case 6: return few_rows_t<TYPE, 6>(x, w, y, K, N, n0, n1);
    case 7: return few_rows_t<TYPE, 7>(x, w, y, K, N, n0, n1);
    default: return few_rows_t<TYPE, 8>(x, w, y, K, N, n0, n1);
  }
}

// The integer path of the 32-value blocks Q4_0, Q4_1 and Q8_0 at few rows
// (a decode step): each row of x is rounded once per call to int8 in
// blocks of 32 (d = max |x| / 127, q = x (127 / max |x|) rounded to
// nearest even: Q8_0's rounding), and a block's product is integer
// (uint8 x int8, 4 neighbours summed to int32: VNNI's dpbusd where the CPU
// has it, else maddubs to int16 and madd; no term can saturate), scaled once by d_w d_x. Q4_1's min and Q4_0's -8 join through
// d_x sum(q) (round_x = 0 keeps the float path: JAXKV_GGUF_ROUND_X=0). A decode step then costs a few instructions per 32 weights,
// not a float widening of each. The rounding of x is the one error beyond
// the float32 path's (tests/test_blocks.py checks it against a float64
// product of the rounded rows).
constexpr bool int_path(int type) { return type == kQ4_0 || type == kQ4_1 || type == kQ8_0; }

struct RoundedX {
  std::vector<int8_t> q;  // [T, K]
  std::vector<float> d;   // [T, K / 32] scale of each 32 values
  std::vector<float> s;   // [T, K / 32] d * sum(q) of each 32 values
};

inline float hsum(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

inline int hsum_i32(__m256i v) {
  __m128i a = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4E));
  a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0xB1));
  return _mm_cvtsi128_si32(a);
}

void round_x(const float* x, int T, int K, RoundedX& r) {
  const int nb = K / kPart;
  r.q.resize(size_t(T) * K);
  r.d.resize(size_t(T) * nb);
  r.s.resize(size_t(T) * nb);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < int64_t(T) * nb; ++i) {
    const float* xb = x + i * kPart;
    __m256 v[4], m = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    a = _mm_max_ss(a, _mm_movehdup_ps(a));
    const float amax = _mm_cvtss_f32(a);
    const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    __m256i q[4];
    for (int j = 0; j < 4; ++j)
      q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(inv)));  // nearest even
    const int sum = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]),
                                              _mm256_add_epi32(q[2], q[3])));
    // int32 -> int8 in order: the packs work per 128-bit lane, the permute restores it.
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                         _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.q.data() + i * kPart),
                        _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    r.d[i] = d;
    r.s[i] = d * float(sum);
  }
}

// uint8 u times int8 v, 4 neighbours summed, plus acc (int32 lanes).
inline __m256i dot_u8i8(__m256i acc, __m256i u, __m256i v) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, v);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, v);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, v),
                                                 _mm256_set1_epi16(1)));
#endif
}

// Rows [n0, n1) of y for T <= 8 rounded rows of x (A accumulators per row:
// a block's fmadd waits on the one before it otherwise).
template <int TYPE, int T>
void few_rows_int_t(const int8_t* q, const float* dx, const float* sx, const uint8_t* w,
                    float* y, int K, int N, int n0, int n1) {
  constexpr int bb = block_bytes(TYPE), A = T <= 2 ? 2 : 1;
  const int nb = K / kPart;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* row = w + int64_t(n) * nb * bb;
    prefetch_ahead(row, int64_t(nb) * bb, n, n1);
    __m256 acc[T][A];
    float bias[T];
    for (int t = 0; t < T; ++t) {
      for (int a = 0; a < A; ++a) acc[t][a] = _mm256_setzero_ps();
      bias[t] = 0.0f;
    }
    const auto block = [&](int b, auto a) {  // a: the accumulator, a compile-time index
      const uint8_t* blk = row + b * bb;
      const float dw = half(blk);
      __m256i wv;
      if constexpr (TYPE == kQ8_0) {
        wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2));
      } else {
        const __m128i v = load16(blk + (TYPE == kQ4_0 ? 2 : 4));
        const __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0F));
        const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
        wv = _mm256_set_m128i(hi, lo);  // values 0-15, then 16-31
      }
      const float off = TYPE == kQ4_1 ? half(blk + 2) : TYPE == kQ4_0 ? -8.0f * dw : 0.0f;
      for (int t = 0; t < T; ++t) {
        const __m256i xq = _mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(q + int64_t(t) * K + b * kPart));
        __m256i p32;
        if constexpr (TYPE == kQ8_0)  // |w| as uint8, w's sign moved onto x
          p32 = dot_u8i8(_mm256_setzero_si256(), _mm256_sign_epi8(wv, wv),
                         _mm256_sign_epi8(xq, wv));
        else
          p32 = dot_u8i8(_mm256_setzero_si256(), wv, xq);
        const int64_t i = int64_t(t) * nb + b;
        acc[t][a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p32), _mm256_set1_ps(dw * dx[i]),
                                    acc[t][a]);
        if constexpr (TYPE != kQ8_0) bias[t] += off * sx[i];
      }
    };
    int b = 0;
    for (; b + A <= nb; b += A) {
      block(b, std::integral_constant<int, 0>());
      if constexpr (A == 2) block(b + 1, std::integral_constant<int, A - 1>());
    }
    for (; b < nb; ++b) block(b, std::integral_constant<int, 0>());
    for (int t = 0; t < T; ++t) {
      __m256 sum = acc[t][0];
      for (int a = 1; a < A; ++a) sum = _mm256_add_ps(sum, acc[t][a]);
      y[int64_t(t) * N + n] = hsum(sum) + bias[t];
    }
  }
}

template <int TYPE>
void few_rows_int(const RoundedX& r, const uint8_t* w, float* y, int T, int K, int N, int n0,
                  int n1) {
  const int nb = K / kPart;
  const int8_t* q = r.q.data();
  const float *dx = r.d.data(), *sx = r.s.data();
  for (; T > 8; T -= 8, q += 8 * int64_t(K), dx += 8 * nb, sx += 8 * nb, y += 8 * int64_t(N))
    few_rows_int_t<TYPE, 8>(q, dx, sx, w, y, K, N, n0, n1);
  switch (T) {
    case 1: return few_rows_int_t<TYPE, 1>(q, dx, sx, w, y, K, N, n0, n1);
    case 2: return few_rows_int_t<TYPE, 2>(q, dx, sx, w, y, K, N, n0, n1);
    case 3: return few_rows_int_t<TYPE, 3>(q, dx, sx, w, y, K, N, n0, n1);
    case 4: return few_rows_int_t<TYPE, 4>(q, dx, sx, w, y, K, N, n0, n1);
    case 5: return few_rows_int_t<TYPE, 5>(q, dx, sx, w, y, K, N, n0, n1);
    case 6: return few_rows_int_t<TYPE, 6>(q, dx, sx, w, y, K, N, n0, n1);
    case 7: return few_rows_int_t<TYPE, 7>(q, dx, sx, w, y, K, N, n0, n1);
    default: return few_rows_int_t<TYPE, 8>(q, dx, sx, w, y, K, N, n0, n1);
  }
}

// Rows [n0, n1) of y through float32 tiles of W and sgemm.
template <int TYPE>
void many_rows(const float* x, const uint8_t* w, float* y, int T, int K, int N, int n0, int n1,
               std::vector<float>& tile) {
  constexpr int V = block_values(TYPE), bb = block_bytes(TYPE);
  const int nb = K / V;
  const int tile_rows = std::min(n1 - n0, std::max(kTile, kTileFloats / K));
  tile.resize(size_t(tile_rows) * K);
  for (int r0 = n0; r0 < n1; r0 += tile_rows) {
    const int rows = std::min(tile_rows, n1 - r0);
    for (int r = 0; r < rows; ++r) {
      const uint8_t* row = w + int64_t(r0 + r) * nb * bb;
      float* out = tile.data() + size_t(r) * K;
      for (int b = 0; b < nb; ++b) {
        const Block<TYPE> block(row + b * bb);
#pragma GCC unroll 8
        for (int p = 0; p < V / kPart; ++p) {
          __m256 v[4];
          block.widen(p, v);
          for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + b * V + p * kPart + 8 * j, v[j]);
        }
      }
    }
    jaxkv::sgemm(kRowMajor, kNoTrans, kTrans, T, rows, K, 1.0f, x, K, tile.data(), K, 0.0f, y + r0,
                N);
  }
}

template <int TYPE>
void run(const float* x, const uint8_t* w, float* y, int T, int K, int N, bool round) {
  const int64_t weights = int64_t(N) * K;  // threads: one per 64K weights
  const int threads = int(std::clamp<int64_t>(weights >> 16, 1, jaxkv::pool_threads()));
  // Pieces of W rows: few rows, eight per thread (balanced), at least 8
  // rows each; many rows, one per thread (each its own large sgemms).
  // round_x: the integer path, at any row count (blocks.matmul asks for it
  // up to blocks.INT_ROWS rows)
  const bool kInt = int_path(TYPE) && round;
  const int pieces = T <= kFewRows || kInt ? std::max(1, std::min((N + 7) / 8, threads * 8))
                                           : threads;
  const int chunk = (N + pieces - 1) / pieces;
  RoundedX rx;
  if (kInt) round_x(x, T, K, rx);
  jaxkv::parallel_for(pieces, threads, [&](int p, int) {
    thread_local std::vector<float> tile;
    const int n0 = p * chunk, n1 = std::min(N, n0 + chunk);
    if (n0 >= n1) return;
    const int prev = jaxkv::blas_threads_local(1);
    if (kInt)
      few_rows_int<int_path(TYPE) ? TYPE : kQ8_0>(rx, w, y, T, K, N, n0, n1);
    else if (T <= kFewRows)
      few_rows<TYPE>(x, w, y, T, K, N, n0, n1);
    else
      many_rows<TYPE>(x, w, y, T, K, N, n0, n1, tile);
    jaxkv::blas_threads_local(prev);
  });
}

// x [M, K] @ w [K, N] -> y [M, N], all row-major float32.
ffi::Error Sgemm(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  auto dx = x.dimensions();
  auto dw = w.dimensions();
  if (dx.size() != 2 || dw.size() != 2 || dx[1] != dw[0]) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxkv_sgemm: x [M, K] @ w [K, N] expected");
  }
  const int m = dx[0], k = dx[1], n = dw[1];
  if (m == 0 || n == 0) return ffi::Error::Success();
  jaxkv::sgemm(kRowMajor, kNoTrans, kNoTrans, m, n, k, 1.0f, x.typed_data(), k, w.typed_data(), n,
              0.0f, y->typed_data(), n);
  return ffi::Error::Success();
}

// x [M, K] rows in groups of sizes [G] (sum <= M) @ w [G, K, N] -> y [M, N].
ffi::Error GroupedSgemm(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::S32> sizes,
                        ffi::ResultBuffer<ffi::F32> y) {
  auto dx = x.dimensions();
  auto dw = w.dimensions();
  if (dx.size() != 2 || dw.size() != 3 || dx[1] != dw[1] || sizes.element_count() != size_t(dw[0])) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jaxkv_grouped_sgemm: x [M, K], w [G, K, N], sizes [G] expected");
  }
  const int M = dx[0], K = dx[1], G = dw[0], N = dw[2];
  const int32_t* sz = sizes.typed_data();
  std::vector<int> start(G + 1, 0);
  for (int g = 0; g < G; ++g) start[g + 1] = start[g] + std::clamp(sz[g], 0, M - start[g]);
  float* yp = y->typed_data();
  std::memset(yp + int64_t(start[G]) * N, 0, sizeof(float) * int64_t(M - start[G]) * N);
  std::vector<int> busy;
  for (int g = 0; g < G; ++g)
    if (start[g + 1] > start[g]) busy.push_back(g);
  if (busy.empty() || N == 0) return ffi::Error::Success();
  const int threads = jaxkv::pool_threads();
  const int slices = std::max(1, std::min((N + 63) / 64, (4 * threads + int(busy.size()) - 1) /
                                                            int(busy.size())));
  const int width = (N + slices - 1) / slices;
  const int pieces = int(busy.size()) * slices;
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  jaxkv::parallel_for(pieces, std::min(threads, pieces), [&](int p, int) {
    const int g = busy[p / slices], n0 = (p % slices) * width, n = std::min(N, n0 + width) - n0;
    if (n <= 0) return;
    const int prev = jaxkv::blas_threads_local(1);
    jaxkv::sgemm(kRowMajor, kNoTrans, kNoTrans, start[g + 1] - start[g], n, K, 1.0f,
                 xp + int64_t(start[g]) * K, K, wp + int64_t(g) * K * N + n0, N, 0.0f,
                 yp + int64_t(start[g]) * N + n0, N);
    jaxkv::blas_threads_local(prev);
  });
  return ffi::Error::Success();
}

// x [T, K] float32, w [N, K / block values * block bytes] uint8 (blocks of `type`) -> y [T, N].
ffi::Error BlockMatmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> w,
                       ffi::ResultBuffer<ffi::F32> y, int32_t type, int32_t round_x) {
  auto dx = x.dimensions();
  auto dw = w.dimensions();
  const int bb = block_bytes(type);
  if (bb == 0)
    return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jaxkv_block_matmul: unsupported type");
  const int V = block_values(type);
  if (dx.size() != 2 || dw.size() != 2 || dx[1] % V || dw[1] != dx[1] / V * bb) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jaxkv_block_matmul: x [T, K] and w [N, K / block values * block bytes] "
                      "expected");
  }
  const int T = dx[0], K = dx[1], N = dw[0];
  if (T == 0 || N == 0) return ffi::Error::Success();
  const float* xp = x.typed_data();
  const uint8_t* wp = w.typed_data();
  float* yp = y->typed_data();
  switch (type) {
    case kQ4_0: run<kQ4_0>(xp, wp, yp, T, K, N, round_x); break;
    case kQ4_1: run<kQ4_1>(xp, wp, yp, T, K, N, round_x); break;
    case kQ5_0: run<kQ5_0>(xp, wp, yp, T, K, N, round_x); break;
    case kQ8_0: run<kQ8_0>(xp, wp, yp, T, K, N, round_x); break;
    case kQ4_K: run<kQ4_K>(xp, wp, yp, T, K, N, round_x); break;
    case kQ5_K: run<kQ5_K>(xp, wp, yp, T, K, N, round_x); break;
    default: run<kQ6_K>(xp, wp, yp, T, K, N, round_x); break;
  }
  return ffi::Error::Success();
}
}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(sgemm, Sgemm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(block_matmul, BlockMatmul,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int32_t>("type")
                                  .Attr<int32_t>("round_x"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(grouped_sgemm, GroupedSgemm,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
