// Fused elementwise ops of the decoder layer, for the CPU.
//
// A decode step of a small model is dozens of tiny elementwise ops per layer (RMSNorm in
// fp32 over bf16 activations, the residual add, RoPE, SiLU * up); as separate aten calls
// each one pays dispatch, an allocation and a pass over memory. These kernels do each
// group in one pass per token row, parallel over rows, math in fp32, storage in the
// tensor's dtype (float32 or bfloat16), with the same rounding points as the unfused
// PyTorch code (the residual sum is rounded to the storage dtype before it is normed).
//
//   add_rms_norm_(x, residual, weight, eps):  residual += x; x = rms_norm(residual) * weight
//   rms_norm(x, weight, eps) -> out
//   rotary_(qkv, cos, sin, num_rot_heads):    rotate_half RoPE in place on heads [0, n)
//   silu_and_mul(gate_up) -> silu(gate) * up  gate_up: [T, 2F] -> [T, F]

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace {

template <typename T>
inline float to_f(T v) { return static_cast<float>(v); }

template <typename T>
inline T from_f(float v) { return static_cast<T>(v); }

template <typename T>
void rms_norm_row(const T* in, const T* w, T* out, int64_t h, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < h; ++i) {
    float v = to_f(in[i]);
    ss += v * v;
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
  for (int64_t i = 0; i < h; ++i) {
    // HF Llama: weight * (x * rsqrt).to(dtype), so round the normalized value first.
    const T normed = from_f<T>(to_f(in[i]) * inv);
    out[i] = from_f<T>(to_f(w[i]) * to_f(normed));
  }
}

void check_rows(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, H] tensor");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous(), "weight must be [H]");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "weight and x must share a dtype");
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, weight);
  auto out = torch::empty_like(x);
  const int64_t t = x.size(0), h = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* in = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, t, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) rms_norm_row(in + r * h, w, o + r * h, h, (float)eps);
    });
  });
  return out;
}

void add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() &&
                  residual.scalar_type() == x.scalar_type(),
              "residual must match x");
  const int64_t t = x.size(0), h = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, x.scalar_type(), "add_rms_norm_", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    at::parallel_for(0, t, 16, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        scalar_t* xr = xp + r * h;
        scalar_t* rr = rp + r * h;
        for (int64_t i = 0; i < h; ++i) rr[i] = from_f<scalar_t>(to_f(xr[i]) + to_f(rr[i]));
        rms_norm_row(rr, w, xr, h, (float)eps);
      }
    });
  });
}

void rotary_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t num_rot_heads) {
  // qkv: [T, H, D] (any row stride, heads and dims contiguous); cos/sin: [T, D/2] float32.
  TORCH_CHECK(qkv.dim() == 3 && qkv.stride(2) == 1 && qkv.stride(1) == qkv.size(2),
              "qkv must be [T, H, D] with contiguous heads");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "cos/sin must be contiguous float32");
  const int64_t t = qkv.size(0), d = qkv.size(2), half = d / 2, row = qkv.stride(0);
  TORCH_CHECK(cos.size(0) == t && cos.size(1) == half, "cos must be [T, D/2]");
  TORCH_CHECK(num_rot_heads <= qkv.size(1), "num_rot_heads exceeds the head count");
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, qkv.scalar_type(), "rotary_", [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    at::parallel_for(0, t, 8, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const float* c = cp + r * half;
        const float* s = sp + r * half;
        for (int64_t hd = 0; hd < num_rot_heads; ++hd) {
          scalar_t* x = base + r * row + hd * d;
          for (int64_t i = 0; i < half; ++i) {
            // Same rounding as the unfused code: each product rounds to the dtype first.
            // cos/sin are rounded to the dtype too, as HF casts them before the rotation.
            const float ci = to_f(from_f<scalar_t>(c[i])), si = to_f(from_f<scalar_t>(s[i]));
            const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
            const float a = to_f(from_f<scalar_t>(x1 * ci)) - to_f(from_f<scalar_t>(x2 * si));
            const float bb = to_f(from_f<scalar_t>(x2 * ci)) + to_f(from_f<scalar_t>(x1 * si));
            x[i] = from_f<scalar_t>(a);
            x[i + half] = from_f<scalar_t>(bb);
          }
        }
      }
    });
  });
}

torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous [T, 2F] tensor");
  const int64_t t = gate_up.size(0), f = gate_up.size(1) / 2;
  auto out = torch::empty({t, f}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, t, 8, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        const scalar_t* g = in + r * 2 * f;
        const scalar_t* u = g + f;
        scalar_t* orow = o + r * f;
        for (int64_t i = 0; i < f; ++i) {
          const float gv = to_f(g[i]);
          const scalar_t act = from_f<scalar_t>(gv / (1.f + std::exp(-gv)));
          orow[i] = from_f<scalar_t>(to_f(act) * to_f(u[i]));
        }
      }
    });
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm in fp32 math");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = rms_norm(residual) (in place)");
  m.def("rotary_", &rotary_, "rotate_half RoPE in place on the first heads");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
}
