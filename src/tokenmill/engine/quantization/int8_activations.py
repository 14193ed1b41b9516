"""int8 x int8 matmuls (W8A8): activations quantized per token row, products scaled back.

    y = x W^T  ~  s_x[m] s_w[n] (q_x q_w^T)[m, n]
    q_x = round(x' / s_x), s_x = max|x'[m]| / 127, x' = x / smooth (SmoothQuant, smoothing.py)

The matmul is torch._int_mm (oneDNN's int8 GEMM with VNNI on x86), exact in int32, so a
row's result never depends on what else is in the batch. On this machine's 2 cores, with
30 layers' weights streaming from memory as in a decode step, the four projections of a
default-model layer take 163 us at one row against 315 us for the prepacked bf16 matmul and
217 us for the weight-only int8 kernel (_weight_int8pack_mm), and 475 / 489 / 953 us at 32
rows. The quantize and rescale ends are one C++ pass each on the CPU, and the whole matmul
one call (csrc/int8_activations.cpp); the aten ops below are their reference and the
fallback.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from tokenmill.engine.cpu_extension import optional_extension

_EMPTY = torch.empty(0)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def bind_int8_linear(
    qweight: torch.Tensor, scales: torch.Tensor, inv_smooth: torch.Tensor | None, bias: torch.Tensor | None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """x [M, K] -> x W^T (+ bias) [M, N] in x's dtype, with its arguments bound once (a decode
    step makes 120 such calls; on the CPU each is one C++ call). qweight int8 [N, K];
    scales, inv_smooth and bias float32."""
    kernel = _cpu_kernel() if qweight.device.type == "cpu" else None
    weight_t = qweight.t()
    if kernel is None:
        return lambda x: _int8_linear_torch(x, weight_t, scales, inv_smooth, bias)
    args = (weight_t, scales, _EMPTY if inv_smooth is None else inv_smooth, _EMPTY if bias is None else bias)

    def call(x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in _KERNEL_DTYPES:
            return _int8_linear_torch(x, weight_t, scales, inv_smooth, bias)
        return kernel.int8_linear(x.contiguous(), *args)

    return call


def int8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, inv_smooth: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """bind_int8_linear(...)(x), for one call."""
    return bind_int8_linear(qweight, scales, inv_smooth, bias)(x)


def _int8_linear_torch(
    x: torch.Tensor, weight_t: torch.Tensor, scales: torch.Tensor, inv_smooth: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    q, row_scale = quantize_rows(x, inv_smooth)
    return dequantize_rows(torch._int_mm(q, weight_t), row_scale, scales, bias, x.dtype)


def quantize_rows(x: torch.Tensor, inv_smooth: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 codes [M, K], float32 scales [M]), x * inv_smooth ~ codes * scale."""
    kernel = _cpu_kernel() if x.device.type == "cpu" and x.dtype in _KERNEL_DTYPES else None
    if kernel is not None:
        q, scale = kernel.quantize_rows(x.contiguous(), _EMPTY if inv_smooth is None else inv_smooth)
        return q, scale
    return quantize_rows_torch(x, inv_smooth)


def quantize_rows_torch(x: torch.Tensor, inv_smooth: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    v = x.float() if inv_smooth is None else x.float() * inv_smooth
    scale = (v.abs().amax(dim=1) / 127.0).clamp_(min=1e-30)
    q = torch.round(v / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_rows(
    acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """int32 [M, N] -> acc * row_scale[m] * col_scale[n] (+ bias[n]) in `dtype`."""
    kernel = _cpu_kernel() if acc.device.type == "cpu" and dtype in _KERNEL_DTYPES else None
    if kernel is not None:
        return kernel.dequantize_rows(acc, row_scale, col_scale, _EMPTY if bias is None else bias, dtype)
    return dequantize_rows_torch(acc, row_scale, col_scale, bias, dtype)


def dequantize_rows_torch(
    acc: torch.Tensor, row_scale: torch.Tensor, col_scale: torch.Tensor, bias: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    y = acc.float() * row_scale[:, None] * col_scale[None, :]
    if bias is not None:
        y = y + bias
    return y.to(dtype)


def _cpu_kernel() -> ModuleType | None:
    return optional_extension("int8_activations.cpp")


def load_cpu_kernel() -> ModuleType | None:
    """Build (or reuse) the kernel now; `make install` calls this so first use is quick."""
    return _cpu_kernel()
