"""SmoothQuant factors: the formula, the calibration observers, and the fused projections'
shared factors."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.models.llama import LlamaForCausalLM, causal_attention
from tokenmill.engine.quantization.apply import PROJECTIONS, quantize_linears
from tokenmill.engine.quantization.config import QuantConfig
from tokenmill.engine.quantization.smoothing import (
    activation_amax,
    calibration_text,
    smooth_projections,
    smoothing_factors,
)
from tokenmill.engine.quantization.weights import cat_rows, quantize


def test_smoothing_factors_by_hand() -> None:
    act = torch.tensor([16.0, 1.0, 0.0])
    weight = torch.tensor([[1.0, -4.0, 2.0], [-0.25, 1.0, 0.0]])
    # sqrt(16) / sqrt(1) = 4, sqrt(1) / sqrt(4) = 0.5, sqrt(1e-5) / sqrt(2)
    s = smoothing_factors(act, weight)
    assert s[:2].tolist() == [4.0, 0.5]
    assert s[2].item() == pytest.approx((1e-5) ** 0.5 / 2**0.5)


def test_calibration_text_ships_with_python_and_is_not_the_evaluation_text() -> None:
    from tokenmill.engine.quantization.quality import evaluation_text

    text = calibration_text()
    assert len(text) > 10_000 and text[:200] not in evaluation_text()


@pytest.fixture
def model(tiny_config, tiny_model_weights) -> LlamaForCausalLM:
    m = LlamaForCausalLM(tiny_config, 64)
    m.load_weights(dict(tiny_model_weights))
    return m.eval()


def test_activation_amax_is_the_largest_input_each_linear_saw(model) -> None:
    ids = list(range(3, 40))
    layer = model.layers[1]
    seen: list[torch.Tensor] = []
    handle = layer.down_proj.register_forward_hook(lambda _m, args, _out: seen.append(args[0].abs().amax(0)))
    amax = activation_amax(model, [layer.o_proj, layer.down_proj], ids, window=16)
    handle.remove()
    assert len(seen) == 3  # windows of 16, 16 and 5 tokens
    assert torch.equal(amax[1], torch.stack(seen).amax(0))
    assert amax[0].shape == (layer.o_proj.in_features,)
    assert not any(m._forward_pre_hooks for m in model.modules())  # observers removed


def test_fused_projections_get_one_set_of_factors(model) -> None:
    ids = list(range(3, 30))
    factors = smooth_projections(model, PROJECTIONS, ids)
    assert sorted(factors) == sorted((i, n) for i in range(len(model.layers)) for n in PROJECTIONS)
    with torch.inference_mode():
        x = model.embed_tokens(torch.tensor(ids))
    assert factors[(0, "qkv_proj")].shape == (x.shape[1],)
    quantize_linears(model, QuantConfig("int8"), ids)
    assert torch.equal(model.layers[0].qkv_proj.smooth, factors[(0, "qkv_proj")])
    with torch.inference_mode():
        out = model(torch.tensor(ids), torch.arange(len(ids)), causal_attention)
    assert torch.isfinite(out).all()


def test_without_calibration_int8_stays_weight_only(model) -> None:
    quantize_linears(model, QuantConfig("int8"))
    assert all(layer.down_proj.smooth is None for layer in model.layers)


def test_smoothing_is_int8_only_and_fusing_needs_equal_factors() -> None:
    w = torch.randn(4, 8)
    with pytest.raises(ValueError, match="int8 weights, not fp8"):
        quantize(w, QuantConfig("fp8"), torch.ones(8))
    a = quantize(w, QuantConfig("int8"), torch.ones(8))
    b = quantize(w, QuantConfig("int8"), torch.full((8,), 2.0))
    assert cat_rows([a, a]).smooth is a.smooth
    with pytest.raises(ValueError, match="different smoothing factors"):
        cat_rows([a, b])
    with pytest.raises(ValueError, match="different smoothing factors"):
        cat_rows([a, quantize(w, QuantConfig("int8"))])
