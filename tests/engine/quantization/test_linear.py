"""QuantizedLinear: each kernel equals x @ dequantize(W)^T (float32 exactly, up to
accumulation order)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.quantization.apply import quantize_linears, weight_bytes
from tokenmill.engine.quantization.config import QuantConfig
from tokenmill.engine.quantization.linear import QuantizedLinear
from tokenmill.engine.quantization.weights import quantize


@pytest.mark.parametrize(("method", "group"), [("int8", 0), ("fp8", 0), ("int4", 32), ("int4", 64), ("int4", 128)])
@pytest.mark.parametrize("shape", [(96, 128), (576, 1536)])
def test_kernel_equals_dequantized_matmul(method, group, shape) -> None:
    g = torch.Generator().manual_seed(0)
    n, k = shape
    qw = quantize(torch.randn(n, k, generator=g) * 0.05, QuantConfig(method, group or 32))
    bias = torch.randn(n, generator=g)
    layer = QuantizedLinear(qw, bias)
    layer.prepare()
    x = torch.randn(5, k, generator=g)
    want = x @ qw.dequantize().t() + bias
    assert torch.allclose(layer(x), want, atol=1e-4, rtol=1e-4)
    bf16 = QuantizedLinear(qw, bias).to(torch.bfloat16)
    bf16.prepare()
    got = bf16(x.bfloat16()).float()
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


def test_quantize_linears_swaps_only_decoder_projections(tiny_config, tiny_model_weights) -> None:
    from tokenmill.engine.models.llama import LlamaForCausalLM

    model = LlamaForCausalLM(tiny_config, 64)
    model.load_weights(dict(tiny_model_weights))
    before = weight_bytes(model)
    assert quantize_linears(model, QuantConfig("int8")) == 4 * tiny_config.num_layers
    assert isinstance(model.lm_head, torch.nn.Linear)
    assert all(isinstance(layer.qkv_proj, QuantizedLinear) for layer in model.layers)
    # float32 projections (4 bytes a weight) -> 1 byte + a float32 scale per row
    projection_params = sum(
        getattr(layer, n).qweight.numel() for layer in model.layers for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    )
    rows = sum(getattr(layer, n).out_features for layer in model.layers for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    assert before - weight_bytes(model) == 3 * projection_params - 4 * rows
