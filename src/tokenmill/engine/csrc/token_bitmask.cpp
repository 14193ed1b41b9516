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

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <limits>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

void apply_token_bitmask_(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous(),
              "logits must be a contiguous float32 [n, vocab] tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32 && bitmask.is_contiguous(),
              "bitmask must be a contiguous int32 [m, words] tensor");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kInt64 && rows.size(0) == bitmask.size(0),
              "rows must be int64 [m]");
  const int64_t n = logits.size(0), vocab = logits.size(1);
  const int64_t m = bitmask.size(0), words = bitmask.size(1);
  float* out = logits.data_ptr<float>();
  const int32_t* mask = bitmask.data_ptr<int32_t>();
  const int64_t* row_of = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i) TORCH_CHECK(row_of[i] >= 0 && row_of[i] < n, "row index out of range");
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("apply_token_bitmask_", &apply_token_bitmask_, "logits[rows] = -inf where the bitmask bit is 0");
}
