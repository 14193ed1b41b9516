"""EngineCore on the tiny model with one-byte K/V blocks: greedy generation completes
through chunked prefill and decode, frees every block, and stays close to fp32 K/V."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.engine.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.request import Request, SamplingParams
from tokenmill.engine.runner.kv_cache_tensors import bytes_per_block

NUM_BLOCKS = 64
MIN_AGREEMENT = {"int8": 0.9, "fp8": 0.5}


def make_core(config, weights, kv_cache_dtype: str) -> EngineCore:
    budget = NUM_BLOCKS * bytes_per_block(config, 16, torch.float32, kv_cache_dtype)
    return EngineCore(
        EngineConfig(
            model=config,
            cache=CacheConfig(
                block_size=16, kv_cache_memory_bytes=budget, enable_prefix_caching=False,
                kv_cache_dtype=kv_cache_dtype,
            ),
            # 32-token steps: long prompts prefill in chunks that read the quantized blocks.
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=512),
            device=DeviceConfig(dtype="float32"),
        ),
        weights,
    )


def generate(core: EngineCore, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=12)
    for i, prompt in enumerate(prompts):
        core.add_request(Request(str(i), prompt, params))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished_requests():
        for o in core.step():
            out[o.req_id].extend(o.new_token_ids)
    return [out[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(128) for _ in range(rng.randrange(5, 90))] for _ in range(6)]


@pytest.fixture(scope="module")
def reference(tiny_config, tiny_model_weights, prompts) -> list[list[int]]:
    return generate(make_core(tiny_config, tiny_model_weights, "auto"), prompts)


@pytest.mark.parametrize(("kv_cache_dtype", "stored"), [("fp8", torch.float8_e4m3fn), ("int8", torch.int8)])
def test_greedy_with_one_byte_kv(tiny_config, tiny_model_weights, prompts, reference, kv_cache_dtype, stored) -> None:
    core = make_core(tiny_config, tiny_model_weights, kv_cache_dtype)
    runner = core.runner
    assert runner.kv_cache.dtype == stored and runner.num_blocks == NUM_BLOCKS
    outputs = generate(core, prompts)
    assert [len(o) for o in outputs] == [12] * len(prompts)
    # No block leaked.
    assert core.scheduler.kv_cache.num_free_blocks == NUM_BLOCKS
    # The prefills (chunked: later chunks read quantized K/V) pick the reference's first
    # token everywhere; over the decodes the random tiny model's near-ties flip some tokens
    # (measured: 70 of 72 agree for int8, 42 of 72 for fp8's 3-bit mantissas).
    assert [o[0] for o in outputs] == [r[0] for r in reference]
    same = sum(a == b for out, ref in zip(outputs, reference, strict=True) for a, b in zip(out, ref, strict=True))
    assert same >= MIN_AGREEMENT[kv_cache_dtype] * 72
