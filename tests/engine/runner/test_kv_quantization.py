"""One-byte K/V blocks: scales, saturation, round-trip error bounds, and a block filled
token by token (the scale grows and the earlier codes follow it)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.runner.kv_quantization import (
    MIN_SCALE,
    dequantize,
    quantize,
    scale_for,
    write_quantized,
)

FP8 = torch.float8_e4m3fn
CODES = [torch.int8, FP8]


def test_scale_for_exact_values() -> None:
    absmax = torch.tensor([127.0, 254.0, 448.0, 449.0, 224.0, 0.0])
    int8 = torch.tensor([1.0, 2.0, 448 / 127, 449 / 127, 224 / 127, MIN_SCALE])  # fp32 values
    assert torch.equal(scale_for(absmax, torch.int8), int8)
    # fp8: the smallest power of two that brings absmax within 448.
    assert scale_for(absmax, FP8).tolist() == [0.5, 1.0, 1.0, 2.0, 0.5, MIN_SCALE]


def test_quantize_rounds_to_even_and_saturates() -> None:
    x = torch.tensor([200.0, -200.0, 2.5, 3.5, -2.5, 0.4])
    assert quantize(x, torch.int8).tolist() == [127, -127, 2, 4, -2, 0]
    y = torch.tensor([500.0, -1000.0, 448.0, 17.0, 1e-4, 0.0])
    # e4m3 spacing is 2 between 16 and 32: 17 ties to 16; 1e-4 is below half the smallest
    # subnormal (2^-9).
    assert quantize(y, FP8).float().tolist() == [448.0, -448.0, 448.0, 16.0, 0.0, 0.0]


def _block(dtype: torch.dtype, num_blocks: int = 3, kvh: int = 2, bs: int = 16, hd: int = 8):
    return torch.zeros(num_blocks, kvh, bs, hd, dtype=dtype), torch.zeros(num_blocks, kvh)


@pytest.mark.parametrize("dtype", CODES)
def test_round_trip_error_bound(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 2, 8, generator=gen) * 3
    codes, scales = _block(dtype)
    write_quantized(x, codes, scales, torch.full((16,), 1), torch.arange(16))
    s = scales[1]  # [kvh]
    assert torch.equal(s, scale_for(x.abs().amax(dim=(0, 2)), dtype))
    back = dequantize(codes[1], s, torch.float32).transpose(0, 1)  # [16, kvh, hd]
    err = (back - x).abs()
    if dtype == torch.int8:
        # Half a step of the block's scale.
        assert bool((err <= s[None, :, None] / 2 * (1 + 1e-6)).all())
    else:
        # Half an ulp of e4m3 (3 mantissa bits) for normal codes, half the smallest
        # subnormal step (2^-9 of the scale) below them.
        bound = torch.maximum(x.abs() * 2.0**-4, s[None, :, None] * 2.0**-10)
        assert bool((err <= bound).all())
    assert float(err.max()) > 0
    # The other blocks are untouched.
    assert not codes[0].float().any() and not codes[2].float().any()


def test_fp8_token_by_token_equals_one_write() -> None:
    # Magnitudes grow 16x across the block, so the scale grows at many steps; fp8 scales are
    # powers of two, so the requantized codes equal those of writing the block at once.
    gen = torch.Generator().manual_seed(1)
    sign = torch.randint(0, 2, (16, 2, 8), generator=gen) * 2 - 1
    x = sign * (0.5 + 0.5 * torch.rand(16, 2, 8, generator=gen)) * torch.arange(1, 17)[:, None, None]
    once, once_s = _block(FP8)
    write_quantized(x, once, once_s, torch.zeros(16, dtype=torch.long), torch.arange(16))
    step, step_s = _block(FP8)
    history = []
    for t in range(16):
        write_quantized(x[t : t + 1], step, step_s, torch.tensor([0]), torch.tensor([t]))
        history.append(step_s[0].clone())
    assert torch.equal(step.view(torch.uint8), once.view(torch.uint8))
    assert torch.equal(step_s, once_s)
    assert len({tuple(h.tolist()) for h in history}) >= 3  # it did grow several times


def test_int8_token_by_token_error_bound() -> None:
    # Each requantization adds at most half a step of the new scale: a token's error is
    # bounded by half the sum of the scales its block took from its write on.
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(16, 2, 8, generator=gen) * torch.arange(1, 17)[:, None, None] ** 0.5
    codes, scales = _block(torch.int8)
    history = []
    for t in range(16):
        write_quantized(x[t : t + 1], codes, scales, torch.tensor([0]), torch.tensor([t]))
        history.append(scales[0].clone())
    back = dequantize(codes[0], scales[0], torch.float32).transpose(0, 1)
    for t in range(16):
        taken = torch.stack(history[t:])  # [16 - t, kvh]
        distinct = [torch.unique(taken[:, h]).sum() for h in range(2)]
        bound = torch.stack(distinct)[:, None] / 2 * (1 + 1e-5)
        assert bool(((back[t] - x[t]).abs() <= bound).all()), t
    # The final scale is the block's absmax over 127.
    assert torch.equal(scales[0], scale_for(x.abs().amax(dim=(0, 2)), torch.int8))


@pytest.mark.parametrize("dtype", CODES)
def test_offset_zero_starts_the_block_fresh(dtype: torch.dtype) -> None:
    codes, scales = _block(dtype)
    big = torch.full((4, 2, 8), 1000.0)
    write_quantized(big, codes, scales, torch.full((4,), 2), torch.arange(4))
    small = torch.full((1, 2, 8), 1.0)
    write_quantized(small, codes, scales, torch.tensor([2]), torch.tensor([0]))
    # The new owner's first token sets the scale; the old tokens do not count.
    assert torch.equal(scales[2], scale_for(torch.tensor([1.0, 1.0]), dtype))
    assert dequantize(codes[2, :, :1], scales[2], torch.float32).unique().tolist() == [1.0]


@pytest.mark.parametrize("dtype", CODES)
def test_zeros_keep_a_finite_scale(dtype: torch.dtype) -> None:
    codes, scales = _block(dtype)
    write_quantized(torch.zeros(3, 2, 8), codes, scales, torch.full((3,), 0), torch.arange(3))
    assert scales[0].tolist() == [MIN_SCALE, MIN_SCALE]
    write_quantized(torch.full((1, 2, 8), -2.0), codes, scales, torch.tensor([0]), torch.tensor([3]))
    back = dequantize(codes[0], scales[0], torch.float32)
    assert back[:, :3].unique().tolist() == [0.0]
    assert back[:, 3].unique().tolist() == [-2.0]
