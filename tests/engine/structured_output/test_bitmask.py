"""The bitmask kernel equals the torch reference, bit for bit."""

from __future__ import annotations

import torch

from tokenmill.engine.structured_output.bitmask import (
    allocate_bitmask,
    apply_token_bitmask_,
    apply_token_bitmask_torch_,
    load_cpu_kernel,
    masked_float,
)


def test_kernel_matches_reference_on_random_masks() -> None:
    assert load_cpu_kernel() is not None
    g = torch.Generator().manual_seed(0)
    vocab = 1000 + 7  # not a multiple of 32
    logits = torch.randn(6, vocab, generator=g)
    mask = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), generator=g, dtype=torch.int32)
    mask[0, :5] = -1
    mask[1, 3:9] = 0
    rows = torch.tensor([4, 0, 2])
    ours, ref = logits.clone(), logits.clone()
    apply_token_bitmask_(ours, mask, rows)
    apply_token_bitmask_torch_(ref, mask, rows)
    assert torch.equal(ours, ref)
    assert torch.equal(ours[[1, 3, 5]], logits[[1, 3, 5]])  # rows not named are untouched


def test_exact_tokens_masked() -> None:
    logits = torch.zeros(1, 70)
    mask = allocate_bitmask(1, 70)
    assert mask.shape == (1, 3) and bool((mask == -1).all())
    mask[0] = 0
    mask[0, 0] = 1 << 5
    mask[0, 2] = 1 << 1  # token 65
    apply_token_bitmask_(logits, mask, torch.tensor([0]))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [5, 65]


def test_vocabulary_past_the_mask_is_disallowed() -> None:
    logits = torch.zeros(1, 40)
    mask = torch.full((1, 1), -1, dtype=torch.int32)  # covers tokens 0..31 only
    apply_token_bitmask_(logits, mask, torch.tensor([0]))
    assert torch.isfinite(logits[0]).sum() == 32


def test_masked_float_is_the_conversion_then_the_mask_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(1)
    vocab = 1000 + 7  # not a multiple of 32: the tail word is partial
    logits = torch.randn(5, vocab, generator=g).bfloat16()
    mask = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), generator=g, dtype=torch.int32)
    mask[0, :4] = -1
    mask[2, 5:11] = 0
    rows = torch.tensor([3, 0, 4])
    ref = logits.float()
    apply_token_bitmask_torch_(ref, mask, rows)
    out = torch.full((5, vocab), 7.0)
    assert masked_float(logits, mask, rows, out=out) is out
    assert torch.equal(out, ref)
    assert torch.equal(out[[1, 2]], logits[[1, 2]].float())  # rows not named: plain conversion
    assert torch.equal(masked_float(logits, mask, rows), ref)  # no buffer: a fresh tensor


def test_masked_float_from_float32_and_a_short_mask() -> None:
    logits = torch.arange(80, dtype=torch.float32).view(2, 40)
    mask = torch.zeros(1, 1, dtype=torch.int32)  # covers tokens 0..31 only
    mask[0, 0] = 1 << 3
    bf16 = logits.bfloat16()
    out = masked_float(logits, mask, torch.tensor([1]), out=torch.empty(2, 40))
    assert out is logits  # float32: masked in place, no conversion into `out`
    assert torch.equal(out[0], torch.arange(40, dtype=torch.float32))
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [3] and out[1, 3] == 43.0
    assert torch.equal(masked_float(bf16, mask, torch.tensor([1])), out)
