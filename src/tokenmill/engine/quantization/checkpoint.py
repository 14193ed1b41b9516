"""Writing a quantized checkpoint that loads directly (`tokenmill models quantize`).

The output is the HF directory `export_hf` writes (config, tokenizer, the float tensors in
model.safetensors), with the decoder projections left out of it and stored quantized in
model-quantized.safetensors instead:

    NAME.qweight  int8 [N, K] (int8), uint8 [N, K] (fp8 e4m3 bytes),
                  uint8 [N, K / 2] (int4: code 2j in the low nibble of byte j, 2j + 1 high)
    NAME.scales   float32 [N] or [N, K / group_size]
    NAME.zeros    float32 [N, K / group_size]  (int4 only)
    NAME.smooth   float32 [K]  (int8 only: SmoothQuant factors, calibrated as at load time)

and config.json's `quantization_config` = {"quant_method": "tokenmill", "method", "group_size"}
records the scheme, which the loader reads back (loader/safetensors.py). A GGUF's Q4 blocks
kept as int4 codes (load_checkpoint(keep_int4=True)) are written as they are.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from tokenmill.engine.loader.checkpoint import Checkpoint
from tokenmill.engine.loader.hf_export import export_hf
from tokenmill.engine.models.registry import build_model
from tokenmill.engine.quantization.config import QuantConfig
from tokenmill.engine.quantization.smoothing import (
    CALIBRATION_WINDOW,
    calibration_token_ids,
    smooth_projections,
)
from tokenmill.engine.quantization.weights import QuantizedWeight, pack_int4, quantize

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_projection(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in _PROJECTIONS


def save_quantized(checkpoint: Checkpoint, out_dir: str | Path, config: QuantConfig, dtype: str = "bfloat16") -> Path:
    """Write `checkpoint` with its projections quantized by `config`; returns the directory."""
    if checkpoint.quantization is not None and checkpoint.quantization != config:
        raise ValueError(f"the checkpoint is already {checkpoint.quantization.method}; it cannot become {config.method}")
    floats: dict[str, Any] = {}
    quantized: dict[str, QuantizedWeight] = {}
    smooth = _smoothing(checkpoint) if config.method == "int8" else {}
    for name, weight in checkpoint.weights.items():
        if isinstance(weight, QuantizedWeight):
            quantized[name] = weight
        elif is_projection(name):
            quantized[name] = quantize(weight, config, smooth.get(name))
        else:
            floats[name] = weight
    out = export_hf(dataclasses.replace(checkpoint, weights=floats), out_dir, dtype)
    tensors = {}
    for name, weight in sorted(quantized.items()):
        base = name.removesuffix(".weight")
        codes = pack_int4(weight.qweight) if weight.method == "int4" else weight.qweight
        tensors[f"{base}.qweight"] = codes.contiguous()
        tensors[f"{base}.scales"] = weight.scales.float().contiguous()
        if weight.zeros is not None:
            tensors[f"{base}.zeros"] = weight.zeros.float().contiguous()
        if weight.smooth is not None:
            tensors[f"{base}.smooth"] = weight.smooth.float().clone()  # q|k|v share theirs
    save_file(tensors, str(out / "model-quantized.safetensors"), metadata={"format": "pt"})
    config_path = out / "config.json"
    hf = json.loads(config_path.read_text(encoding="utf-8"))
    hf["quantization_config"] = {
        "quant_method": "tokenmill", "method": config.method,
        **({"group_size": config.group_size} if config.method == "int4" else {}),
    }
    config_path.write_text(json.dumps(hf, indent=2) + "\n", encoding="utf-8")
    return out


# A fused projection of the model -> the HF projections it is made of (they share its input).
_HF_PARTS = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}


def _smoothing(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """HF projection weight name -> SmoothQuant factors, calibrated as load-time int8
    weights are (smoothing.py) on the float model the checkpoint builds."""
    if any(isinstance(w, QuantizedWeight) for w in checkpoint.weights.values()):
        return {}
    model = build_model(checkpoint.config, CALIBRATION_WINDOW)
    model.load_weights(dict(checkpoint.weights))
    model.eval()
    factors = smooth_projections(model, tuple(_HF_PARTS), calibration_token_ids(checkpoint.tokenizer))
    return {
        f"model.layers.{i}.{part}.weight": s
        for (i, fused), s in factors.items() for part in _HF_PARTS[fused]
    }
