"""Quantized weights: exact codes on hand-made weights, round-trip error bounds, GGUF
blocks taken over bit-exactly, fused rows, row permutations."""

from __future__ import annotations

import struct

import pytest
import torch

from tokenmill.engine.quantization.config import QuantConfig
from tokenmill.engine.quantization.weights import cat_rows, from_gguf_q4, from_gguf_q8, quantize


def test_int8_codes_and_scales_exact() -> None:
    w = torch.tensor([[1.27, -0.635, 0.0], [0.0, 2.54, -2.54]])
    q = quantize(w, QuantConfig("int8"))
    assert q.qweight.tolist() == [[127, -64, 0], [0, 127, -127]]
    assert torch.allclose(q.scales, torch.tensor([0.01, 0.02]))


def test_int4_group_codes_exact() -> None:
    with pytest.raises(ValueError, match="group size must be one of"):
        QuantConfig("int4", 4)
    w = torch.arange(64, dtype=torch.float32).view(1, 64) / 2  # two groups of 32: 0..15.5, 16..31.5
    q = quantize(w, QuantConfig("int4", 32))
    scale = torch.tensor(15.5) / 15  # float32, as the quantizer computes it
    assert torch.equal(q.scales, scale.expand(1, 2))
    assert torch.equal(q.zeros, torch.stack([8 * scale, 16 + 8 * scale]).view(1, 2))
    assert q.qweight[0, :32].tolist() == torch.round(w[0, :32] / scale).int().tolist()
    assert q.qweight[0, :32].tolist() == q.qweight[0, 32:].tolist()  # same shape, shifted by 16


@pytest.mark.parametrize(("method", "bound"), [("int8", 0.5 / 127), ("fp8", 1 / 16), ("int4", 0.5 / 15)])
def test_round_trip_error_bounds(method, bound) -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=g)
    q = quantize(w, QuantConfig(method, 32))
    err = (q.dequantize() - w).abs()
    if method == "int4":
        span = w.view(64, 8, 32).amax(-1) - w.view(64, 8, 32).amin(-1)
        assert bool((err.view(64, 8, 32) <= bound * span[..., None] + 1e-6).all())
    elif method == "int8":
        assert bool((err <= bound * w.abs().amax(1, keepdim=True) + 1e-6).all())
    else:  # e4m3: 3 mantissa bits, relative error <= 2^-4 (plus subnormal floor)
        assert bool((err <= bound * w.abs() + 1e-3 * w.abs().amax(1, keepdim=True)).all())


def q4_block(d: float, m: float | None, codes: list[int]) -> bytes:
    packed = bytes(codes[j] | (codes[j + 16] << 4) for j in range(16))
    head = struct.pack("<e", d) + (struct.pack("<e", m) if m is not None else b"")
    return head + packed


@pytest.mark.parametrize("with_min", [False, True])
def test_gguf_q4_blocks_taken_over_exactly(with_min) -> None:
    codes = [(7 * i + 3) % 16 for i in range(64)]
    raw = q4_block(0.5, -1.25 if with_min else None, codes[:32]) + q4_block(0.25, 0.75 if with_min else None, codes[32:])
    blocks = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(2, -1)
    q = from_gguf_q4(blocks, with_min, (1, 64))
    assert q.qweight[0].tolist() == codes and q.group_size == 32
    want = [0.5 * c + (-1.25 if with_min else -4.0) for c in codes[:32]]
    want += [0.25 * c + (0.75 if with_min else -2.0) for c in codes[32:]]
    assert q.dequantize()[0].tolist() == want


def q8_block(d: float, codes: list[int]) -> bytes:
    return struct.pack("<e", d) + struct.pack("<32b", *codes)


def test_gguf_q8_blocks_become_int8_rows_from_their_codes() -> None:
    codes = [(11 * i) % 255 - 127 for i in range(64)]  # reaches -127 and 127
    # row 0: both blocks at d = 0.5 -> the codes as they are, scale 0.5
    # row 1: d = 0.5 then 0.125 -> row scale 0.5, second block's codes / 4, rounded (half to even)
    raw = q8_block(0.5, codes[:32]) + q8_block(0.5, codes[32:]) + q8_block(0.5, codes[:32]) + q8_block(0.125, codes[32:])
    blocks = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(4, 34)
    q = from_gguf_q8(blocks, (2, 64), rows_per_chunk=1)
    assert q.method == "int8" and q.scales.tolist() == [0.5, 0.5]
    assert q.qweight[0].tolist() == codes
    assert q.qweight[1].tolist() == codes[:32] + [round(c / 4) for c in codes[32:]]
    assert all(abs(w - x) <= 0.25 for w, x in zip(q.dequantize()[1, 32:].tolist(), [0.125 * c for c in codes[32:]], strict=True))


def test_fused_rows_and_permutation() -> None:
    g = torch.Generator().manual_seed(1)
    a, b = (quantize(torch.randn(n, 64, generator=g), QuantConfig("int4", 32)) for n in (4, 2))
    fused = cat_rows([a, b])
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    flipped = fused.map_rows(lambda t: t.flip(0))
    assert torch.equal(flipped.dequantize(), fused.dequantize().flip(0))
    i8 = quantize(torch.randn(3, 8, generator=g), QuantConfig("int8"))
    assert torch.equal(i8.map_rows(lambda t: t.flip(0)).dequantize(), i8.dequantize().flip(0))
    with pytest.raises(ValueError, match="quantized differently"):
        cat_rows([a, i8])


def test_only_int4_groups_of_32_take_gguf_blocks_over() -> None:
    assert QuantConfig("int4", 32).takes_gguf_int4
    assert not QuantConfig("int4", 64).takes_gguf_int4
    assert not QuantConfig("int8").takes_gguf_int4
    assert QuantConfig("int8").takes_gguf_int8 and not QuantConfig("int4").takes_gguf_int8
