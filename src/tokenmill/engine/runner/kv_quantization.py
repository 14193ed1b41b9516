"""One-byte K/V blocks: fp8 (e4m3) or int8 codes with one fp32 scale per block, head and
K-or-V, and the torch version of writing into them.

    codes   [num_blocks, kvh, block_size, head_dim]   int8 or float8_e4m3fn
    scales  [num_blocks, kvh]                          float32, x ~= code * scale

A block of 16 tokens x 64 dims is 1,024 code bytes plus 4 scale bytes, against 2,048 bytes
in bf16: the same budget holds 1.99x the tokens.

Why per block, and how a block filled token by token keeps a sound scale: a block's scale
covers every token written into it so far. A write of new tokens into block b (one step
writes one run of consecutive offsets o0..o1 per block: a block belongs to one request)
takes

    s_old = scale[b]              (0 when o0 == 0: the block starts fresh, whatever it held)
    s_new = max(s_old, scale_for(absmax of the new tokens))
    codes[:o0] = Q(code * s_old / s_new)    only when s_new > s_old (the scale grew)
    codes[o0:o1] = Q(x / s_new)

so no code is ever clamped by a scale fixed too early: when a later token is larger, the
tokens already there are requantized to the larger scale. For fp8 the scale is a power of
two (the smallest one that puts absmax within +-448), so a requantization only shifts
exponents and is exact (except for values that fall into e4m3's subnormal range). For
int8 (scale = absmax / 127) a requantization rounds once more, adding at most half a step
of the new scale; a block's scale grows a few times in its 16 tokens (16 random values
set a new maximum ~2.4 times after the first), so its earliest tokens carry at most a few
half-steps of error. Measured on the default model, 1,024 tokens scored one token per step
(every write grows or keeps a scale): int8 +0.51% perplexity, fp8 +1.02%; all at once
+0.36% and +1.47% (quantization/quality.py cached_perplexity, tests/engine/quantization).

Q rounds to nearest even and saturates: int8 to [-127, 127], fp8 to +-448 (e4m3fn has no
infinity; its one NaN code is never produced). The C++ kernel's write_kv computes the same
fp32 operations in the same order, so both backends write bit-identical blocks.
"""

from __future__ import annotations

import torch

# Largest code magnitude of each one-byte type.
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
# Floor of every scale, so an all-zero block still divides by a finite number.
MIN_SCALE = 2.0**-64


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def scale_for(absmax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scale that maps absmax (fp32) onto the type's largest code (fp8: rounded up to
    a power of two)."""
    scale = absmax / QMAX[dtype]
    if dtype == torch.float8_e4m3fn:
        mantissa, exponent = torch.frexp(scale)
        exact = (mantissa == 0.5) | (scale == 0)
        scale = torch.where(exact, scale, torch.ldexp(torch.ones_like(scale), exponent))
    return scale.clamp_min(MIN_SCALE)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round fp32 values already divided by their scale to codes (saturating)."""
    qmax = QMAX[dtype]
    x = x.clamp(-qmax, qmax)
    if dtype == torch.int8:
        return torch.round(x).to(torch.int8)
    return x.to(dtype)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., n, hd] times their scale [...] -> values in `dtype`."""
    return (codes.to(torch.float32) * scale[..., None, None]).to(dtype)


def write_quantized(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
) -> None:
    """Store x [T, kvh, hd] at (blocks[t], offsets[t]) of codes/scales (see the top)."""
    dtype = codes.dtype
    block_size = codes.shape[2]
    uniq, inverse = torch.unique(blocks, return_inverse=True)
    # first[u]: the lowest offset written into block uniq[u]; the block's valid tokens
    # before this write are offsets < first[u].
    first = torch.full(uniq.shape, block_size, dtype=offsets.dtype, device=offsets.device)
    first = first.scatter_reduce(0, inverse, offsets, "amin")
    token_absmax = x.abs().amax(-1).float()  # [T, kvh]
    absmax = torch.zeros((len(uniq), x.shape[1]), dtype=torch.float32, device=x.device)
    absmax = absmax.scatter_reduce(0, inverse[:, None].expand_as(token_absmax), token_absmax, "amax")
    continued = (first > 0)[:, None]
    old = torch.where(continued, scales[uniq], 0.0)
    new = torch.maximum(old, scale_for(absmax, dtype))
    grown = continued & (new > old)  # [U, kvh]
    if bool(grown.any()):
        rows = torch.nonzero(grown.any(1)).flatten()
        held = codes[uniq[rows]]  # [G, kvh, bs, hd]
        requant = quantize(
            held.float() * old[rows][:, :, None, None] / new[rows][:, :, None, None], dtype
        )
        before = torch.arange(block_size, device=x.device)[None, :] < first[rows][:, None]
        keep = grown[rows][:, :, None, None] & before[:, None, :, None]
        codes[uniq[rows]] = torch.where(keep, requant, held)
    codes[blocks, :, offsets] = quantize(x.float() / new[inverse][:, :, None], dtype)
    scales[uniq] = new
