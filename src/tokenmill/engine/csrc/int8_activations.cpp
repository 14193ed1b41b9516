// The two elementwise ends of an int8 x int8 matmul (W8A8), for the CPU.
//
// y = x W^T with int8 weight codes q_w [N, K] (y ~ s_x[m] s_w[n] (q_x q_w^T)[m, n]) needs
// the activations quantized per token row before torch._int_mm and the int32 products
// scaled back after it. As aten ops each end is five to eight passes with temporaries;
// here each is one pass per row, parallel over rows.
//
//   quantize_rows(x [M, K] float32|bfloat16, inv_smooth [K] float32 (or empty))
//       -> (q int8 [M, K], scale float32 [M])
//     v = x * inv_smooth (SmoothQuant's per-input-channel factor, folded into the weight
//     codes), scale = max(max|v| / 127, 1e-30), q = round_half_even(v / scale) in [-127, 127]
//   dequantize_rows(acc int32 [M, N], row_scale [M], col_scale [N], bias [N] or empty, dtype)
//       -> y [M, N] of dtype: y = acc * row_scale[m] * col_scale[n] (+ bias[n]), rounded once
//   int8_linear(x, qweight_t [K, N] int8 (a transposed [N, K] view), scales [N], inv_smooth, bias)
//       -> dequantize_rows(at::_int_mm(quantize_rows(x)), ...) in x's dtype: the three in one
//       call from Python (a decode step makes 120 of them; each crossing costs microseconds)
//
// The float32 operations are the ones of the aten reference in quantization/linear.py, in
// the same order, so both produce the same bits.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

#ifdef __AVX512F__
// 16 values from x (float32 or bfloat16), as float32.
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const at::BFloat16* x) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

template <typename T>
void quantize_row(const T* row, const float* inv_smooth, int8_t* out, float* scale, int64_t k) {
  int64_t i = 0;
  float amax = 0.f;
#ifdef __AVX512F__
  const __m512 ones = _mm512_set1_ps(1.f);
  __m512 vmax = _mm512_setzero_ps();
  for (; i + 16 <= k; i += 16) {
    const __m512 v = _mm512_mul_ps(load16(row + i), inv_smooth ? _mm512_loadu_ps(inv_smooth + i) : ones);
    vmax = _mm512_max_ps(vmax, _mm512_abs_ps(v));
  }
  amax = _mm512_reduce_max_ps(vmax);
#endif
  for (int64_t j = i; j < k; ++j) {
    float value = static_cast<float>(row[j]);
    if (inv_smooth) value *= inv_smooth[j];
    amax = std::fmax(amax, std::fabs(value));
  }
  const float s = std::fmax(amax / 127.f, 1e-30f);
  *scale = s;
  i = 0;
#ifdef __AVX512F__
  const __m512 vs = _mm512_set1_ps(s), hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
  for (; i + 16 <= k; i += 16) {
    const __m512 v = _mm512_mul_ps(load16(row + i), inv_smooth ? _mm512_loadu_ps(inv_smooth + i) : ones);
    // round half to even, as torch.round and std::nearbyint
    __m512 c = _mm512_roundscale_ps(_mm512_div_ps(v, vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    c = _mm512_min_ps(_mm512_max_ps(c, lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(c)));
  }
#endif
  for (; i < k; ++i) {
    float value = static_cast<float>(row[i]);
    if (inv_smooth) value *= inv_smooth[i];
    const float c = std::nearbyint(value / s);
    out[i] = static_cast<int8_t>(std::fmin(std::fmax(c, -127.f), 127.f));
  }
}

template <typename T>
void quantize_rows_impl(const T* x, const float* inv_smooth, int8_t* q, float* scale, int64_t m, int64_t k) {
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(x + r * k, inv_smooth, q + r * k, scale + r, k);
  });
}

template <typename T>
void dequantize_rows_impl(const int32_t* acc, const float* rs, const float* cs, const float* bias, T* y,
                          int64_t m, int64_t n) {
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* a = acc + r * n;
      T* out = y + r * n;
      const float s = rs[r];
      if (bias) {
        for (int64_t j = 0; j < n; ++j) out[j] = static_cast<T>(static_cast<float>(a[j]) * s * cs[j] + bias[j]);
      } else {
        for (int64_t j = 0; j < n; ++j) out[j] = static_cast<T>(static_cast<float>(a[j]) * s * cs[j]);
      }
    }
  });
}

}  // namespace

std::vector<torch::Tensor> quantize_rows(torch::Tensor x, torch::Tensor inv_smooth) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  const int64_t m = x.size(0), k = x.size(1);
  const float* smooth = nullptr;
  if (inv_smooth.numel() > 0) {
    TORCH_CHECK(inv_smooth.scalar_type() == torch::kFloat32 && inv_smooth.is_contiguous() && inv_smooth.numel() == k,
                "inv_smooth must be a contiguous float32 [K] tensor");
    smooth = inv_smooth.data_ptr<float>();
  }
  auto q = torch::empty({m, k}, x.options().dtype(torch::kInt8));
  auto scale = torch::empty({m}, x.options().dtype(torch::kFloat32));
  if (x.scalar_type() == torch::kFloat32) {
    quantize_rows_impl(x.data_ptr<float>(), smooth, q.data_ptr<int8_t>(), scale.data_ptr<float>(), m, k);
  } else if (x.scalar_type() == torch::kBFloat16) {
    quantize_rows_impl(x.data_ptr<at::BFloat16>(), smooth, q.data_ptr<int8_t>(), scale.data_ptr<float>(), m, k);
  } else {
    TORCH_CHECK(false, "x must be float32 or bfloat16");
  }
  return {q, scale};
}

torch::Tensor dequantize_rows(torch::Tensor acc, torch::Tensor row_scale, torch::Tensor col_scale, torch::Tensor bias,
                              torch::ScalarType dtype) {
  TORCH_CHECK(acc.dim() == 2 && acc.scalar_type() == torch::kInt32 && acc.is_contiguous(),
              "acc must be a contiguous int32 [M, N] tensor");
  const int64_t m = acc.size(0), n = acc.size(1);
  TORCH_CHECK(row_scale.scalar_type() == torch::kFloat32 && row_scale.is_contiguous() && row_scale.numel() == m,
              "row_scale must be a contiguous float32 [M] tensor");
  TORCH_CHECK(col_scale.scalar_type() == torch::kFloat32 && col_scale.is_contiguous() && col_scale.numel() == n,
              "col_scale must be a contiguous float32 [N] tensor");
  const float* b = nullptr;
  if (bias.numel() > 0) {
    TORCH_CHECK(bias.scalar_type() == torch::kFloat32 && bias.is_contiguous() && bias.numel() == n,
                "bias must be a contiguous float32 [N] tensor");
    b = bias.data_ptr<float>();
  }
  auto y = torch::empty({m, n}, acc.options().dtype(dtype));
  if (dtype == torch::kFloat32) {
    dequantize_rows_impl(acc.data_ptr<int32_t>(), row_scale.data_ptr<float>(), col_scale.data_ptr<float>(), b,
                         y.data_ptr<float>(), m, n);
  } else if (dtype == torch::kBFloat16) {
    dequantize_rows_impl(acc.data_ptr<int32_t>(), row_scale.data_ptr<float>(), col_scale.data_ptr<float>(), b,
                         y.data_ptr<at::BFloat16>(), m, n);
  } else {
    TORCH_CHECK(false, "dtype must be float32 or bfloat16");
  }
  return y;
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor qweight_t, torch::Tensor scales, torch::Tensor inv_smooth,
                          torch::Tensor bias) {
  auto quantized = quantize_rows(x, inv_smooth);
  auto acc = at::_int_mm(quantized[0], qweight_t);
  return dequantize_rows(acc, quantized[1], scales, bias, x.scalar_type());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_linear", &int8_linear, "x W^T (+ bias) with int8 activations and weights");
  m.def("quantize_rows", &quantize_rows, "per-row symmetric int8 quantization of (smoothed) activations");
  m.def("dequantize_rows", &dequantize_rows, "int32 products -> dtype, scaled per row and column (+ bias)");
}
