"""int8 activations: the C++ ends equal their aten reference bit for bit, the int8 matmul
approximates the float one within its quantization error, and a row's result does not
depend on the rest of the batch."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.quantization import int8_activations as ia
from tokenmill.engine.quantization.config import QuantConfig
from tokenmill.engine.quantization.linear import QuantizedLinear
from tokenmill.engine.quantization.weights import quantize


def test_quantize_rows_by_hand() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5, 127.0], [0.0, 0.0, 0.0, 0.0], [-0.3, 0.3, 0.25, -0.6]])
    q, scale = ia.quantize_rows_torch(x, torch.tensor([1.0, 1.0, 1.0, 0.5]))
    # row 0: x * inv = [1, -2, 0.5, 63.5], scale 0.5 -> [2, -4, 1, 127]
    assert scale.tolist()[0] == 0.5 and q[0].tolist() == [2, -4, 1, 127]
    assert q[1].tolist() == [0, 0, 0, 0] and scale[1].item() == pytest.approx(1e-30)
    # row 2: amax 0.3 (0.6 * 0.5), scale 0.3 / 127: 0.25 -> 105.83 -> 106
    assert q[2].tolist() == [-127, 127, 106, -127]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize("smoothed", [False, True])
def test_kernels_equal_the_aten_reference(dtype, rows, smoothed) -> None:
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 96, generator=g) * 3).to(dtype)
    inv = torch.rand(96, generator=g) + 0.5 if smoothed else None
    q, scale = ia.quantize_rows(x, inv)
    want_q, want_scale = ia.quantize_rows_torch(x, inv)
    assert q.dtype == torch.int8 and torch.equal(q, want_q) and torch.equal(scale, want_scale)
    acc = torch.randint(-(1 << 20), 1 << 20, (rows, 40), dtype=torch.int32, generator=g)
    cols = torch.rand(40, generator=g) * 1e-3
    got = ia.dequantize_rows(acc, scale, cols, None, dtype)
    assert got.dtype == dtype and torch.equal(got, ia.dequantize_rows_torch(acc, scale, cols, None, dtype))
    bias = torch.randn(40, generator=g)
    # with a bias the kernel may fuse the multiply-add (one rounding fewer)
    got = ia.dequantize_rows(acc, scale, cols, bias, dtype).float()
    want = ia.dequantize_rows_torch(acc, scale, cols, bias, dtype).float()
    assert torch.allclose(got, want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_is_the_aten_composition(dtype) -> None:
    g = torch.Generator().manual_seed(3)
    qw = quantize(torch.randn(40, 96, generator=g), QuantConfig("int8"))
    x = torch.randn(6, 96, generator=g).to(dtype)
    inv = torch.rand(96, generator=g) + 0.5
    q, s = ia.quantize_rows_torch(x, inv)
    want = ia.dequantize_rows_torch(torch._int_mm(q, qw.qweight.t()), s, qw.scales, None, dtype)
    assert torch.equal(ia.int8_linear(x, qw.qweight, qw.scales, inv, None), want)


def test_int8_linear_is_the_float_matmul_within_quantization_error() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(128, 256, generator=g) * 0.05
    x = torch.randn(9, 256, generator=g)
    qw = quantize(w, QuantConfig("int8"))
    got = ia.int8_linear(x, qw.qweight, qw.scales, None, None)
    want = x @ w.t()
    # each operand within half a step of its row's scale: |err| <= |x| |dw| + |dx| |w| + ...
    bound = 0.5 * (x.abs().sum(1, keepdim=True) * qw.scales[None, :]
                   + (x.abs().amax(1, keepdim=True) / 127) * w.abs().sum(1)[None, :])
    err = (got - want).abs()
    assert (err <= bound * 1.01).all()
    assert err.max() < 0.02 * want.abs().max()


def test_a_rows_result_does_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(1)
    qw = quantize(torch.randn(64, 128, generator=g), QuantConfig("int8"), torch.rand(128, generator=g) + 0.5)
    layer = QuantizedLinear(qw, torch.randn(64, generator=g)).to(torch.bfloat16)
    layer.prepare()
    x = torch.randn(33, 128, generator=g).bfloat16()
    batch = layer(x)
    for i in (0, 17, 32):
        assert torch.equal(layer(x[i : i + 1]), batch[i : i + 1])


def test_smoothed_linear_runs_int8_activations_and_matches_the_dequantized_weight() -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 64, generator=g) * 0.1
    smooth = torch.rand(64, generator=g) * 4 + 0.25
    qw = quantize(w, QuantConfig("int8"), smooth)
    assert torch.allclose(qw.dequantize(), w, atol=0.5 * qw.scales.max().item() / smooth.min().item())
    bias = torch.randn(48, generator=g)
    layer = QuantizedLinear(qw, bias)
    layer.prepare()
    x = torch.randn(5, 64, generator=g)
    got = layer(x)
    inv = 1.0 / smooth
    assert torch.equal(got, ia.int8_linear(x, qw.qweight, qw.scales, inv, bias))
    want = x @ w.t() + bias
    assert (got - want).abs().max() < 0.05 * want.abs().max()
