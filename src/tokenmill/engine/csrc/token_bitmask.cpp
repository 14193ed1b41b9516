// Applies packed token bitmasks to rows of a logits tensor, in place, for the CPU.
//
//   apply_token_bitmask_(logits [n, V] float32, bitmask [m, W] int32, rows [m] int64)
//
// Bit b of word w of bitmask row i says whether token 32 * w + b may follow in logits row
// rows[i] (1: allowed, as xgrammar and llguidance pack it); disallowed tokens get -inf,
// and tokens at or past 32 * W (a vocabulary larger than the mask) are disallowed too.
// A word of all ones (the common case for free text) is skipped, one of all zeros (the
// common case inside a JSON structure) is a straight fill; with AVX-512 every other word
// is two masked stores. Parallel over rows.
//
//   masked_float_(out [n, V] float32, logits [n, V] bfloat16, bitmask [m, W] int32, rows [m] int64)
//
// The same mask fused into the bfloat16 -> float32 conversion the logits need anyway: one
// pass that reads the bf16 row and writes each float or -inf, so a masked row costs what
// an unmasked conversion does (rows not in `rows` are converted unmasked).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>
#include <limits>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

// logits [n, vocab] of `dtype`, bitmask [m, words] int32, rows [m] int64 naming rows of logits.
static void check_arguments(const torch::Tensor& logits, at::ScalarType dtype, const torch::Tensor& bitmask,
                            const torch::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == dtype && logits.is_contiguous(),
              "logits must be a contiguous ", dtype, " [n, vocab] tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32 && bitmask.is_contiguous(),
              "bitmask must be a contiguous int32 [m, words] tensor");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kInt64 && rows.is_contiguous() &&
                  rows.size(0) == bitmask.size(0),
              "rows must be int64 [m]");
  const int64_t n = logits.size(0);
  const int64_t* row_of = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i) TORCH_CHECK(row_of[i] >= 0 && row_of[i] < n, "row index out of range");
}

void apply_token_bitmask_(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows) {
  check_arguments(logits, torch::kFloat32, bitmask, rows);
  const int64_t vocab = logits.size(1);
  const int64_t m = bitmask.size(0), words = bitmask.size(1);
  float* out = logits.data_ptr<float>();
  const int32_t* mask = bitmask.data_ptr<int32_t>();
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = out + row_of[i] * vocab;
      const uint32_t* bits = reinterpret_cast<const uint32_t*>(mask + i * words);
      for (int64_t w = 0; w < words && 32 * w < vocab; ++w) {
        const uint32_t word = bits[w];
        if (word == 0xFFFFFFFFu) continue;
        const int64_t base = 32 * w;
        const int64_t len = vocab - base < 32 ? vocab - base : 32;
#ifdef __AVX512F__
        if (len == 32) {
          // Two masked stores per word: lanes whose bit is 0 get -inf.
          const __m512 fill = _mm512_set1_ps(neg_inf);
          _mm512_mask_storeu_ps(row + base, static_cast<__mmask16>(~word & 0xFFFFu), fill);
          _mm512_mask_storeu_ps(row + base + 16, static_cast<__mmask16>((~word >> 16) & 0xFFFFu), fill);
          continue;
        }
#endif
        if (word == 0) {
          for (int64_t b = 0; b < len; ++b) row[base + b] = neg_inf;
        } else {
          for (int64_t b = 0; b < len; ++b)
            if (!((word >> b) & 1u)) row[base + b] = neg_inf;
        }
      }
      for (int64_t t = 32 * words; t < vocab; ++t) row[t] = neg_inf;
    }
  });
}

static inline void convert_word(const uint16_t* src, float* dst, uint32_t word, int64_t len) {
#ifdef __AVX512F__
  if (len == 32) {
    const __m512 fill = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int half = 0; half < 2; ++half) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 16 * half));
      const __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      const __mmask16 keep = static_cast<__mmask16>((word >> (16 * half)) & 0xFFFFu);
      _mm512_storeu_ps(dst + 16 * half, _mm512_mask_blend_ps(keep, fill, f));
    }
    return;
  }
#endif
  for (int64_t b = 0; b < len; ++b) {
    const uint32_t bits = static_cast<uint32_t>(src[b]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    dst[b] = ((word >> b) & 1u) ? f : -std::numeric_limits<float>::infinity();
  }
}

void masked_float_(torch::Tensor out, torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows) {
  check_arguments(logits, torch::kBFloat16, bitmask, rows);
  const int64_t n = logits.size(0), vocab = logits.size(1);
  const int64_t m = bitmask.size(0), words = bitmask.size(1);
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous() && out.size(0) == n && out.size(1) == vocab,
              "out must be a contiguous float32 tensor shaped like logits");
  const uint16_t* src = reinterpret_cast<const uint16_t*>(logits.data_ptr<at::BFloat16>());
  float* dst = out.data_ptr<float>();
  const int32_t* mask = bitmask.data_ptr<int32_t>();
  const int64_t* row_of = rows.data_ptr<int64_t>();
  std::vector<int64_t> mask_of(n, -1);  // logits row -> its bitmask row, or -1
  for (int64_t i = 0; i < m; ++i) mask_of[row_of[i]] = i;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* s = src + r * vocab;
      float* d = dst + r * vocab;
      const uint32_t* bits = mask_of[r] < 0 ? nullptr : reinterpret_cast<const uint32_t*>(mask + mask_of[r] * words);
      for (int64_t base = 0; base < vocab; base += 32) {
        const int64_t w = base / 32;
        const uint32_t word = bits == nullptr ? 0xFFFFFFFFu : (w < words ? bits[w] : 0u);
        convert_word(s + base, d + base, word, vocab - base < 32 ? vocab - base : 32);
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("apply_token_bitmask_", &apply_token_bitmask_, "logits[rows] = -inf where the bitmask bit is 0");
  m.def("masked_float_", &masked_float_, "bfloat16 logits as float32, -inf where the bitmask bit is 0");
}
