"""QuantizedLinear: y = x W^T + b with W held as quantized codes.

Kernels, by method (activations in the model's dtype, float32 or bfloat16):
    int8  with SmoothQuant factors (the default when quantizing at load time) on the CPU:
          int8 activations, torch._int_mm (int8_activations.py); otherwise weight-only
          torch._weight_int8pack_mm(x / smooth, q [N, K] int8, scales [N]), CPU and CUDA
    int4  CPU: torch._weight_int4pack_mm_for_cpu(x, packed, g, scale_and_zero [K/g, N, 2]),
          packed once by _convert_weight_to_int4pack_for_cpu; elsewhere the codes are
          dequantized per call (correct, not fast)
    fp8   the e4m3 codes are widened to the activation dtype and scaled per call (no CPU
          fp8 matmul exists); on CUDA the same
Scales and zero points follow the module's dtype when the model is moved (`.to`); the
codes are integer tensors and stay as they are (fp8 codes are kept as uint8 for that
reason). `prepare()` builds the device-specific packing after the move.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill.engine.quantization.int8_activations import bind_int8_linear
from tokenmill.engine.quantization.weights import QuantizedWeight


class QuantizedLinear(torch.nn.Module):
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    smooth: torch.Tensor | None
    bias: torch.Tensor | None

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.method = weight.method
        self.group_size = weight.group_size
        self.out_features, self.in_features = weight.shape
        self.register_buffer("qweight", weight.qweight.contiguous())
        self.register_buffer("scales", weight.scales.float().contiguous())
        self.register_buffer("zeros", None if weight.zeros is None else weight.zeros.float().contiguous())
        self.register_buffer("smooth", None if weight.smooth is None else weight.smooth.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        # The int8-activation path's float32 factors, kept out of the buffers so that moving
        # the model to bfloat16 does not round them; prepare() moves them to the device.
        self._scales_f32 = weight.scales.float().contiguous()
        self._inv_smooth = None if weight.smooth is None else (1.0 / weight.smooth.float()).contiguous()
        self._bias_f32 = None if bias is None else bias.detach().float().contiguous()
        self._packed: torch.Tensor | None = None
        self._int8_call: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._scale_and_zero: torch.Tensor | None = None

    @property
    def weight_bytes(self) -> int:
        codes = self.qweight.numel() // 2 if self.method == "int4" else self.qweight.numel()
        meta = sum(t.numel() for t in (self.scales, self.zeros, self.smooth) if t is not None)
        return codes + meta * self.scales.element_size()

    def prepare(self) -> None:
        """Pack for the kernel of the device the module now lives on."""
        device = self.qweight.device
        self._scales_f32 = self._scales_f32.to(device)
        if self._inv_smooth is not None:
            self._inv_smooth = self._inv_smooth.to(device)
        if self._bias_f32 is not None:
            self._bias_f32 = self._bias_f32.to(device)
        self._int8_call = None
        if self._inv_smooth is not None and device.type == "cpu":
            self._int8_call = bind_int8_linear(self.qweight, self._scales_f32, self._inv_smooth, self._bias_f32)
        if self.method == "int4" and self.qweight.device.type == "cpu":
            assert self.zeros is not None
            self._packed = torch._convert_weight_to_int4pack_for_cpu(self.qweight.to(torch.int32), 1)
            # [N, K/g] x 2 -> [K/g, N, 2]
            self._scale_and_zero = torch.stack([self.scales, self.zeros], dim=-1).transpose(0, 1).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] -> [T, out_features]
        if self._int8_call is not None:
            return self._int8_call(x)
        if self.method == "int8":
            if self._inv_smooth is not None:
                x = x * self._inv_smooth.to(x.dtype)
            y = torch._weight_int8pack_mm(x, self.qweight, self.scales.to(x.dtype))
        elif self.method == "int4" and self._packed is not None:
            assert self._scale_and_zero is not None
            y = torch._weight_int4pack_mm_for_cpu(
                x, self._packed, self.group_size, self._scale_and_zero.to(x.dtype)
            )
        else:
            y = torch.nn.functional.linear(x, self._dequantized(x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def _dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if self.method == "int8":
            w = self.qweight.to(dtype) * self.scales.to(dtype)[:, None]
            return w if self.smooth is None else w / self.smooth.to(dtype)[None, :]
        if self.method == "fp8":
            w = self.qweight.view(torch.float8_e4m3fn).to(dtype)
            return w * self.scales.to(dtype)[:, None]
        assert self.zeros is not None
        g = self.group_size
        codes = self.qweight.to(dtype) - 8
        return (codes.view(self.out_features, -1, g) * self.scales.to(dtype)[..., None]
                + self.zeros.to(dtype)[..., None]).view(self.out_features, self.in_features)
