// Paged attention for the CPU, reading K/V straight from the block-table cache.
//
// Cache layout (one layer), fixed by the model runner:
//
//   k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim], contiguous
//   token at position p of request r -> block block_table[r][p / block_size],
//                                       row p % block_size of that block's head slab
//
// Varlen causal attention: request r owns query rows q[qsl[r] : qsl[r+1]]; they are the last
// n_r positions of its context of seq_lens[r] tokens, so query row j (0-based within r) sees
// positions 0 .. seq_lens[r] - n_r + j. Decodes (n_r = 1), chunked prefills with a cached
// prefix and fresh prefills are all the same case, so one call serves a mixed batch.
//
// Work is split into items (request, kv head, tile of query positions). A tile holds the
// query heads of one GQA group for up to tile_q consecutive positions, i.e.
// rows = tile_q * group_size (~64) rows, so every K/V row loaded serves all heads of its
// group and, in a prefill, ~64 query rows. Per chunk of 16 tokens:
//
//   S[rows, 16]  = Q[rows, hd] . K^T             scores, scaled
//   online softmax per row, fp32: m' = max(m, max S), P = exp(S - m'), l = l e^(m-m') + sum P
//   O[rows, hd]  = O e^(m-m') + P[rows, 16] . V[16, hd]
//
// Two QK microkernels: tiles with many rows stage the chunk's K transposed (fp32) and run
// a rows x 16 outer-product loop (K reused from L1 by every row); tiles with <= 8 rows
// (decodes) take 16 dot products and reduce them together, reading K in place (bf16 via
// vdpbf16ps where the CPU has AVX512-BF16, so no conversion at all). PV reads V rows in
// place and widens bf16 in registers. Nothing is gathered: K/V are read once, from their
// blocks.
//
// Items are sorted by cost (rows x context) and handed out dynamically from an atomic
// counter inside torch's intra-op pool (at::parallel_for), so a long prefill tile cannot
// leave the other thread idle at the end.
//
// One-byte caches (int8, fp8 e4m3) hold codes and a float32 scale per (block, kv head) in
// k_scale / v_scale [num_blocks, num_kv_heads] (runner/kv_quantization.py): a K/V row is
// widened to fp32 and multiplied by its block's scale as it is staged (K into the Kt
// scratch, V into the V scratch), so both microkernels run unchanged on fp32 rows. The
// float32/bfloat16 caches take exactly the code they took before (the cache type is a
// template parameter; same-type caches compile to the old paths). write_kv quantizes the
// new tokens per block run: the scale grows to cover them and the codes already in the
// block are requantized to it (fp8 scales are powers of two, so that is exact).
//
// Vectors use GCC vector extensions (16 x fp32 = one AVX-512 register with -march=native,
// split into narrower registers elsewhere), with AVX-512 intrinsics only behind #if for
// the bf16 paths, so the file builds on any gcc/clang target.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 16;      // fp32 lanes per vector, and K/V tokens per chunk
constexpr int kMaxVectors = 16; // head_dim <= 256
constexpr int kTargetRows = 64; // query rows per tile (positions x group heads)

typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));
typedef uint32_t vu __attribute__((vector_size(64)));
typedef uint16_t vh __attribute__((vector_size(32)));
typedef float vf_u __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint16_t vh_u __attribute__((vector_size(32), aligned(2), may_alias));

using bf16 = at::BFloat16;
using fp8 = c10::Float8_e4m3fn;

// Caches of one-byte codes (with per-block scales) vs values of the query's own type.
template <typename TC>
constexpr bool kIsCode = std::is_same_v<TC, int8_t> || std::is_same_v<TC, fp8>;

inline vf splat(float x) { return vf{} + x; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline vf vmin(vf a, vf b) { return a < b ? a : b; }

// ---------------------------------------------------------------- loads / stores
inline vf load(const float* p) { return *reinterpret_cast<const vf_u*>(p); }

inline vf load(const bf16* p) {
  // bf16 is the top half of an fp32: widen and shift. (gcc splits the generic widening
  // into two 256-bit halves, hence the intrinsic where AVX-512 is there.)
#if defined(__AVX512F__)
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#else
  vh h = *reinterpret_cast<const vh_u*>(p);
  vu w = __builtin_convertvector(h, vu) << 16;
  return reinterpret_cast<vf&>(w);
#endif
}

// 16 one-byte codes -> fp32, times kCodeUnit<TC> (the caller folds the unit into the scale).
// fp8 e4m3 -> fp16 bits by moving sign, exponent and mantissa into place (the fp16 exponent
// bias is 8 larger, so the value comes out 2^-8 times the code, subnormals included), then
// the hardware's fp16 -> fp32 conversion.
#if defined(__AVX512F__)
template <typename TC>
constexpr float kCodeUnit = std::is_same_v<TC, fp8> ? 256.0f : 1.0f;

inline vf load_code(const int8_t* p) {
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline vf load_code(const fp8* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7f)), 7));
  return (vf)_mm512_cvtph_ps(h);
}
#else
template <typename TC>
constexpr float kCodeUnit = 1.0f;

template <typename TC>
inline vf load_code(const TC* p) {
  alignas(64) float tmp[kLanes];
  for (int i = 0; i < kLanes; ++i) tmp[i] = static_cast<float>(p[i]);
  return *reinterpret_cast<const vf*>(tmp);
}
#endif

inline void store(float* p, vf x) { *reinterpret_cast<vf_u*>(p) = x; }

inline void store(bf16* p, vf x) {
  // Round to nearest even; NaN stays a quiet NaN.
  vu u = reinterpret_cast<vu&>(x);
  vu r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  r = (x != x) ? (vu{} + 0x7fc0u) : r;
  *reinterpret_cast<vh_u*>(p) = __builtin_convertvector(r, vh);
}

// Vectors past head_dim (n < 16 valid lanes, possibly none) read as zeros.
template <typename T>
inline vf load_n(const T* p, int n) {
  if (n >= kLanes) return load(p);
  alignas(64) float tmp[kLanes] = {};
  for (int i = 0; i < n; ++i) tmp[i] = static_cast<float>(p[i]);
  return load(tmp);
}

// A row's vector of a cache of type TC as fp32: values load as they are, codes times their
// block's scale (already times kCodeUnit<TC>).
template <typename TC>
inline vf load_row(const TC* p, int n, float row_scale) {
  if constexpr (kIsCode<TC>) {
    if (n >= kLanes) return load_code(p) * row_scale;
    alignas(64) float tmp[kLanes] = {};
    for (int i = 0; i < n; ++i) tmp[i] = static_cast<float>(p[i]) * (row_scale / kCodeUnit<TC>);
    return load(tmp);
  } else {
    (void)row_scale;
    return load_n(p, n);
  }
}

template <typename T>
inline void store_n(T* p, vf x, int n) {
  if (n >= kLanes) return store(p, x);
  for (int i = 0; i < n; ++i) p[i] = static_cast<T>(x[i]);
}

// ---------------------------------------------------------------- lane math
inline float hsum(vf v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

inline float hmax(vf v) {
  v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}

// exp(x) for x <= 0 (Cephes expf): x = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-6
// polynomial, 2^n built in the exponent bits. Relative error ~2 ulp.
inline vf vexp(vf x) {
  x = vmax(vmin(x, splat(88.0f)), splat(-87.0f));
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  vf n = (x * splat(1.44269504088896341f) + magic) - magic;
  vf r = x - n * splat(0.693359375f) + n * splat(2.12194440e-4f);
  vf p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  p = p * r * r + r + splat(1.0f);
  vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  return p * reinterpret_cast<vf&>(e);
}

// out[t] = sum of the lanes of acc[t], for 16 accumulators at once: the shuffles of a
// 16x16 transpose, adding the two halves at each level instead of keeping both. The lanes
// come out in bit-reversed order, so the caller fills acc[i] with token kBitrev[i].
constexpr int kBitrev[kLanes] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

inline vf reduce16(vf a[kLanes]) {
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
    a[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)
    a[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  return __builtin_shufflevector(a[0], a[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(a[0], a[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

// In-place 16x16 transpose: swap the off-diagonal blocks of size 8, 4, 2, 1.
inline void transpose16(vf r[kLanes]) {
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    vf a = r[i], b = r[i + 8];
    r[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    r[i + 8] = __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
#pragma GCC unroll 16
  for (int i = 0; i < kLanes; ++i) {
    if (i & 4) continue;
    vf a = r[i], b = r[i + 4];
    r[i] = __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    r[i + 4] = __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  }
#pragma GCC unroll 16
  for (int i = 0; i < kLanes; ++i) {
    if (i & 2) continue;
    vf a = r[i], b = r[i + 2];
    r[i] = __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
    r[i + 2] = __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  }
#pragma GCC unroll 16
  for (int i = 0; i < kLanes; i += 2) {
    vf a = r[i], b = r[i + 1];
    r[i] = __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
    r[i + 1] = __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  }
}

#if defined(__AVX512BF16__)
// qk_dot for bf16 rows read straight from q and the cache, no conversion: vdpbf16ps
// multiplies 32 bf16 pairs and adds adjacent products into 16 fp32 lanes.
constexpr bool kHaveBf16Dot = true;

template <int NV>
inline void qk_dot_bf16(const bf16* q, const bf16* const* krow, float scale, float* s) {
  static_assert(NV % 2 == 0, "pairs of 16-lane vectors");
  __m512bh qv[NV / 2];
#pragma GCC unroll 8
  for (int j = 0; j < NV / 2; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(q + 32 * j);
  vf acc[kLanes];
#pragma GCC unroll 16
  for (int i = 0; i < kLanes; ++i) {
    const bf16* k = krow[kBitrev[i]];
    __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int j = 0; j < NV / 2; ++j) a = _mm512_dpbf16_ps(a, qv[j], (__m512bh)_mm512_loadu_si512(k + 32 * j));
    acc[i] = (vf)a;
  }
  store(s, reduce16(acc) * scale);
}
#else
constexpr bool kHaveBf16Dot = false;

template <int NV>
inline void qk_dot_bf16(const bf16*, const bf16* const*, float, float*) {}
#endif

// ---------------------------------------------------------------- the problem
struct Problem {
  int num_heads, num_kv_heads, group, head_dim, block_size, block_shift, max_blocks;
  float scale;
  int64_t q_stride_t, q_stride_h, out_stride_t, out_stride_h;
  int64_t cache_stride_block, cache_stride_head;
  // [num_blocks, num_kv_heads] scales of one-byte caches; null otherwise.
  const float* k_scale;
  const float* v_scale;
  const int32_t* block_table;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
};

// Per-thread scratch, fp32, D = padded head_dim (multiple of 16).
struct Scratch {
  std::vector<float> q, o, p, kt, v, m, l, corr;
  Scratch(int max_rows, int dp)
      : q(size_t(max_rows) * dp), o(size_t(max_rows) * dp), p(size_t(max_rows) * kLanes),
        kt(size_t(dp) * kLanes), v(size_t(kLanes) * dp), m(max_rows), l(max_rows), corr(max_rows) {}
};

// S[row..row+RB) = Q[row..] . Kt (one 16-token score vector per row), from transposed K.
// U independent partial sums per row keep >= 8 FMAs in flight; the zero padding of Q and
// Kt past head_dim lets d run to a multiple of U.
template <int RB>
inline void qk_rows(const float* q, const float* kt, float* s, int dp, int hd) {
  constexpr int U = RB >= 8 ? 1 : 8 / RB;
  vf acc[RB][U];
#pragma GCC unroll 8
  for (int b = 0; b < RB; ++b)
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) acc[b][u] = vf{};
  const int d_end = (hd + U - 1) / U * U;
  for (int d = 0; d < d_end; d += U) {
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) {
      vf k = load(kt + (d + u) * kLanes);
#pragma GCC unroll 8
      for (int b = 0; b < RB; ++b) acc[b][u] += q[b * dp + d + u] * k;
    }
  }
#pragma GCC unroll 8
  for (int b = 0; b < RB; ++b) {
    vf sum = acc[b][0];
#pragma GCC unroll 8
    for (int u = 1; u < U; ++u) sum += acc[b][u];
    store(s + b * kLanes, sum);
  }
}

// S[row] = Q[row] . K for a few rows, from untransposed K rows (k + t * k_stride): 16 dot
// products reduced together. Cheaper than transposing K when the tile has few rows.
template <int NV>
inline void qk_dot(const float* q, const float* k, int64_t k_stride, float* s) {
  vf qv[NV];
#pragma GCC unroll 16
  for (int j = 0; j < NV; ++j) qv[j] = load(q + j * kLanes);
  vf acc[kLanes];
#pragma GCC unroll 16
  for (int i = 0; i < kLanes; ++i) {
    const float* kt = k + kBitrev[i] * k_stride;
    vf a = qv[0] * load(kt);
#pragma GCC unroll 16
    for (int j = 1; j < NV; ++j) a += qv[j] * load(kt + j * kLanes);
    acc[i] = a;
  }
  store(s, reduce16(acc));
}

// O[row..row+RB) = O * corr + P . V over the chunk's n_tok tokens; vrow[t] is token t's
// V row (fp32 or bf16, widened in registers), read once for all RB rows.
template <int NV, int RB, typename TV>
inline void pv_rows(float* o, const float* p, const float* corr, const TV* const* vrow,
                    int n_tok, int dp) {
  vf acc[RB][NV];
#pragma GCC unroll 4
  for (int b = 0; b < RB; ++b) {
    vf c = splat(corr[b]);
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) acc[b][j] = load(o + b * dp + j * kLanes) * c;
  }
  for (int t = 0; t < n_tok; ++t) {
    const TV* vt = vrow[t];
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) {
      vf x = load(vt + j * kLanes);
#pragma GCC unroll 4
      for (int b = 0; b < RB; ++b) acc[b][j] += p[b * kLanes + t] * x;
    }
  }
#pragma GCC unroll 4
  for (int b = 0; b < RB; ++b) {
#pragma GCC unroll 16
    for (int j = 0; j < NV; ++j) store(o + b * dp + j * kLanes, acc[b][j]);
  }
}

// Rows per PV register block: RB x NV accumulators must fit in 32 registers with room
// for the V row.
template <int NV>
constexpr int pv_block() { return NV <= 6 ? 4 : (NV <= 8 ? 2 : 1); }

template <int NV, int RB, typename TV>
inline void pv_block_rows(float* o, const float* p, const float* corr, const TV* const* vrow,
                          int n_tok, int dp, int begin, int end) {
  int row = begin;
  for (; row + RB <= end; row += RB)
    pv_rows<NV, RB>(o + row * dp, p + row * kLanes, corr + row, vrow, n_tok, dp);
  // The remainder (< RB <= 4 rows) in one block, so V is read once more, not per row.
  auto tail = [&](auto rb) {
    pv_rows<NV, decltype(rb)::value>(o + row * dp, p + row * kLanes, corr + row, vrow, n_tok, dp);
  };
  switch (end - row) {
    case 3: if constexpr (RB > 3) tail(std::integral_constant<int, 3>{}); break;
    case 2: if constexpr (RB > 2) tail(std::integral_constant<int, 2>{}); break;
    case 1: if constexpr (RB > 1) tail(std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

template <typename T, typename TC, int NV>
void attend_tile(const Problem& pb, const T* q_ptr, const TC* k_cache, const TC* v_cache, T* out,
                 int req, int kv_head, int j0, int j1, Scratch& s) {
  constexpr bool kCode = kIsCode<TC>;
  static_assert(kCode || std::is_same_v<T, TC>, "a cache holds the query's dtype or codes");
  constexpr int D = NV * kLanes;
  const int G = pb.group, hd = pb.head_dim;
  auto lanes = [hd](int j) { return std::clamp(hd - j * kLanes, 0, kLanes); };  // valid in vector j
  const int q_begin = pb.query_start_loc[req];
  const int n_r = pb.query_start_loc[req + 1] - q_begin;
  const int ctx0 = pb.seq_lens[req] - n_r;  // position of query row 0
  const int pos_first = ctx0 + j0, pos_last = ctx0 + j1 - 1;
  const int rows = (j1 - j0) * G;
  // Few rows (decodes): dot products beat transposing each K chunk.
  const bool dot = NV <= 8 && rows <= 8;
  const bool bf16_dot = std::is_same_v<TC, bf16> && kHaveBf16Dot && dot && NV % 2 == 0 && hd == D;
  const int32_t* bt = pb.block_table + int64_t(req) * pb.max_blocks;
  float* Q = s.q.data();
  float* O = s.o.data();
  float* P = s.p.data();
  float* Kt = s.kt.data();
  float* M = s.m.data();
  float* L = s.l.data();
  float* C = s.corr.data();

  // Q rows (position-major, group heads inner), pre-scaled; pad lanes are zero.
  const vf scale = splat(pb.scale);
  for (int jj = 0; jj < j1 - j0; ++jj) {
    for (int h = 0; h < G; ++h) {
      const T* src = q_ptr + int64_t(q_begin + j0 + jj) * pb.q_stride_t +
                     int64_t(kv_head * G + h) * pb.q_stride_h;
      float* dst = Q + (jj * G + h) * D;
      for (int j = 0; j < NV; ++j) {
        store(dst + j * kLanes, load_n(src + j * kLanes, lanes(j)) * scale);
        store(O + (jj * G + h) * D + j * kLanes, vf{});
      }
    }
  }
  std::fill(M, M + rows, -std::numeric_limits<float>::infinity());
  std::fill(L, L + rows, 0.0f);

  const vi lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const vf neg_inf = splat(-std::numeric_limits<float>::infinity());
  const int64_t head_off = int64_t(kv_head) * pb.cache_stride_head;
  const TC* krow[kLanes];
  const TC* vrow[kLanes];
  float kscale[kLanes] = {}, vscale[kLanes] = {};  // codes only: each row's block scale

  for (int c0 = 0; c0 <= pos_last; c0 += kLanes) {
    const int n_tok = std::min(kLanes, pos_last + 1 - c0);
    for (int t = 0; t < n_tok; ++t) {
      const int p = c0 + t;
      const int64_t block = bt[p >> pb.block_shift];
      const int64_t off = block * pb.cache_stride_block + head_off + int64_t(p & (pb.block_size - 1)) * hd;
      krow[t] = k_cache + off;
      vrow[t] = v_cache + off;
      if constexpr (kCode) {
        kscale[t] = pb.k_scale[block * pb.num_kv_heads + kv_head] * kCodeUnit<TC>;
        vscale[t] = pb.v_scale[block * pb.num_kv_heads + kv_head] * kCodeUnit<TC>;
      }
    }
    // Prefetch the next chunk's K/V rows: its block is anywhere in the cache, so the
    // hardware prefetcher loses the stream at every block boundary.
    for (int t = 0, pn = c0 + kLanes; t < kLanes && pn + t <= pos_last; ++t) {
      const int p = pn + t;
      const int64_t off = int64_t(bt[p >> pb.block_shift]) * pb.cache_stride_block + head_off +
                          int64_t(p & (pb.block_size - 1)) * hd;
      const char* kp = reinterpret_cast<const char*>(k_cache + off);
      const char* vp = reinterpret_cast<const char*>(v_cache + off);
      for (int b = 0; b < hd * int(sizeof(TC)); b += 64) {
        __builtin_prefetch(kp + b);
        __builtin_prefetch(vp + b);
      }
    }
    // Rows of a partial chunk past n_tok repeat a real row: finite values, masked below.
    for (int t = n_tok; t < kLanes; ++t) {
      krow[t] = krow[0];
      kscale[t] = kscale[0];
    }
    // Stage K: transposed (Kt[d][t]) for the outer-product microkernel, or as fp32 rows for
    // the dot-product one (read in place when already fp32 and contiguous).
    const float* Krows = Kt;
    int64_t k_stride = D;
    if (bf16_dot) {
      // K is read in place by qk_dot_bf16.
    } else if (dot) {
      bool in_place = false;
      if constexpr (std::is_same_v<TC, float>) {
        in_place = hd == D && pb.block_size >= kLanes;
        if (in_place) {
          Krows = krow[0];
          k_stride = hd;
        }
      }
      if (!in_place)
        for (int t = 0; t < kLanes; ++t)
          for (int j = 0; j < NV; ++j)
            store(Kt + t * D + j * kLanes, load_row(krow[t] + j * kLanes, lanes(j), kscale[t]));
    } else {
      for (int j = 0; j < NV; ++j) {
        vf r[kLanes];
#pragma GCC unroll 16
        for (int t = 0; t < kLanes; ++t)
          r[t] = t < n_tok ? load_row(krow[t] + j * kLanes, lanes(j), kscale[t]) : vf{};
        transpose16(r);
#pragma GCC unroll 16
        for (int i = 0; i < kLanes; ++i) store(Kt + (j * kLanes + i) * kLanes, r[i]);
      }
    }
    // V rows are read in place unless head_dim is padded or they are codes: then staged as
    // fp32 (dequantized, with zero lanes past head_dim), so no vector reads past a row's end.
    const float* vstaged[kLanes];
    const bool stage_v = kCode || hd != D;
    if (stage_v) {
      for (int t = 0; t < n_tok; ++t) {
        for (int j = 0; j < NV; ++j)
          store(s.v.data() + t * D + j * kLanes, load_row(vrow[t] + j * kLanes, lanes(j), vscale[t]));
        vstaged[t] = s.v.data() + t * D;
      }
    }

    // Rows whose last visible position is before this chunk are done.
    const int r0 = std::max(0, c0 - pos_first) * G;
    int row = r0;
    if (bf16_dot) {
      if constexpr (std::is_same_v<TC, bf16> && NV % 2 == 0) {
        for (; row < rows; ++row) {
          const T* qrow = q_ptr + int64_t(q_begin + j0 + row / G) * pb.q_stride_t +
                          int64_t(kv_head * G + row % G) * pb.q_stride_h;
          qk_dot_bf16<NV>(qrow, krow, pb.scale, P + row * kLanes);
        }
      }
    } else if (dot) {
      for (; row < rows; ++row) qk_dot<NV>(Q + row * D, Krows, k_stride, P + row * kLanes);
    } else {
      for (; row + 8 <= rows; row += 8) qk_rows<8>(Q + row * D, Kt, P + row * kLanes, D, hd);
      for (; row + 4 <= rows; row += 4) qk_rows<4>(Q + row * D, Kt, P + row * kLanes, D, hd);
      for (; row + 2 <= rows; row += 2) qk_rows<2>(Q + row * D, Kt, P + row * kLanes, D, hd);
      for (; row < rows; ++row) qk_rows<1>(Q + row * D, Kt, P + row * kLanes, D, hd);
    }

    for (row = r0; row < rows; ++row) {
      const int limit = pos_first + row / G;
      vf sv = load(P + row * kLanes);
      const bool masked = limit < c0 + kLanes - 1;
      vi dead = (lane + c0) > limit;
      if (masked) sv = dead ? neg_inf : sv;
      const float m_new = std::max(M[row], hmax(sv));
      vf pv = vexp(sv - m_new);
      if (masked) pv = dead ? vf{} : pv;
      const float corr = std::exp(M[row] - m_new);
      L[row] = L[row] * corr + hsum(pv);
      M[row] = m_new;
      C[row] = corr;
      store(P + row * kLanes, pv);
    }

    if (stage_v) {
      pv_block_rows<NV, pv_block<NV>()>(O, P, C, vstaged, n_tok, D, r0, rows);
    } else if constexpr (!kCode) {
      pv_block_rows<NV, pv_block<NV>()>(O, P, C, vrow, n_tok, D, r0, rows);
    }
  }

  for (int jj = 0; jj < j1 - j0; ++jj) {
    for (int h = 0; h < G; ++h) {
      const int row = jj * G + h;
      const vf inv = splat(1.0f / L[row]);
      T* dst = out + int64_t(q_begin + j0 + jj) * pb.out_stride_t +
               int64_t(kv_head * G + h) * pb.out_stride_h;
      for (int j = 0; j < NV; ++j)
        store_n(dst + j * kLanes, load(O + row * D + j * kLanes) * inv, lanes(j));
    }
  }
}

int tile_positions(int group) { return std::max(1, kTargetRows / group); }

// ---------------------------------------------------------------- ops
// Work items (request, first query row, end query row) covering every query row, tiles of
// tile_positions(group) rows, sorted by estimated cost (query rows x context) descending.
torch::Tensor plan_work(const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc,
                        int64_t group_size) {
  TORCH_CHECK(seq_lens.dtype() == torch::kInt32 && query_start_loc.dtype() == torch::kInt32,
              "seq_lens and query_start_loc must be int32");
  TORCH_CHECK(group_size >= 1, "group_size must be >= 1");
  auto sl = seq_lens.contiguous();
  auto qsl = query_start_loc.contiguous();
  const int num_reqs = int(sl.numel());
  TORCH_CHECK(qsl.numel() == num_reqs + 1, "query_start_loc must have num_reqs + 1 entries");
  const int32_t* s = sl.data_ptr<int32_t>();
  const int32_t* q = qsl.data_ptr<int32_t>();
  const int tq = tile_positions(int(group_size));
  std::vector<std::array<int32_t, 3>> items;
  std::vector<int64_t> cost;
  for (int r = 0; r < num_reqs; ++r) {
    const int n = q[r + 1] - q[r];
    TORCH_CHECK(n >= 0 && n <= s[r], "request ", r, ": ", n, " query rows but seq_len ", s[r]);
    for (int j0 = 0; j0 < n; j0 += tq) {
      const int j1 = std::min(n, j0 + tq);
      items.push_back({r, j0, j1});
      cost.push_back(int64_t(j1 - j0) * (s[r] - n + j1));
    }
  }
  std::vector<int64_t> order(items.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  auto plan = torch::empty({int64_t(items.size()), 3}, torch::kInt32);
  int32_t* w = plan.data_ptr<int32_t>();
  for (size_t i = 0; i < order.size(); ++i)
    for (int k = 0; k < 3; ++k) w[i * 3 + k] = items[order[i]][k];
  return plan;
}

void check_cache(const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "k_cache/v_cache must be [num_blocks, num_kv_heads, block_size, head_dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV cache must be contiguous");
  TORCH_CHECK(k_cache.dtype() == v_cache.dtype(), "k_cache and v_cache dtypes differ");
  TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu(), "KV cache must be on the CPU");
}

bool is_code_cache(const torch::Tensor& cache) {
  return cache.scalar_type() == torch::kChar || cache.scalar_type() == torch::kFloat8_e4m3fn;
}

// The scales of a one-byte cache: float32 [num_blocks, num_kv_heads], contiguous, on the CPU.
void check_scales(const torch::Tensor& k_cache, const c10::optional<torch::Tensor>& k_scale,
                  const c10::optional<torch::Tensor>& v_scale) {
  const bool code = is_code_cache(k_cache);
  TORCH_CHECK(code == k_scale.has_value() && code == v_scale.has_value(),
              code ? "an int8/fp8 KV cache needs k_scale and v_scale" : "only int8/fp8 KV caches take scales");
  if (!code) return;
  for (const torch::Tensor* t : {&*k_scale, &*v_scale}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->device().is_cpu() &&
                    t->dim() == 2 && t->size(0) == k_cache.size(0) && t->size(1) == k_cache.size(1),
                "scales must be contiguous float32 [num_blocks, num_kv_heads] on the CPU");
  }
}

template <typename T>
void write_kv_impl(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache,
                   torch::Tensor& v_cache, const int64_t* slots, int64_t num_tokens) {
  const int64_t kvh = k_cache.size(1), bs = k_cache.size(2), hd = k_cache.size(3);
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // padding token
      const int64_t base = (slot / bs) * kvh * bs * hd + (slot % bs) * hd;
      for (int64_t h = 0; h < kvh; ++h) {
        std::memcpy(kc + base + h * bs * hd, kp + t * ks0 + h * ks1, hd * sizeof(T));
        std::memcpy(vc + base + h * bs * hd, vp + t * vs0 + h * vs1, hd * sizeof(T));
      }
    }
  });
}

// ---------------------------------------------------------------- quantized writes
constexpr float kMinScale = 0x1p-64f;  // kv_quantization.MIN_SCALE

inline int8_t to_code(float x, int8_t*) {
  return int8_t(std::nearbyint(std::min(127.0f, std::max(-127.0f, x))));
}
inline fp8 to_code(float x, fp8*) { return fp8(std::min(448.0f, std::max(-448.0f, x))); }

// n codes of x[i] / s (or of codes[i] * s_old / s for a requantization, in place): 16 at a
// time where AVX-512 is there (round to nearest even in both, saturating like to_code; the
// fp8 rounding is c10's: 3 mantissa bits for normals, multiples of 2^-9 below 2^-6), the
// rest one by one.
#if defined(__AVX512F__)
inline __m128i to_codes(vf x, int8_t*) {
  const __m512 c = _mm512_min_ps(_mm512_max_ps((__m512)x, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
  return _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(c));
}

inline __m128i to_codes(vf x, fp8*) {
  const __m512 c = _mm512_min_ps(_mm512_max_ps((__m512)x, _mm512_set1_ps(-448.0f)), _mm512_set1_ps(448.0f));
  const __m512i bits = _mm512_castps_si512(c);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
  const __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff));
  // Normal: round the fp32 mantissa to 3 bits (ties to even), rebias the exponent 127 -> 7.
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(mag, 20), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(mag, _mm512_add_epi32(_mm512_set1_epi32(0x7ffff), odd));
  const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(rounded, 20), _mm512_set1_epi32(120 << 3));
  // Subnormal: the nearest multiple of 2^-9 (8 is the smallest normal, 2^-6).
  const __m512i sub = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(512.0f)));
  const __mmask16 is_normal = _mm512_cmpge_epu32_mask(mag, _mm512_set1_epi32(0x3C800000));  // >= 2^-6
  return _mm512_cvtepi32_epi8(_mm512_or_si512(_mm512_mask_blend_epi32(is_normal, sub, normal), sign));
}
#endif

template <typename T, typename TC>
inline void quantize_row(const T* x, TC* out, int64_t n, float s) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const vf sv = splat(s);
  for (; i + kLanes <= n; i += kLanes)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), to_codes(load(x + i) / sv, static_cast<TC*>(nullptr)));
#endif
  for (; i < n; ++i) out[i] = to_code(static_cast<float>(x[i]) / s, static_cast<TC*>(nullptr));
}

template <typename TC>
inline void requantize(TC* codes, int64_t n, float s_old, float s_new) {
  int64_t i = 0;
#if defined(__AVX512F__)
  // load_code is kCodeUnit<TC> times the code: fold it into s_old (exact, a power of two).
  const vf old_v = splat(s_old * kCodeUnit<TC>), new_v = splat(s_new);
  for (; i + kLanes <= n; i += kLanes)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i),
                     to_codes(load_code(codes + i) * old_v / new_v, static_cast<TC*>(nullptr)));
#endif
  for (; i < n; ++i) codes[i] = to_code(static_cast<float>(codes[i]) * s_old / s_new, static_cast<TC*>(nullptr));
}

template <typename T>
inline float row_absmax(const T* x, int64_t n) {
  float m = 0.0f;
  int64_t i = 0;
#if defined(__AVX512F__)
  vf mv{};
  for (; i + kLanes <= n; i += kLanes) {
    const vf a = load(x + i);
    mv = vmax(mv, a < 0 ? -a : a);
  }
  m = hmax(mv);
#endif
  for (; i < n; ++i) m = std::max(m, std::abs(static_cast<float>(x[i])));
  return m;
}

template <typename TC>
float scale_for(float absmax) {
  float s = absmax / (std::is_same_v<TC, fp8> ? 448.0f : 127.0f);
  if constexpr (std::is_same_v<TC, fp8>) {  // the next power of two
    int e;
    const float m = std::frexp(s, &e);
    if (m != 0.5f && s > 0.0f) s = std::ldexp(1.0f, e);
  }
  return std::max(s, kMinScale);
}

// One head of K or V: tokens in runs of consecutive slots within a block (one per block and
// step). Per run: s_old = the block's scale (0 if the run starts the block), s_new =
// max(s_old, scale_for(run absmax)); a grown scale requantizes the block's earlier codes;
// the run is quantized with s_new. Same fp32 operations as kv_quantization.write_quantized.
template <typename T, typename TC>
void write_head_quantized(const T* x, int64_t xs0, int64_t xs1, TC* codes, float* scales, int64_t h,
                          int64_t kvh, int64_t bs, int64_t hd, const int64_t* slots, int64_t num_tokens) {
  int64_t t = 0;
  while (t < num_tokens) {
    if (slots[t] < 0) {
      ++t;
      continue;
    }
    const int64_t block = slots[t] / bs, o0 = slots[t] % bs;
    int64_t end = t + 1;
    while (end < num_tokens && slots[end] == slots[end - 1] + 1 && slots[end] / bs == block) ++end;
    float absmax = 0.0f;
    for (int64_t u = t; u < end; ++u) absmax = std::max(absmax, row_absmax(x + u * xs0 + h * xs1, hd));
    float& scale = scales[block * kvh + h];
    const float s_old = o0 > 0 ? scale : 0.0f;
    const float s_new = std::max(s_old, scale_for<TC>(absmax));
    TC* slab = codes + (block * kvh + h) * bs * hd;
    if (o0 > 0 && s_new > s_old) requantize(slab, o0 * hd, s_old, s_new);
    for (int64_t u = t; u < end; ++u) quantize_row(x + u * xs0 + h * xs1, slab + (o0 + u - t) * hd, hd, s_new);
    scale = s_new;
    t = end;
  }
}

template <typename T, typename TC>
void write_kv_quantized(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor& k_cache,
                        torch::Tensor& v_cache, torch::Tensor& k_scale, torch::Tensor& v_scale,
                        const int64_t* slots, int64_t num_tokens) {
  const int64_t kvh = k_cache.size(1), bs = k_cache.size(2), hd = k_cache.size(3);
  // Tasks own one head of K or of V: every block run of that head is theirs alone.
  at::parallel_for(0, 2 * kvh, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const bool is_v = task >= kvh;
      const torch::Tensor& x = is_v ? v : k;
      torch::Tensor& cache = is_v ? v_cache : k_cache;
      torch::Tensor& scales = is_v ? v_scale : k_scale;
      write_head_quantized<T, TC>(x.data_ptr<T>(), x.stride(0), x.stride(1), cache.data_ptr<TC>(),
                                  scales.data_ptr<float>(), task % kvh, kvh, bs, hd, slots, num_tokens);
    }
  });
}

// k, v: [T, kvh, hd] (any strides with a unit last stride) -> their slots in the cache
// (quantized, updating k_scale / v_scale, for one-byte caches). A negative slot skips the token.
void write_kv(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor k_cache,
              torch::Tensor v_cache, const torch::Tensor& slot_mapping,
              const c10::optional<torch::Tensor>& k_scale, const c10::optional<torch::Tensor>& v_scale) {
  check_cache(k_cache, v_cache);
  check_scales(k_cache, k_scale, v_scale);
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes(), "k and v must be [T, num_kv_heads, head_dim]");
  TORCH_CHECK(k.size(1) == k_cache.size(1) && k.size(2) == k_cache.size(3),
              "k/v heads or head_dim do not match the cache");
  TORCH_CHECK(k.dtype() == v.dtype() && (k.dtype() == k_cache.dtype() || is_code_cache(k_cache)),
              "k/v dtype must equal the cache dtype");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "k/v need a unit head_dim stride");
  TORCH_CHECK(slot_mapping.dtype() == torch::kInt64 && slot_mapping.numel() == k.size(0),
              "slot_mapping must be int64 [T]");
  auto slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(2);
  for (int64_t t = 0; t < k.size(0); ++t)
    TORCH_CHECK(sp[t] < num_slots, "slot ", sp[t], " out of range (", num_slots, " slots)");
  if (is_code_cache(k_cache)) {
    torch::Tensor ks = *k_scale, vs = *v_scale;
    const bool f32 = k.scalar_type() == torch::kFloat32;
    TORCH_CHECK(f32 || k.scalar_type() == torch::kBFloat16, "k/v must be float32 or bfloat16");
    if (k_cache.scalar_type() == torch::kChar) {
      if (f32) write_kv_quantized<float, int8_t>(k, v, k_cache, v_cache, ks, vs, sp, k.size(0));
      else write_kv_quantized<bf16, int8_t>(k, v, k_cache, v_cache, ks, vs, sp, k.size(0));
    } else {
      if (f32) write_kv_quantized<float, fp8>(k, v, k_cache, v_cache, ks, vs, sp, k.size(0));
      else write_kv_quantized<bf16, fp8>(k, v, k_cache, v_cache, ks, vs, sp, k.size(0));
    }
  } else if (k_cache.scalar_type() == torch::kFloat32) {
    write_kv_impl<float>(k, v, k_cache, v_cache, sp, k.size(0));
  } else if (k_cache.scalar_type() == torch::kBFloat16) {
    write_kv_impl<bf16>(k, v, k_cache, v_cache, sp, k.size(0));
  } else {
    TORCH_CHECK(false, "KV cache dtype must be float32, bfloat16, int8 or float8_e4m3fn");
  }
}

template <typename T, typename TC, int NV>
void run_items(const Problem& pb, const torch::Tensor& q, const torch::Tensor& k_cache,
               const torch::Tensor& v_cache, torch::Tensor& out, const int32_t* work,
               int64_t num_items) {
  const T* qp = q.data_ptr<T>();
  const TC* kc = k_cache.data_ptr<TC>();
  const TC* vc = v_cache.data_ptr<TC>();
  T* op = out.data_ptr<T>();
  const int64_t total = num_items * pb.num_kv_heads;
  const int max_rows = tile_positions(pb.group) * pb.group;
  std::atomic<int64_t> next{0};
  const int64_t num_workers = std::min<int64_t>(at::get_num_threads(), total);
  at::parallel_for(0, num_workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t worker = begin; worker < end; ++worker) {
      Scratch scratch(max_rows, NV * kLanes);
      for (int64_t i = next.fetch_add(1); i < total; i = next.fetch_add(1)) {
        const int32_t* item = work + (i / pb.num_kv_heads) * 3;
        attend_tile<T, TC, NV>(pb, qp, kc, vc, op, item[0], int(i % pb.num_kv_heads), item[1],
                           item[2], scratch);
      }
    }
  });
}

// Instantiated vector counts (head_dim / 16, rounded up to the next one listed): 64, 80,
// 96, 128, 192, 256 run unpadded; other sizes pad with zero lanes.
template <typename T, typename TC, int NV, int... Rest>
void dispatch_vectors(int nv, const Problem& pb, const torch::Tensor& q, const torch::Tensor& k_cache,
                      const torch::Tensor& v_cache, torch::Tensor& out, const int32_t* work,
                      int64_t num_items) {
  if (nv <= NV) return run_items<T, TC, NV>(pb, q, k_cache, v_cache, out, work, num_items);
  if constexpr (sizeof...(Rest) > 0) {
    return dispatch_vectors<T, TC, Rest...>(nv, pb, q, k_cache, v_cache, out, work, num_items);
  }
  TORCH_CHECK(false, "head_dim must be <= ", kMaxVectors * kLanes);
}

// out[T, nh, hd] = causal varlen attention of q over the paged cache (see the top).
// work: the plan_work() tiles to run; None plans every request.
void paged_attention(torch::Tensor out, const torch::Tensor& q, const torch::Tensor& k_cache,
                     const torch::Tensor& v_cache, const torch::Tensor& block_table,
                     const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc,
                     double scale, const c10::optional<torch::Tensor>& work,
                     const c10::optional<torch::Tensor>& k_scale, const c10::optional<torch::Tensor>& v_scale) {
  check_cache(k_cache, v_cache);
  check_scales(k_cache, k_scale, v_scale);
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [T, num_heads, head_dim]");
  TORCH_CHECK((q.dtype() == k_cache.dtype() || is_code_cache(k_cache)) && out.dtype() == q.dtype(),
              "q, out and the KV cache must share a dtype (or the cache hold int8/fp8 codes)");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q/out need a unit head_dim stride");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "q head_dim does not match the cache");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_table.dtype() == torch::kInt32 && block_table.dim() == 2 &&
                  block_table.is_contiguous(), "block_table must be contiguous int32 [R, max_blocks]");
  TORCH_CHECK(seq_lens.dtype() == torch::kInt32 && seq_lens.is_contiguous() &&
                  query_start_loc.dtype() == torch::kInt32 && query_start_loc.is_contiguous(),
              "seq_lens / query_start_loc must be contiguous int32");
  const int64_t num_reqs = seq_lens.numel();
  TORCH_CHECK(block_table.size(0) == num_reqs && query_start_loc.numel() == num_reqs + 1,
              "block_table / query_start_loc do not match seq_lens");
  const int bs = int(k_cache.size(2));
  TORCH_CHECK(bs > 0 && (bs & (bs - 1)) == 0, "block_size must be a power of two");

  // A bad block id would read outside the cache: check every entry the kernel will touch.
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int64_t max_blocks = block_table.size(1), num_blocks = k_cache.size(0);
  TORCH_CHECK(qsl[0] == 0 && qsl[num_reqs] == q.size(0), "query_start_loc must span q's rows");
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t n = qsl[r + 1] - qsl[r];
    TORCH_CHECK(n >= 0 && n <= sl[r], "request ", r, ": ", n, " query rows but seq_len ", sl[r]);
    const int64_t used = (int64_t(sl[r]) + bs - 1) / bs;
    TORCH_CHECK(used <= max_blocks, "request ", r, " needs ", used, " blocks, table has ", max_blocks);
    for (int64_t b = 0; b < used; ++b)
      TORCH_CHECK(bt[r * max_blocks + b] >= 0 && bt[r * max_blocks + b] < num_blocks,
                  "request ", r, ": block id ", bt[r * max_blocks + b], " out of range");
  }

  Problem pb;
  pb.num_heads = int(q.size(1));
  pb.num_kv_heads = int(k_cache.size(1));
  pb.group = pb.num_heads / pb.num_kv_heads;
  pb.head_dim = int(q.size(2));
  pb.block_size = bs;
  pb.block_shift = __builtin_ctz(unsigned(bs));
  pb.max_blocks = int(max_blocks);
  pb.scale = float(scale);
  pb.q_stride_t = q.stride(0);
  pb.q_stride_h = q.stride(1);
  pb.out_stride_t = out.stride(0);
  pb.out_stride_h = out.stride(1);
  pb.cache_stride_block = k_cache.stride(0);
  pb.cache_stride_head = k_cache.stride(1);
  pb.k_scale = k_scale.has_value() ? k_scale->data_ptr<float>() : nullptr;
  pb.v_scale = v_scale.has_value() ? v_scale->data_ptr<float>() : nullptr;
  pb.block_table = bt;
  pb.seq_lens = sl;
  pb.query_start_loc = qsl;

  torch::Tensor plan = work.has_value() ? work->contiguous()
                                        : plan_work(seq_lens, query_start_loc, pb.group);
  TORCH_CHECK(plan.dtype() == torch::kInt32 && plan.dim() == 2 && plan.size(1) == 3,
              "work must be int32 [W, 3]");
  const int32_t* wp = plan.data_ptr<int32_t>();
  const int tq = tile_positions(pb.group);
  for (int64_t i = 0; i < plan.size(0); ++i) {
    const int32_t r = wp[i * 3], j0 = wp[i * 3 + 1], j1 = wp[i * 3 + 2];
    TORCH_CHECK(r >= 0 && r < num_reqs && j0 >= 0 && j0 < j1 && j1 <= qsl[r + 1] - qsl[r] &&
                    j1 - j0 <= tq, "work item ", i, " is not a tile of this batch");
  }
  const int nv = (pb.head_dim + kLanes - 1) / kLanes;
  const int64_t n = plan.size(0);
  const auto cache_type = k_cache.scalar_type();
  if (q.scalar_type() == torch::kFloat32) {
    if (cache_type == torch::kChar)
      dispatch_vectors<float, int8_t, 2, 4, 5, 6, 8, 12, 16>(nv, pb, q, k_cache, v_cache, out, wp, n);
    else if (cache_type == torch::kFloat8_e4m3fn)
      dispatch_vectors<float, fp8, 2, 4, 5, 6, 8, 12, 16>(nv, pb, q, k_cache, v_cache, out, wp, n);
    else
      dispatch_vectors<float, float, 2, 4, 5, 6, 8, 12, 16>(nv, pb, q, k_cache, v_cache, out, wp, n);
  } else if (q.scalar_type() == torch::kBFloat16) {
    if (cache_type == torch::kChar)
      dispatch_vectors<bf16, int8_t, 2, 4, 5, 6, 8, 12, 16>(nv, pb, q, k_cache, v_cache, out, wp, n);
    else if (cache_type == torch::kFloat8_e4m3fn)
      dispatch_vectors<bf16, fp8, 2, 4, 5, 6, 8, 12, 16>(nv, pb, q, k_cache, v_cache, out, wp, n);
    else
      dispatch_vectors<bf16, bf16, 2, 4, 5, 6, 8, 12, 16>(nv, pb, q, k_cache, v_cache, out, wp, n);
  } else {
    TORCH_CHECK(false, "dtype must be float32 or bfloat16");
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_kv", &write_kv, "Store new tokens' K/V at their cache slots (quantized into int8/fp8 caches)",
        py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
  m.def("paged_attention", &paged_attention, "Varlen causal attention over the paged KV cache",
        py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("block_table"), py::arg("seq_lens"), py::arg("query_start_loc"), py::arg("scale"),
        py::arg("work") = py::none(), py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
  m.def("plan_work", &plan_work, "Tiles (request, j0, j1) of a batch, costliest first");
}
