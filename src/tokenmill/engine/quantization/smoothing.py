"""SmoothQuant factors: moving int8 activations' outliers into the weights.

int8 weights with int8 activations (int8_activations.py) quantize each token's input row
with one scale, so a few input channels that run 10-100x larger than the rest (the norm
weights make them) leave the others a handful of levels. SmoothQuant (Xiao et al., 2023)
divides input channel k by s_k and multiplies the weight's column k by it, exactly in
float, choosing

    s_k = max|X_k| ** alpha / max|W_k| ** (1 - alpha),   alpha = 0.5

from the largest activation |X_k| seen on a calibration text and the weight's largest
|W[:, k]| (over every output of a fused projection, which share one input). The
calibration text ships with Python and is not the evaluation text of quality.py: the
docstrings of a fixed list of standard-library modules, its first CALIBRATION_TOKENS
tokens. On the default model (bf16, 20k tokens of the pydoc topics) int8 activations cost
+3.3% perplexity without smoothing and +0.8% with it; in a prototype (bf16-rounded scales,
+1.3% at alpha 0.5) alpha 0.4 and 0.7 measured +1.5%.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Protocol, cast

import torch

from tokenmill.engine.models.llama import causal_attention

ALPHA = 0.5
CALIBRATION_TOKENS = 2048
CALIBRATION_WINDOW = 512
CALIBRATION_MODULES = (
    "json", "re", "collections", "argparse", "typing", "asyncio", "functools", "itertools",
    "pathlib", "subprocess", "unittest", "logging", "dataclasses", "datetime", "decimal",
)


class _Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


def calibration_text() -> str:
    docs = (importlib.import_module(name).__doc__ for name in CALIBRATION_MODULES)
    return "\n\n".join(doc for doc in docs if doc)


def calibration_token_ids(tokenizer: _Encoder, num_tokens: int = CALIBRATION_TOKENS) -> list[int]:
    return tokenizer.encode(calibration_text())[:num_tokens]


@torch.inference_mode()
def activation_amax(
    model: torch.nn.Module, modules: Sequence[torch.nn.Module], token_ids: Sequence[int],
    window: int = CALIBRATION_WINDOW,
) -> list[torch.Tensor]:
    """Per input channel, the largest |input| each of `modules` (linears inside `model`)
    sees while `model` reads `token_ids` in windows of `window` tokens: float32 [K] each."""
    if not token_ids:
        raise ValueError("calibration needs at least one token")
    amax: list[torch.Tensor | None] = [None] * len(modules)

    def observer(i: int):
        def hook(_module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            seen = args[0].detach().abs().float().amax(dim=0)
            before = amax[i]
            amax[i] = seen if before is None else torch.maximum(before, seen)
        return hook

    handles = [m.register_forward_pre_hook(observer(i)) for i, m in enumerate(modules)]
    device = next(model.parameters()).device
    try:
        for start in range(0, len(token_ids), window):
            ids = torch.tensor(list(token_ids[start : start + window]), device=device)
            model(ids, torch.arange(len(ids), device=device), causal_attention)
    finally:
        for handle in handles:
            handle.remove()
    assert all(a is not None for a in amax)
    return [a for a in amax if a is not None]


def smooth_projections(
    model: torch.nn.Module, projections: Sequence[str], token_ids: Sequence[int], alpha: float = ALPHA
) -> dict[tuple[int, str], torch.Tensor]:
    """(layer index, projection name) -> s [K] for every float nn.Linear projection of
    model.layers, calibrated on `token_ids` (see the top)."""
    layers = cast(torch.nn.ModuleList, model.layers)
    targets = [
        (i, name) for i, layer in enumerate(layers) for name in projections
        if isinstance(getattr(layer, name), torch.nn.Linear)
    ]
    linears = [getattr(layers[i], name) for i, name in targets]
    amax = activation_amax(model, linears, token_ids) if targets else []
    return {
        key: smoothing_factors(a, m.weight, alpha) for key, a, m in zip(targets, amax, linears, strict=True)
    }


def smoothing_factors(act_amax: torch.Tensor, weight: torch.Tensor, alpha: float = ALPHA) -> torch.Tensor:
    """s [K] for a weight [N, K] whose inputs peaked at act_amax [K] (see the top)."""
    w_amax = weight.detach().float().abs().amax(dim=0).clamp(min=1e-5)
    return (act_amax.float().clamp(min=1e-5) ** alpha / w_amax ** (1.0 - alpha)).clamp(min=1e-5)
