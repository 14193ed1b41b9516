"""KV block tensors: block counts for a budget (one-byte blocks hold ~2x the tokens, scales
included), shapes and dtypes, and refusals."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.config import CacheConfig, ModelConfig
from tokenmill.engine.runner.kv_cache_tensors import (
    KVCacheTensors,
    bytes_per_block,
    resolve_kv_cache_dtype,
)

# The default model's attention shape (SmolLM2-135M): 30 layers, 3 KV heads of 64.
SMOLLM2 = ModelConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64,
)
GIB = 1 << 30


def test_bytes_per_block_counts_the_scales() -> None:
    # 2 (K, V) x 30 layers x 3 heads x 16 tokens x 64 dims, x 2 bytes in bf16; one byte
    # per element plus one float32 scale per (layer, K/V, head) for the codes.
    assert bytes_per_block(SMOLLM2, 16, torch.bfloat16) == 368_640
    assert bytes_per_block(SMOLLM2, 16, torch.float32) == 737_280
    assert bytes_per_block(SMOLLM2, 16, torch.bfloat16, "fp8") == 2 * 30 * 3 * (16 * 64 + 4) == 185_040
    assert bytes_per_block(SMOLLM2, 16, torch.bfloat16, "int8") == 185_040


def test_one_byte_blocks_double_the_tokens_per_gib() -> None:
    counts = {}
    for kv_dtype in ("auto", "fp8", "int8"):
        cache = CacheConfig(block_size=16, kv_cache_memory_bytes=GIB, kv_cache_dtype=kv_dtype)
        per_block = bytes_per_block(SMOLLM2, 16, torch.bfloat16, kv_dtype)
        counts[kv_dtype] = GIB // per_block
        assert cache.kv_cache_memory_bytes // per_block == counts[kv_dtype]
    assert counts == {"auto": 2912, "fp8": 5802, "int8": 5802}
    # KV tokens per GiB: 46,592 in bf16, 92,832 in fp8/int8 (1.99x).
    assert counts["auto"] * 16 == 46_592 and counts["fp8"] * 16 == 92_832


@pytest.mark.parametrize(
    ("kv_dtype", "stored"), [("auto", torch.bfloat16), ("fp8", torch.float8_e4m3fn), ("int8", torch.int8)]
)
def test_allocate_fills_the_budget(tiny_config, kv_dtype: str, stored: torch.dtype) -> None:
    per_block = bytes_per_block(tiny_config, 16, torch.bfloat16, kv_dtype)
    budget = 10 * per_block + per_block - 1  # ten blocks and change
    cache = CacheConfig(block_size=16, kv_cache_memory_bytes=budget, kv_cache_dtype=kv_dtype)
    kv = KVCacheTensors.allocate(tiny_config, cache, torch.bfloat16, torch.device("cpu"))
    assert kv.num_blocks == 10 and kv.dtype == stored
    assert kv.num_bytes == 10 * per_block <= budget
    k_cache, v_cache = kv.layer(1)
    assert k_cache.shape == v_cache.shape == (10, 2, 16, 16) and k_cache.is_contiguous()
    scales = kv.layer_scales(1)
    if kv_dtype == "auto":
        assert scales is None and kv.scales is None
    else:
        assert scales is not None
        assert scales[0].shape == scales[1].shape == (10, 2)
        assert scales[0].dtype == torch.float32 and scales[0].is_contiguous()


def test_allocate_blocks_gives_the_count_asked(tiny_config) -> None:
    kv = KVCacheTensors.allocate_blocks(tiny_config, 7, 8, torch.float32, "cpu", "int8")
    assert kv.kv.shape == (2, 2, 7, 2, 8, 16) and kv.dtype == torch.int8
    assert kv.scales is not None and kv.scales.shape == (2, 2, 7, 2)
    assert KVCacheTensors.allocate_blocks(tiny_config, 7, 8, torch.float32, "cpu").dtype == torch.float32
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        KVCacheTensors.allocate_blocks(tiny_config, 0, 8, torch.float32, "cpu")


def test_refusals(tiny_config) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, int8, got 'fp16'"):
        CacheConfig(kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        resolve_kv_cache_dtype("e5m2", torch.bfloat16)
    small = CacheConfig(kv_cache_memory_bytes=100, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="holds no block of 2080 bytes"):
        KVCacheTensors.allocate(tiny_config, small, torch.float32, torch.device("cpu"))
