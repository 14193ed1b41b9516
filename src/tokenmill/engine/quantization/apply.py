"""Swapping a model's float projections for quantized ones.

Only the decoder layers' projections (q|k|v, o, gate|up, down) are quantized: they hold
~80% of the default model's weights and all of its per-layer matmuls. The token
embedding and the (tied) LM head stay in the model's dtype: at 49k x 576 the head is one
matmul per step, and quantizing the embedding it shares costs the most quality per byte.
int8 weights given calibration tokens get SmoothQuant factors (smoothing.py) and then run
with int8 activations (int8_activations.py); without them they stay weight-only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from tokenmill.engine.quantization.config import QuantConfig
from tokenmill.engine.quantization.linear import QuantizedLinear
from tokenmill.engine.quantization.smoothing import smooth_projections
from tokenmill.engine.quantization.weights import quantize

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def quantize_linears(
    model: torch.nn.Module, config: QuantConfig, calibration_ids: Sequence[int] | None = None
) -> int:
    """Replace each float projection of each of model.layers; returns how many.
    `calibration_ids` (int8 only): smooth for int8 activations, calibrated on these tokens."""
    smooth: dict[tuple[int, str], torch.Tensor] = {}
    if calibration_ids and config.method == "int8":
        smooth = smooth_projections(model, PROJECTIONS, calibration_ids)
    count = 0
    for i, layer in enumerate(cast(torch.nn.ModuleList, model.layers)):
        for name in PROJECTIONS:
            module = getattr(layer, name)
            if isinstance(module, torch.nn.Linear):
                weight = quantize(module.weight, config, smooth.get((i, name)))
                setattr(layer, name, QuantizedLinear(weight, module.bias))
                count += 1
    return count


def prepare_quantized(model: torch.nn.Module) -> int:
    """Pack every QuantizedLinear for its device (after the model has moved)."""
    modules = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    for m in modules:
        m.prepare()
    return len(modules)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's weights occupy (quantized codes and their scales included)."""
    total = 0
    seen: set[int] = set()
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            total += m.weight_bytes
            continue
        for t in list(m.parameters(recurse=False)) + list(m.buffers(recurse=False)):
            key = id(t) if t is None or t.is_mkldnn else t.data_ptr()  # packed oneDNN weights have no storage
            if t is not None and key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total
