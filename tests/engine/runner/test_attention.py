"""Paged attention (C++ kernel and torch fallback) against a naive fp64 reference.

Batches are random but seeded: each request gets a context length, a number of query rows
(1 = decode, n = seq_len = fresh prefill, in between = chunked prefill over a cached
prefix), and a shuffled, non-contiguous set of block ids. The reference gathers each
request's K/V token by token from the cache and runs explicit softmax attention in fp64.
"""

from __future__ import annotations

import math

import pytest
import torch

from tokenmill.engine.runner.attention import AttentionMetadata, PagedAttention, load_cpu_kernel
from tokenmill.engine.runner.kv_quantization import QMAX, dequantize, write_quantized

BACKENDS = ["kernel", "torch"]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make_batch(
    requests: list[tuple[int, int]],
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """requests: (seq_len, num_query_rows). Returns q, k, v (new tokens), caches, metadata.

    The caches already hold every request's prefix; k/v are the new tokens, not yet written.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-seq // block_size) for seq, _ in requests]
    num_blocks = sum(blocks_per_req) + 7  # spare blocks stay garbage
    # Shuffled ids: each request's blocks are scattered and out of order.
    ids = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    max_blocks = max(blocks_per_req) + 2
    table = torch.full((len(requests), max_blocks), 10_000, dtype=torch.int32)  # padding: junk
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    used = 0
    slots, qsl = [], [0]
    for r, ((seq, n), nb) in enumerate(zip(requests, blocks_per_req, strict=True)):
        table[r, :nb] = ids[used : used + nb]
        used += nb
        for p in range(seq - n, seq):
            slots.append(int(table[r, p // block_size]) * block_size + p % block_size)
        qsl.append(qsl[-1] + n)
    num_tokens = qsl[-1]
    q = torch.randn(num_tokens, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    md = AttentionMetadata.build(
        block_table=table,
        seq_lens=torch.tensor([seq for seq, _ in requests], dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(n for _, n in requests),
        block_size=block_size,
    )
    return q, k, v, k_cache, v_cache, md


def reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: AttentionMetadata
) -> torch.Tensor:
    """Explicit per-request causal softmax attention in fp64 over gathered K/V."""
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for r in range(md.num_reqs):
        seq, start, n = md.seq_lens_host[r], md.query_start_host[r], md.query_len(r)
        pos = torch.arange(seq)
        blocks = md.block_table[r, pos // block_size].long()
        k = k_cache[blocks, :, pos % block_size].double()  # [seq, kvh, hd]
        v = v_cache[blocks, :, pos % block_size].double()
        for j in range(n):
            visible = seq - n + j + 1
            for h in range(q.shape[1]):
                kh = k[:visible, h // group]
                scores = kh @ q[start + j, h].double() / math.sqrt(q.shape[-1])
                out[start + j, h] = torch.softmax(scores, 0) @ v[:visible, h // group]
    return out


def attention(backend: str) -> PagedAttention:
    return PagedAttention("cpu", backend=backend)


CASES = {
    "decodes": [(384, 1), (17, 1), (1, 1), (100, 1), (33, 1)],
    "prefills": [(70, 70), (16, 16), (5, 5), (129, 129)],
    "chunked_prefix": [(150, 40), (64, 17), (31, 30)],
    "mixed": [(200, 1), (90, 90), (123, 45), (7, 1), (48, 2)],
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim"),
    [(3, 3, 64), (2, 1, 128), (1, 4, 64), (2, 4, 80), (1, 2, 40)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_matches_reference(
    backend: str, case: str, num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype
) -> None:
    q, k, v, k_cache, v_cache, md = make_batch(
        CASES[case],
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        seed=list(CASES).index(case) * 1000 + group * 200 + head_dim,
    )
    attn = attention(backend)
    attn.write_kv(k, v, k_cache, v_cache, md)
    out = attn.forward(q, k_cache, v_cache, md)
    assert out.dtype == dtype and out.shape == q.shape
    expected = reference(q, k_cache, v_cache, md)
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_other_block_sizes(backend: str, block_size: int) -> None:
    q, k, v, k_cache, v_cache, md = make_batch(
        [(75, 1), (40, 40), (66, 9)],
        num_kv_heads=3,
        group=3,
        head_dim=64,
        block_size=block_size,
        dtype=torch.float32,
        seed=block_size,
    )
    attn = attention(backend)
    attn.write_kv(k, v, k_cache, v_cache, md)
    out = attn.forward(q, k_cache, v_cache, md)
    torch.testing.assert_close(
        out.double(), reference(q, k_cache, v_cache, md), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_q_and_long_prefill(backend: str) -> None:
    # The model passes q as a view into the fused qkv projection: non-unit token stride.
    q, k, v, k_cache, v_cache, md = make_batch(
        [(300, 300), (520, 200)],
        num_kv_heads=3,
        group=3,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        seed=7,
    )
    qkv = torch.cat([q, k, v], dim=1)
    q_view, k_view, v_view = qkv[:, :9], qkv[:, 9:12], qkv[:, 12:]
    attn = attention(backend)
    attn.write_kv(k_view, v_view, k_cache, v_cache, md)
    out = attn.forward(q_view, k_cache, v_cache, md)
    torch.testing.assert_close(
        out.double(), reference(q, k_cache, v_cache, md), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_places_values_at_their_slots(backend: str, dtype: torch.dtype) -> None:
    _, k, v, k_cache, v_cache, md = make_batch(
        [(40, 3), (20, 20), (9, 1)],
        num_kv_heads=2,
        group=2,
        head_dim=64,
        block_size=8,
        dtype=dtype,
        seed=3,
    )
    before_k, before_v = k_cache.clone(), v_cache.clone()
    attention(backend).write_kv(k, v, k_cache, v_cache, md)
    slots = md.slot_mapping
    blocks, offsets = slots // 8, slots % 8
    assert torch.equal(k_cache[blocks, :, offsets], k)
    assert torch.equal(v_cache[blocks, :, offsets], v)
    # Every other slot is untouched.
    written = torch.zeros(k_cache.shape[0], 8, dtype=torch.bool)
    written[blocks, offsets] = True
    keep = ~written[:, None, :, None].expand_as(k_cache)
    assert torch.equal(k_cache[keep], before_k[keep])
    assert torch.equal(v_cache[keep], before_v[keep])


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_kv_skips_negative_slots(backend: str) -> None:
    _, k, v, k_cache, v_cache, md = make_batch(
        [(10, 4)],
        num_kv_heads=1,
        group=1,
        head_dim=64,
        block_size=4,
        dtype=torch.float32,
        seed=5,
    )
    md.slot_mapping[1] = -1
    before = k_cache.clone()
    attention(backend).write_kv(k, v, k_cache, v_cache, md)
    changed = (k_cache != before).any(dim=-1).nonzero().tolist()
    expected = sorted([int(s) // 4, 0, int(s) % 4] for i, s in enumerate(md.slot_mapping) if i != 1)
    assert sorted(changed) == expected


def test_dense_prefill_routing_matches_reference() -> None:
    # Fresh prompts >= 32 tokens go to contiguous SDPA; the rest stay on the kernel.
    q, k, v, k_cache, v_cache, md = make_batch(
        [(64, 64), (50, 10), (20, 1), (40, 40)],
        num_kv_heads=3,
        group=3,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        seed=11,
    )
    attn = PagedAttention("cpu", backend="kernel", dense_prefill_min_len=32)
    attn.write_kv(k, v, k_cache, v_cache, md)
    out = attn.forward(q, k_cache, v_cache, md)
    torch.testing.assert_close(
        out.double(), reference(q, k_cache, v_cache, md), atol=1e-5, rtol=1e-5
    )


def test_kernel_rejects_out_of_range_block_ids() -> None:
    q, _, _, k_cache, v_cache, md = make_batch(
        [(20, 1)],
        num_kv_heads=1,
        group=1,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        seed=1,
    )
    md.block_table[0, 1] = k_cache.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        attention("kernel").forward(q, k_cache, v_cache, md)


def test_kernel_builds_on_this_machine() -> None:
    assert load_cpu_kernel() is not None
    assert PagedAttention("cpu").backend == "kernel"
    assert PagedAttention("cpu", backend="torch").backend == "torch"


def test_build_failure_logs_and_returns_none(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path
) -> None:
    import tokenmill.engine.runner.attention as attention_module

    monkeypatch.setattr(attention_module, "_CSRC", tmp_path / "missing.cpp")
    with caplog.at_level("WARNING", logger=attention_module.__name__):
        assert attention_module.load_cpu_kernel.__wrapped__() is None
    assert "using the torch fallback" in caplog.text


def test_auto_falls_back_to_torch_when_the_kernel_is_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tokenmill.engine.runner.attention as attention_module

    monkeypatch.setattr(attention_module, "load_cpu_kernel", lambda: None)
    assert PagedAttention("cpu").backend == "torch"
    with pytest.raises(RuntimeError, match="unavailable"):
        PagedAttention("cpu", backend="kernel")


# ---------------------------------------------------------------- one-byte caches
CODE_DTYPES = [torch.int8, torch.float8_e4m3fn]
# Attention over the quantized cache against attention over the exact values, N(0, 1) data.
QUANTIZATION_ERROR = {torch.int8: 0.05, torch.float8_e4m3fn: 0.25}


def quantized_batch(requests, *, code_dtype, **kwargs):
    """make_batch with one-byte caches: each request's cached prefix is written in two
    chunks (so later writes grow scales and requantize), the new tokens are not. Also
    returns the exact caches, new tokens included, for the quantization error."""
    q, k, v, k_exact, v_exact, md = make_batch(requests, **kwargs)
    bs = md.block_size
    k_codes = torch.zeros(k_exact.shape, dtype=code_dtype)
    v_codes = torch.zeros(v_exact.shape, dtype=code_dtype)
    k_scale = torch.zeros(k_exact.shape[:2])
    v_scale = torch.zeros(k_exact.shape[:2])
    for r in range(md.num_reqs):
        cached = md.seq_lens_host[r] - md.query_len(r)
        for lo, hi in ((0, cached // 2), (cached // 2, cached)):
            if hi == lo:
                continue
            pos = torch.arange(lo, hi)
            blocks = md.block_table[r, pos // bs].long()
            write_quantized(k_exact[blocks, :, pos % bs], k_codes, k_scale, blocks, pos % bs)
            write_quantized(v_exact[blocks, :, pos % bs], v_codes, v_scale, blocks, pos % bs)
    slots = md.slot_mapping
    k_exact[slots // bs, :, slots % bs] = k
    v_exact[slots // bs, :, slots % bs] = v
    return q, k, v, (k_codes, v_codes, k_scale, v_scale), (k_exact, v_exact), md


@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    ("num_kv_heads", "group", "head_dim"), [(3, 3, 64), (2, 4, 80), (1, 2, 40)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_cache_kernel_and_torch_agree(
    code_dtype: torch.dtype, case: str, num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype
) -> None:
    q, k, v, caches, exact, md = quantized_batch(
        CASES[case], code_dtype=code_dtype, num_kv_heads=num_kv_heads, group=group,
        head_dim=head_dim, block_size=16, dtype=dtype, seed=head_dim + group,
    )
    results = {}
    for backend in BACKENDS:
        k_codes, v_codes, k_scale, v_scale = (t.clone() for t in caches)
        attn = attention(backend)
        attn.write_kv(k, v, k_codes, v_codes, md, (k_scale, v_scale))
        out = attn.forward(q, k_codes, v_codes, md, (k_scale, v_scale))
        assert out.dtype == dtype and out.shape == q.shape
        results[backend] = (out, k_codes, v_codes, k_scale, v_scale)
    kernel, fallback = results["kernel"], results["torch"]
    # Both backends write bit-identical codes and scales.
    for a, b in zip(kernel[1:], fallback[1:], strict=True):
        assert torch.equal(a.view(torch.uint8) if a.dtype == code_dtype else a,
                           b.view(torch.uint8) if b.dtype == code_dtype else b)
    _, k_codes, v_codes, k_scale, v_scale = kernel
    k_deq = dequantize(k_codes, k_scale, torch.float64)
    v_deq = dequantize(v_codes, v_scale, torch.float64)
    expected = reference(q, k_deq, v_deq, md)
    for out, *_ in (kernel, fallback):
        torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    error = (expected - reference(q, *exact, md)).abs().max()
    assert 0 < float(error) < QUANTIZATION_ERROR[code_dtype]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
@pytest.mark.parametrize("block_size", [1, 4, 32])
def test_quantized_cache_other_block_sizes(backend: str, code_dtype: torch.dtype, block_size: int) -> None:
    q, k, v, caches, _, md = quantized_batch(
        [(75, 1), (40, 40), (66, 9)], code_dtype=code_dtype, num_kv_heads=3, group=3,
        head_dim=64, block_size=block_size, dtype=torch.float32, seed=block_size,
    )
    k_codes, v_codes, k_scale, v_scale = caches
    attn = attention(backend)
    attn.write_kv(k, v, k_codes, v_codes, md, (k_scale, v_scale))
    out = attn.forward(q, k_codes, v_codes, md, (k_scale, v_scale))
    expected = reference(
        q, dequantize(k_codes, k_scale, torch.float64), dequantize(v_codes, v_scale, torch.float64), md
    )
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantized_cache_needs_its_scales(backend: str) -> None:
    q, k, v, caches, _, md = quantized_batch(
        [(20, 1)], code_dtype=torch.int8, num_kv_heads=1, group=1, head_dim=64,
        block_size=16, dtype=torch.float32, seed=1,
    )
    k_codes, v_codes, k_scale, v_scale = caches
    attn = attention(backend)
    with pytest.raises(ValueError, match="needs its scales"):
        attn.write_kv(k, v, k_codes, v_codes, md)
    with pytest.raises(ValueError, match="needs its scales"):
        attn.forward(q, k_codes, v_codes, md)
    with pytest.raises(ValueError, match="needs no scales"):
        attn.forward(q, k_scale.new_zeros(1, 1, 16, 64), k_scale.new_zeros(1, 1, 16, 64), md, (k_scale, v_scale))


@pytest.mark.parametrize("code_dtype", CODE_DTYPES)
def test_kernel_quantizes_every_magnitude_like_torch(code_dtype: torch.dtype) -> None:
    # One block: every code value, the midpoints between neighbouring codes (ties round to
    # even), values below the smallest subnormal, and log-uniform ones; absmax is the type's
    # largest code, so the scale is 1 and x / scale is x itself.
    codes = torch.arange(256, dtype=torch.uint8).view(torch.int8 if code_dtype == torch.int8 else code_dtype)
    values = codes.float()
    values = torch.unique(values[values.isfinite() & (values.abs() <= QMAX[code_dtype])])
    mids = (values[1:] + values[:-1]) / 2
    gen = torch.Generator().manual_seed(0)
    logs = torch.exp(torch.empty(1024).uniform_(-14, math.log(QMAX[code_dtype]), generator=gen))
    x = torch.cat([values, mids, torch.tensor([2.0**-11, -(2.0**-11), 0.0, -0.0]), logs])[: 16 * 64]
    x = x * torch.where(torch.rand(x.shape, generator=gen) < 0.5, -1.0, 1.0)
    x[0] = QMAX[code_dtype]
    x = x.view(16, 1, 64)
    md = AttentionMetadata.build(
        block_table=torch.zeros(1, 1, dtype=torch.int32), seq_lens=torch.tensor([16]),
        query_start_loc=torch.tensor([0, 16]), slot_mapping=torch.arange(16), max_query_len=16,
        block_size=16,
    )
    written = {}
    for backend in BACKENDS:
        k_codes = torch.zeros(1, 1, 16, 64, dtype=code_dtype)
        scales = (torch.zeros(1, 1), torch.zeros(1, 1))
        attention(backend).write_kv(x, x, k_codes, k_codes.clone(), md, scales)
        assert scales[0].item() == 1.0
        written[backend] = k_codes.view(torch.uint8)
    assert torch.equal(written["kernel"], written["torch"])
