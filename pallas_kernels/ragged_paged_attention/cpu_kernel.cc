// Causal flash attention over a paged KV cache for CPU (the ragged paged
// attention contract of reference.py), as XLA FFI handlers:
// `rpa_dense_prefill` serves the rows of sequences with q_len > 1 (dense.py's
// dense prefill contract), `rpa_ragged` every live row.
//
// Prefill: one task = (sequence, block of BQ query rows, KV head): the G =
// H / KVH query heads of that KV head are stacked into R = G * BQ rows so
// one K/V tile serves all of them. Each task walks only the keys its rows
// can see (from the oldest row's window start to the newest row), in chunks
// of at most kKeyChunk keys; per chunk S = Q K^T and acc += P V are MKL
// sgemms on tiles that stay in L2, the online softmax between them is
// vectorized.
//
// Decode (q_len == 1, `rpa_ragged` only): one task = (sequence, KV head):
// the G query heads against keys [max(0, kv_len - window), kv_len) read in
// place from the pages (no gather), vectorized D-float dot products and
// P V updates, the same online softmax per chunk of at most kKeyChunk keys.
// No slot at or past kv_len, or before the window, is ever read.
//
// Learned sinks (sinks [H], gpt-oss; sinks.py): each row's online softmax
// starts from its head's sink logit, m = sink and l = exp(sink - m) = 1,
// so the sink joins the denominator and the rescaling carries it. A sink of
// -inf (what cpu.py passes without sinks) is the plain start, m = -inf and
// l = 0.
//
// Page formats (kv_formats.py): float32 pages are read in place; bfloat16,
// float16, int8 (float32 scale per token), int4 (two nibbles a byte as
// halves, (n - 7.5) * scale, bfloat16 scale per token) and fp8 (e4m3fn,
// e5m2; plain values, decoded by integer ops) are dequantized a page run at a time into a float32
// tile that stays in L1 (`convert_rows`), so K and V move at their stored
// size and the arithmetic is the float32 path's.
//
// All tasks run in one OpenMP parallel region (dynamic schedule, costliest
// first; as many threads as the estimated work warrants), the BLAS sequential
// inside each.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <immintrin.h>

#include "blas.h"
#include "pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;


namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
constexpr int kTargetRows = 192;  // R = G * BQ aimed at (BQ a multiple of 16)
constexpr int kKeyChunk = 512;    // keys per online-softmax step (at most)
// Threads: one per this much estimated work (ns single-threaded; a prefill
// task runs at ~60 flop/ns in MKL, a decode at ~14, bound by reading K/V).
// A small call (a batch-8 decode at ~100-token contexts, ~0.15 ms) runs on
// the calling thread alone: waking a helper and joining it cost more there
// (0.19-0.21 ms with two). From batch 16 two threads halve a decode's time
// (SmolLM2's heads, 30 layers' pages, which come from memory: batch 16
// 0.36 -> 0.19 ms, batch 64 at 128-token contexts 1.9 -> 0.9 ms a layer).
constexpr double kNsPerThread = 0.2e6;
// The pool's workers wait this long for the next region before they sleep
// (not the pool's 2 ms): the calls of a step are a layer's matmuls apart,
// and a spinning worker takes a core from XLA's threads running them (in a
// batch-64 decode step spinning for 2 ms made the matmuls slower and the
// step no faster).
constexpr int kSpinUs = 50;
constexpr int kDecodeWeight = 4;  // a decode key costs ~4 prefill row-keys

// e^x for x <= 88.3 (Cephes expf: reduction by ln 2, degree-6 polynomial,
// exponent bits; ~1 ulp), written so GCC vectorizes the loops it is in.
inline float fast_exp(float x) {
  x = std::max(x, -87.0f);
  x = std::min(x, 88.3f);
  float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln 2)
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

struct Task {
  int seq, row0, rows, pos0, kvh;  // rows == 0: a decode (row row0, kv_len pos0 + 1)
  int64_t cost;  // rows x keys (prefill), kDecodeWeight x keys (decode)
};

struct Dims {
  int T, H, D, KVH, P, ps, S, W, G;
};

enum class Fmt { kF32, kBF16, kF16, kI8, kI4, kE4M3, kE5M2 };

// One of K or V: pages [KVH, P, ps, row_bytes] in format `fmt`, and for
// int8 / int4 the per-token scales [KVH, P, ps] (float32 or bfloat16).
struct Pages {
  const uint8_t* data;
  const uint8_t* scale;
  Fmt fmt;
  bool scale_bf16;
  int64_t row_bytes;
};

inline float bf16_to_float(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// The value of a small float's code (sign, exponent, kM mantissa bits,
// exponent bias kBias; sign at bit kSign): float16 (15, 10, 15), fp8
// e4m3fn (7, 3, 7) and e5m2 (7, 2, 15), by branch-free integer ops that
// vectorize: a normal code's exponent rebiased to float32's, a subnormal
// one m * 2^(1 - bias - kM). Finite codes only (infinities and NaN are
// never stored: the cache write saturates).
template <int kSign, int kM, int kBias>
inline float small_float(uint32_t code) {
  const uint32_t mag = code & ((1u << kSign) - 1);
  const uint32_t normal = (mag << (23 - kM)) + (uint32_t(127 - kBias) << 23);
  const float sub_value = float(mag) * (1.0f / float(1u << (kBias + kM - 1)));
  uint32_t sub;
  std::memcpy(&sub, &sub_value, sizeof(sub));
  const uint32_t is_normal = 0u - uint32_t((mag >> kM) != 0);  // all ones or zero
  const uint32_t bits = (normal & is_normal) | (sub & ~is_normal) | (code >> kSign) << 31;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline float token_scale(const Pages& pg, int64_t row) {
  if (pg.scale_bf16) return bf16_to_float(reinterpret_cast<const uint16_t*>(pg.scale)[row]);
  return reinterpret_cast<const float*>(pg.scale)[row];
}

// Rows [row, row + n) of `pg` (consecutive token slots of one page), as
// float32 values dst [n, D].
void convert_rows(const Pages& pg, int64_t row, int n, int D, float* dst) {
  const uint8_t* src = pg.data + row * pg.row_bytes;
  for (int r = 0; r < n; ++r, src += pg.row_bytes, dst += D) {
    switch (pg.fmt) {
      case Fmt::kF32:
        std::memcpy(dst, src, sizeof(float) * D);
        break;
      case Fmt::kBF16: {
        const uint16_t* x = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
        for (int e = 0; e < D; ++e) dst[e] = bf16_to_float(x[e]);
        break;
      }
      case Fmt::kF16: {
        const uint16_t* x = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
        for (int e = 0; e < D; ++e) dst[e] = small_float<15, 10, 15>(x[e]);
        break;
      }
      case Fmt::kI8: {
        const int8_t* x = reinterpret_cast<const int8_t*>(src);
        const float s = token_scale(pg, row + r);
#pragma omp simd
        for (int e = 0; e < D; ++e) dst[e] = float(x[e]) * s;
        break;
      }
      case Fmt::kI4: {  // byte j: channel j (low nibble), channel j + D / 2 (high)
        const float s = token_scale(pg, row + r), off = -7.5f * s;
        const int h = D / 2;
#pragma omp simd
        for (int j = 0; j < h; ++j) {
          dst[j] = float(src[j] & 15) * s + off;
          dst[j + h] = float(src[j] >> 4) * s + off;
        }
        break;
      }
      case Fmt::kE4M3:
#pragma omp simd
        for (int e = 0; e < D; ++e) dst[e] = small_float<7, 3, 7>(src[e]);
        break;
      case Fmt::kE5M2:
#pragma omp simd
        for (int e = 0; e < D; ++e) dst[e] = small_float<7, 2, 15>(src[e]);
        break;
    }
  }
}

void free_floats(float* p) { std::free(p); }
using Floats = std::unique_ptr<float[], decltype(&free_floats)>;

Floats alloc_floats(size_t n) {
  size_t bytes = (n * sizeof(float) + 63) / 64 * 64;
  return Floats(static_cast<float*>(std::aligned_alloc(64, bytes)), free_floats);
}

// Softmax step of one score row s[0:n) whose live keys are [lo, hi): folds
// it into the running max m and sum l, rescales the accumulator row and
// leaves P in s (zero outside [lo, hi)).
inline void softmax_row(float* s, int n, int lo, int hi, float cap, float* m, float* l,
                        float* acc, int D) {
  if (hi <= lo) {
    std::fill(s, s + n, 0.0f);
    return;
  }
  if (cap > 0.0f) {
    const float inv = 1.0f / cap;
#pragma omp simd
    for (int c = lo; c < hi; ++c) s[c] = cap - 2.0f * cap / (fast_exp(2.0f * inv * s[c]) + 1.0f);
  }
  // The max as explicit vectors: GCC keeps a float max reduction scalar
  // without -ffast-math.
  typedef float v16 __attribute__((vector_size(64)));
  v16 lanes = {};
  lanes -= INFINITY;
  int c = lo;
  for (; c + 16 <= hi; c += 16) {
    v16 x;
    std::memcpy(&x, s + c, sizeof(x));
    lanes = lanes > x ? lanes : x;
  }
  float mx = -INFINITY;
  for (; c < hi; ++c) mx = std::max(mx, s[c]);
  for (int k = 0; k < 16; ++k) mx = std::max(mx, lanes[k]);
  const float m_new = std::max(*m, mx);
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int c = lo; c < hi; ++c) {
    float p = fast_exp(s[c] - m_new);
    s[c] = p;
    sum += p;
  }
  std::fill(s, s + lo, 0.0f);
  std::fill(s + hi, s + n, 0.0f);
  const float alpha = std::exp(*m - m_new);  // 0 on the first live chunk (m = -inf)
  if (alpha != 1.0f) {
#pragma omp simd
    for (int d = 0; d < D; ++d) acc[d] *= alpha;
  }
  *l = *l * alpha + sum;
  *m = m_new;
}

// The online softmax's start for a row of head h: the running max and sum.
inline void start_row(const float* sinks, int h, float* m, float* l) {
  *m = sinks[h];
  *l = sinks[h] == -INFINITY ? 0.0f : 1.0f;  // exp(sink - m), without -inf - -inf
}

// Keys [k0, k0 + n) of sequence `seq`, KV head `kvh`, as float32 dst [n, D].
void gather_keys(const Pages& pg, const int32_t* table, const Dims& d, int kvh, int k0, int n,
                 float* dst) {
  const int64_t head = static_cast<int64_t>(kvh) * d.P * d.ps;
  for (int p = k0; p < k0 + n;) {
    const int slot = p % d.ps;
    const int run = std::min(d.ps - slot, k0 + n - p);
    convert_rows(pg, head + static_cast<int64_t>(table[p / d.ps]) * d.ps + slot, run, d.D,
                 dst + static_cast<int64_t>(p - k0) * d.D);
    p += run;
  }
}

struct Scratch {
  Floats q, k, v, s, acc, m, l, t;
  int ld_s;
  // R rows, K/V tiles of C keys, score rows of SC keys, a decode's page
  // tile of TR rows (dequantized pages).
  Scratch(int R, int C, int D, int SC, int TR)
      : q(alloc_floats(size_t(R) * D)), k(alloc_floats(size_t(std::max(C, 1)) * D)),
        v(alloc_floats(size_t(std::max(C, 1)) * D)), s(alloc_floats(size_t(R) * (SC + 16))),
        acc(alloc_floats(size_t(R) * D)), m(alloc_floats(R)), l(alloc_floats(R)),
        t(alloc_floats(size_t(std::max(TR, 1)) * D)), ld_s(SC + 16) {}
};

void run_task(const Task& t, const Dims& d, const float* q, const Pages& kp, const Pages& vp,
              const int32_t* tables, const float* sinks, int C, float scale, int window,
              float cap, Scratch& w, float* out) {
  const int G = d.G, D = d.D, R = t.rows * G;
  const int64_t row_stride = int64_t(d.H) * D;
  for (int i = 0; i < t.rows; ++i)
    for (int g = 0; g < G; ++g) {
      const float* src = q + (t.row0 + i) * row_stride + (t.kvh * G + g) * D;
      float* dst = w.q.get() + (i * G + g) * D;
      for (int e = 0; e < D; ++e) dst[e] = src[e] * scale;
    }
  std::fill(w.acc.get(), w.acc.get() + size_t(R) * D, 0.0f);
  for (int r = 0; r < R; ++r) start_row(sinks, t.kvh * G + r % G, w.m.get() + r, w.l.get() + r);
  const int32_t* table = tables + int64_t(t.seq) * d.W;
  const int last = t.pos0 + t.rows - 1;  // the newest key any row sees
  const int kstart = window > 0 ? std::max(0, t.pos0 - window + 1) : 0;
  // Keys before the first row (seen whole by most rows), then the diagonal,
  // each cut into even chunks of at most C keys.
  const int spans[2][2] = {{kstart, t.pos0}, {t.pos0, last + 1}};
  for (const auto& span : spans) {
    const int len = span[1] - span[0];
    if (len <= 0) continue;
    const int nch = (len + C - 1) / C, size = (len + nch - 1) / nch;
    for (int k0 = span[0]; k0 < span[1]; k0 += size) {
      const int n = std::min(size, span[1] - k0);
      gather_keys(kp, table, d, t.kvh, k0, n, w.k.get());
      gather_keys(vp, table, d, t.kvh, k0, n, w.v.get());
      jaxkv::sgemm(kRowMajor, kNoTrans, kTrans, R, n, D, 1.0f, w.q.get(), D, w.k.get(), D, 0.0f,
                  w.s.get(), w.ld_s);
      for (int r = 0; r < R; ++r) {
        const int pos = t.pos0 + r / G;
        const int hi = std::min(n, pos - k0 + 1);
        const int lo = window > 0 ? std::max(0, pos - window + 1 - k0) : 0;
        softmax_row(w.s.get() + int64_t(r) * w.ld_s, n, lo, hi, cap, w.m.get() + r,
                    w.l.get() + r, w.acc.get() + int64_t(r) * D, D);
      }
      jaxkv::sgemm(kRowMajor, kNoTrans, kNoTrans, R, D, n, 1.0f, w.s.get(), w.ld_s, w.v.get(), D,
                  1.0f, w.acc.get(), D);
    }
  }
  for (int i = 0; i < t.rows; ++i)
    for (int g = 0; g < G; ++g) {
      const int r = i * G + g;
      const float* a = w.acc.get() + int64_t(r) * D;
      const float l = w.l.get()[r];
      float* dst = out + (t.row0 + i) * row_stride + (t.kvh * G + g) * D;
      for (int e = 0; e < D; ++e) dst[e] = a[e] / l;
    }
}

typedef float v16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

inline float hsum16(v16 x) {
#ifdef __AVX512F__
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(x));
#else
  float r = 0.0f;
  for (int k = 0; k < 16; ++k) r += x[k];
  return r;
#endif
}

// Asks the cache for rows [row, row + n) of `pg`. A page is a few KB in one
// piece, but a sequence's next page lies anywhere in the pool, so the
// hardware prefetcher starts cold at every page; at serving batch sizes the
// pages of all layers are far larger than the caches and come from memory.
inline void prefetch_rows(const Pages& pg, int64_t row, int n) {
  const char* p = reinterpret_cast<const char*>(pg.data + row * pg.row_bytes);
  for (int64_t o = 0, bytes = n * pg.row_bytes; o < bytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}

// Walks the keys [k0, k1) of one sequence / KV head page by page, calling
// f(first key index, its float32 rows [run, D], run length): float32 pages
// in place, others dequantized into `tile` [page_size, D]. The next page's
// rows are prefetched before f runs on this one, and with `also` (the V
// pages, while the K pages are walked) this page's rows of `also`.
template <typename F>
inline void for_key_runs(const Pages& pg, int64_t head, const int32_t* table, int ps, int D,
                         int k0, int k1, float* tile, F&& f, const Pages* also = nullptr) {
  for (int p = k0; p < k1;) {
    const int slot = p % ps;
    const int run = std::min(ps - slot, k1 - p);
    const int64_t row = head + static_cast<int64_t>(table[p / ps]) * ps + slot;
    if (p + run < k1)
      prefetch_rows(pg, head + static_cast<int64_t>(table[(p + run) / ps]) * ps,
                    std::min(ps, k1 - p - run));
    if (also != nullptr) prefetch_rows(*also, row, run);
    if (pg.fmt == Fmt::kF32) {
      f(p, reinterpret_cast<const float*>(pg.data) + row * D, run);
    } else {
      convert_rows(pg, row, run, D, tile);
      f(p, tile, run);
    }
    p += run;
  }
}

typedef int32_t i16 __attribute__((vector_size(64)));

// Lanes lo and hi of two vectors side by side: each level halves the lanes
// that still hold parts of one sum.
inline v16 fold(v16 x, v16 y, i16 lo, i16 hi) {
  return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
}

// r[c] = the sum of a[c]'s 16 lanes, for 16 vectors at once (15 folds
// instead of 16 horizontal sums).
inline v16 sums16(v16 a[16]) {
  const i16 l1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const i16 h1 = l1 + 8;
  const i16 l2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const i16 h2 = l2 + 4;
  const i16 l3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const i16 h3 = l3 + 2;
  const i16 l4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const i16 h4 = l4 + 1;
  v16 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i) b[i] = fold(a[2 * i], a[2 * i + 1], l1, h1);
  for (int i = 0; i < 4; ++i) c[i] = fold(b[2 * i], b[2 * i + 1], l2, h2);
  for (int i = 0; i < 2; ++i) d[i] = fold(c[2 * i], c[2 * i + 1], l3, h3);
  return fold(d[0], d[1], l4, h4);
}

// s[c] = q . k_c for 16 key rows of NV * 16 floats.
template <int NV>
inline void scores16(const float* q, const float* k, float* s) {
  v16 qv[NV], a[16];
  for (int j = 0; j < NV; ++j) qv[j] = load16(q + 16 * j);
  for (int c = 0; c < 16; ++c) {
    const float* kr = k + int64_t(c) * NV * 16;
    a[c] = qv[0] * load16(kr);
    for (int j = 1; j < NV; ++j) a[c] += qv[j] * load16(kr + 16 * j);
  }
  const v16 r = sums16(a);
  std::memcpy(s, &r, sizeof(r));
}

// acc [NV * 16] += sum_c p[c] v[c] over `run` value rows of NV * 16 floats:
// the NV vectors of acc in registers, each key's NV FMAs independent (a key
// loop inside each 16-float slice waits on one FMA chain: 4x slower at D 64).
template <int NV>
inline void accumulate_values(const float* p, const float* v, int run, float* acc) {
  v16 a[NV];
  for (int j = 0; j < NV; ++j) a[j] = load16(acc + 16 * j);
  for (int c = 0; c < run; ++c) {
    const float pc = p[c];
    const float* vr = v + int64_t(c) * NV * 16;
    for (int j = 0; j < NV; ++j) a[j] += pc * load16(vr + 16 * j);
  }
  for (int j = 0; j < NV; ++j) std::memcpy(acc + 16 * j, &a[j], sizeof(v16));
}

// One decode row (sequence t.seq's query at position kv_len - 1, row t.row0)
// for KV head t.kvh: its G heads against the keys in the window, read in place.
void run_decode(const Task& t, const Dims& d, const float* q, const Pages& kp, const Pages& vp,
                const int32_t* tables, const float* sinks, int C, float scale, int window,
                float cap, Scratch& w, float* out) {
  const int G = d.G, D = d.D;
  const bool vec = D % 16 == 0;  // whole 16-float vectors per key row
  const int64_t row_stride = int64_t(d.H) * D;
  const int kv_len = t.pos0 + 1;
  const int kstart = window > 0 ? std::max(0, kv_len - window) : 0;
  float* qs = w.q.get();
  float* acc = w.acc.get();
  for (int g = 0; g < G; ++g) {
    const float* src = q + t.row0 * row_stride + (t.kvh * G + g) * D;
#pragma omp simd
    for (int e = 0; e < D; ++e) qs[g * D + e] = src[e] * scale;
  }
  std::fill(acc, acc + size_t(G) * D, 0.0f);
  for (int g = 0; g < G; ++g) start_row(sinks, t.kvh * G + g, w.m.get() + g, w.l.get() + g);
  const int32_t* table = tables + int64_t(t.seq) * d.W;
  const int64_t head = static_cast<int64_t>(t.kvh) * d.P * d.ps;  // the head's first row
  const int len = kv_len - kstart;
  const int nch = (len + C - 1) / C, size = (len + nch - 1) / nch;
  for (int k0 = kstart; k0 < kv_len; k0 += size) {
    const int k1 = std::min(kv_len, k0 + size), n = k1 - k0;
    // Scores s[g, c] = q_g . k_c.
    for_key_runs(kp, head, table, d.ps, D, k0, k1, w.t.get(), [&](int p, const float* k, int run) {
      for (int g = 0; g < G; ++g) {
        const float* qg = qs + g * D;
        float* sg = w.s.get() + int64_t(g) * w.ld_s + (p - k0);
        if (run == 16 && (D == 64 || D == 128)) {
          if (D == 64)
            scores16<4>(qg, k, sg);
          else
            scores16<8>(qg, k, sg);
        } else if (vec) {
          for (int c = 0; c < run; ++c) {
            const float* kr = k + int64_t(c) * D;
            v16 a = load16(qg) * load16(kr);
            for (int j = 16; j < D; j += 16) a += load16(qg + j) * load16(kr + j);
            sg[c] = hsum16(a);
          }
        } else {
          for (int c = 0; c < run; ++c) {
            const float* kr = k + int64_t(c) * D;
            float dot = 0.0f;
            for (int e = 0; e < D; ++e) dot += qg[e] * kr[e];
            sg[c] = dot;
          }
        }
      }
    }, &vp);
    for (int g = 0; g < G; ++g)
      softmax_row(w.s.get() + int64_t(g) * w.ld_s, n, 0, n, cap, w.m.get() + g, w.l.get() + g,
                  acc + int64_t(g) * D, D);
    // acc[g] += sum_c p[g, c] v_c, 16 lanes of acc[g] kept in a register
    // across the page's keys.
    for_key_runs(vp, head, table, d.ps, D, k0, k1, w.t.get(), [&](int p, const float* v, int run) {
      for (int g = 0; g < G; ++g) {
        const float* pg = w.s.get() + int64_t(g) * w.ld_s + (p - k0);
        float* ag = acc + int64_t(g) * D;
        if (D == 64) {
          accumulate_values<4>(pg, v, run, ag);
        } else if (D == 128) {
          accumulate_values<8>(pg, v, run, ag);
        } else if (vec) {
          for (int j = 0; j < D; j += 16) {
            v16 a = load16(ag + j);
            for (int c = 0; c < run; ++c) a += pg[c] * load16(v + int64_t(c) * D + j);
            std::memcpy(ag + j, &a, sizeof(a));
          }
        } else {
          for (int c = 0; c < run; ++c)
            for (int e = 0; e < D; ++e) ag[e] += pg[c] * v[int64_t(c) * D + e];
        }
      }
    });
  }
  for (int g = 0; g < G; ++g) {
    const float inv = 1.0f / w.l.get()[g];
    float* dst = out + t.row0 * row_stride + (t.kvh * G + g) * D;
    const float* a = acc + int64_t(g) * D;
#pragma omp simd
    for (int e = 0; e < D; ++e) dst[e] = a[e] * inv;
  }
}

ffi::Error invalid(const char* name, const char* msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, std::string(name) + ": " + msg);
}

// Rows of sequences with q_len > 1, and with `decodes` those with q_len == 1;
// every other row of out is zero.
ffi::Error Attend(const char* name, bool decodes, ffi::Buffer<ffi::F32> q,
                  ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages, ffi::AnyBuffer k_scale,
                  ffi::AnyBuffer v_scale, ffi::Buffer<ffi::S32> kv_lens,
                  ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> cu_q_lens,
                  ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::F32> sinks, float sm_scale,
                  int32_t sliding_window, float soft_cap, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k_pages.dimensions(), vd = v_pages.dimensions();
  auto bd = block_tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || vd.size() != 4 || bd.size() != 2 ||
      kv_lens.dimensions().size() != 1 || cu_q_lens.dimensions().size() != 1 ||
      num_seqs.dimensions().size() != 0)
    return invalid(name, "wrong ranks");
  Dims d{int(qd[0]), int(qd[1]), int(qd[2]), int(kd[0]), int(kd[1]), int(kd[2]),
         int(bd[0]), int(bd[1]), 0};
  if (k_pages.element_type() != v_pages.element_type() ||
      !std::equal(kd.begin(), kd.end(), vd.begin()))
    return invalid(name, "k_pages and v_pages must have one dtype and shape");
  Fmt fmt;
  int row_elems = d.D, elem_bytes = 1;
  switch (k_pages.element_type()) {
    case ffi::DataType::F32: fmt = Fmt::kF32; elem_bytes = 4; break;
    case ffi::DataType::BF16: fmt = Fmt::kBF16; elem_bytes = 2; break;
    case ffi::DataType::F16: fmt = Fmt::kF16; elem_bytes = 2; break;
    case ffi::DataType::S8: fmt = Fmt::kI8; break;
    case ffi::DataType::U8: fmt = Fmt::kI4; row_elems = d.D / 2; break;
    case ffi::DataType::F8E4M3FN: fmt = Fmt::kE4M3; break;
    case ffi::DataType::F8E5M2: fmt = Fmt::kE5M2; break;
    default: return invalid(name, "unsupported page dtype");
  }
  if (kd[3] != row_elems || (fmt == Fmt::kI4 && d.D % 2))
    return invalid(name, "pages must be [KVH, P, page_size, D] ([.., D / 2] bytes for int4)");
  const bool scaled = fmt == Fmt::kI8 || fmt == Fmt::kI4;
  auto ksd = k_scale.dimensions(), vsd = v_scale.dimensions();
  const bool scale_bf16 = k_scale.element_type() == ffi::DataType::BF16;
  if (scaled) {
    if (ksd.size() != 3 || !std::equal(ksd.begin(), ksd.end(), kd.begin()) ||
        !std::equal(vsd.begin(), vsd.end(), ksd.begin(), ksd.end()) ||
        k_scale.element_type() != v_scale.element_type() ||
        (!scale_bf16 && k_scale.element_type() != ffi::DataType::F32))
      return invalid(name, "int8 / int4 pages need k_scale, v_scale [KVH, P, page_size] "
                           "float32 or bfloat16");
  } else if (k_scale.element_count() != 0 || v_scale.element_count() != 0) {
    return invalid(name, "k_scale / v_scale come with int8 or int4 pages only");
  }
  const int64_t row_bytes = int64_t(row_elems) * elem_bytes;
  const Pages kp{static_cast<const uint8_t*>(k_pages.untyped_data()),
                 static_cast<const uint8_t*>(k_scale.untyped_data()), fmt, scale_bf16, row_bytes};
  const Pages vp{static_cast<const uint8_t*>(v_pages.untyped_data()),
                 static_cast<const uint8_t*>(v_scale.untyped_data()), fmt, scale_bf16, row_bytes};
  if (d.KVH <= 0 || d.H % d.KVH != 0) return invalid(name, "H % KVH != 0");
  if (sinks.dimensions().size() != 1 || sinks.dimensions()[0] != d.H)
    return invalid(name, "sinks must be [H]");
  if (kv_lens.dimensions()[0] != d.S || cu_q_lens.dimensions()[0] != d.S + 1)
    return invalid(name, "kv_lens must be [S], cu_q_lens [S + 1]");
  auto od = out->dimensions();
  if (!std::equal(od.begin(), od.end(), qd.begin(), qd.end()))
    return invalid(name, "out must be [T, H, D]");
  d.G = d.H / d.KVH;
  const int32_t* kv = kv_lens.typed_data();
  const int32_t* cu = cu_q_lens.typed_data();
  const int32_t* bt = block_tables.typed_data();
  const int S = std::clamp(num_seqs.typed_data()[0], 0, d.S);
  const int bq = std::max(16, (kTargetRows / d.G + 15) / 16 * 16);
  const int C = kKeyChunk;

  std::vector<Task> tasks;
  std::vector<char> served(d.T, 0);
  int num_decodes = 0;
  for (int s = 0; s < S; ++s) {
    const int q_len = cu[s + 1] - cu[s];
    const bool decode = decodes && q_len == 1 && kv[s] > 0;  // kv_len 0: nothing to see
    if (q_len <= 1 && !decode) continue;
    if (cu[s] < 0 || cu[s + 1] > d.T || q_len > kv[s] || kv[s] > int64_t(d.W) * d.ps)
      return invalid(name, "cu_q_lens / kv_lens out of range");
    for (int j = 0; j < (kv[s] + d.ps - 1) / d.ps; ++j)
      if (bt[int64_t(s) * d.W + j] < 0 || bt[int64_t(s) * d.W + j] >= d.P)
        return invalid(name, "block_tables entry out of range");
    std::fill(served.begin() + cu[s], served.begin() + cu[s + 1], 1);
    if (decode) {
      const int keys = sliding_window > 0 ? std::min(kv[s], sliding_window) : kv[s];
      for (int h = 0; h < d.KVH; ++h)
        tasks.push_back({s, cu[s], 0, kv[s] - 1, h, int64_t(kDecodeWeight) * keys});
      ++num_decodes;
      continue;
    }
    for (int b = 0; b < q_len; b += bq) {
      const int rows = std::min(bq, q_len - b), pos0 = kv[s] - q_len + b;
      const int kstart = sliding_window > 0 ? std::max(0, pos0 - sliding_window + 1) : 0;
      for (int h = 0; h < d.KVH; ++h)
        tasks.push_back({s, cu[s] + b, rows, pos0, h, int64_t(rows) * (pos0 + rows - kstart)});
    }
  }
  double work_ns = 0.0;
  for (const Task& t : tasks) work_ns += 4.0 * d.G * d.D * double(t.cost) / 60.0;
  std::stable_sort(tasks.begin(), tasks.end(),
                   [](const Task& a, const Task& b) { return a.cost > b.cost; });

  float* o = out->typed_data();
  const int64_t row_size = int64_t(d.H) * d.D;
  for (int t = 0; t < d.T; ++t)
    if (!served[t]) std::fill(o + t * row_size, o + (t + 1) * row_size, 0.0f);
  const int num_tasks = int(tasks.size());
  if (num_tasks == 0) return ffi::Error::Success();
  const float cap = soft_cap > 0.0f ? soft_cap : 0.0f;
  const int threads = std::clamp(int(work_ns / kNsPerThread), 1,
                                 std::max(1, std::min(jaxkv::pool_threads(), num_tasks)));
  // Decodes need G rows of scratch and no K/V tiles.
  const bool prefills = num_tasks > num_decodes * d.KVH;
  std::vector<std::unique_ptr<Scratch>> scratch(threads);
  jaxkv::parallel_for(num_tasks, threads, [&](int i, int thread) {
    if (!scratch[thread])
      scratch[thread] = std::make_unique<Scratch>(prefills ? bq * d.G : d.G, prefills ? C : 0, d.D,
                                                  C, fmt == Fmt::kF32 ? 0 : d.ps);
    Scratch& w = *scratch[thread];
    const int prev = jaxkv::blas_threads_local(1);
    const Task& t = tasks[i];
    if (t.rows == 0)
      run_decode(t, d, q.typed_data(), kp, vp, bt, sinks.typed_data(), C, sm_scale,
                 sliding_window, cap, w, o);
    else
      run_task(t, d, q.typed_data(), kp, vp, bt, sinks.typed_data(), C, sm_scale,
               sliding_window, cap, w, o);
    jaxkv::blas_threads_local(prev);
  }, kSpinUs);
  return ffi::Error::Success();
}

// The two FFI handlers: rpa_dense_prefill (rows of sequences with q_len > 1
// only; the rest stay zero) and rpa_ragged (every live row, decodes too).
template <bool kDecodes>
ffi::Error Handler(ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k_pages, ffi::AnyBuffer v_pages,
                   ffi::AnyBuffer k_scale, ffi::AnyBuffer v_scale, ffi::Buffer<ffi::S32> kv_lens,
                   ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> cu_q_lens,
                   ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::F32> sinks, float sm_scale,
                   int32_t sliding_window, float soft_cap, ffi::ResultBuffer<ffi::F32> out) {
  return Attend(kDecodes ? "rpa_ragged" : "rpa_dense_prefill", kDecodes, q, k_pages, v_pages,
                k_scale, v_scale, kv_lens, block_tables, cu_q_lens, num_seqs, sinks, sm_scale,
                sliding_window, soft_cap, out);
}

}  // namespace

// Both handlers take the same arguments and attributes.
#define JAXKV_RPA_BINDING                                                              \
  ffi::Ffi::Bind()                                                                     \
      .Arg<ffi::Buffer<ffi::F32>>() /* q [T, H, D] */                                  \
      .Arg<ffi::AnyBuffer>() /* k_pages [KVH, P, page_size, D] (kv_formats) */          \
      .Arg<ffi::AnyBuffer>() /* v_pages */                                             \
      .Arg<ffi::AnyBuffer>() /* k_scale [KVH, P, page_size] (int8 / int4), else [0] */  \
      .Arg<ffi::AnyBuffer>() /* v_scale */                                             \
      .Arg<ffi::Buffer<ffi::S32>>() /* kv_lens [S] */                                  \
      .Arg<ffi::Buffer<ffi::S32>>() /* block_tables [S, W] */                          \
      .Arg<ffi::Buffer<ffi::S32>>() /* cu_q_lens [S + 1] */                            \
      .Arg<ffi::Buffer<ffi::S32>>() /* num_seqs [] */                                  \
      .Arg<ffi::Buffer<ffi::F32>>() /* sinks [H] (-inf: none) */                       \
      .Attr<float>("sm_scale")                                                         \
      .Attr<int32_t>("sliding_window")                                                 \
      .Attr<float>("soft_cap")                                                         \
      .Ret<ffi::Buffer<ffi::F32>>() /* out [T, H, D] */

XLA_FFI_DEFINE_HANDLER_SYMBOL(rpa_dense_prefill, Handler<false>, JAXKV_RPA_BINDING);
XLA_FFI_DEFINE_HANDLER_SYMBOL(rpa_ragged, Handler<true>, JAXKV_RPA_BINDING);
