"""EngineCore end to end on a tiny random model: paged, batched, chunked, cached and
preempted decoding all give exactly the tokens of a cache-free greedy reference."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from tokenmill.engine.core import EngineCore
from tokenmill.engine.models.llama import LlamaForCausalLM, causal_attention
from tokenmill.engine.request import Request, SamplingParams
from tokenmill.engine.runner.kv_cache_tensors import bytes_per_block

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def make_core(
    config: ModelConfig,
    weights,
    *,
    num_blocks: int = 256,
    max_num_seqs: int = 16,
    max_batched: int = 256,
    prefix_caching: bool = True,
) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=config,
            cache=CacheConfig(
                block_size=16,
                kv_cache_memory_bytes=num_blocks * bytes_per_block(config, 16, torch.float32),
                enable_prefix_caching=prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched, max_model_len=512
            ),
            device=DeviceConfig(dtype="float32"),
        ),
        weights,
    )


def reference_greedy(config: ModelConfig, weights, prompt: list[int], max_tokens: int) -> list[int]:
    model = LlamaForCausalLM(config, 512)
    model.load_weights(dict(weights))
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            ids = torch.tensor(tokens)
            hidden = model(ids, torch.arange(len(tokens)), causal_attention)
            tokens.append(int(model.compute_logits(hidden[-1:]).argmax()))
    return tokens[len(prompt) :]


def run(core: EngineCore, requests: list[Request]) -> dict[str, list[int]]:
    for r in requests:
        core.add_request(r)
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while core.has_unfinished_requests():
        for o in core.step():
            out[o.req_id].extend(o.new_token_ids)
    return out


def prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 70) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(128) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def expected(tiny_config, tiny_model_weights) -> dict[int, list[int]]:
    return {
        i: reference_greedy(tiny_config, tiny_model_weights, p, 12)
        for i, p in enumerate(prompts(6))
    }


def assert_blocks_released(core: EngineCore) -> None:
    stats = core.stats()
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
    assert stats.num_kv_blocks_used == 0


def test_one_at_a_time_and_batched_equal_reference(
    tiny_config, tiny_model_weights, expected
) -> None:
    core = make_core(tiny_config, tiny_model_weights)
    ps = prompts(6)
    for i, p in enumerate(ps):
        assert run(core, [Request(f"a{i}", p, GREEDY)]) == {f"a{i}": expected[i]}
    batched = run(core, [Request(f"b{i}", p, GREEDY) for i, p in enumerate(ps)])
    assert batched == {f"b{i}": expected[i] for i in range(6)}
    assert_blocks_released(core)


def test_prefix_cache_hits_give_same_tokens(tiny_config, tiny_model_weights) -> None:
    shared = prompts(1, seed=5, lo=40, hi=41)[0]
    ps = [shared + tail for tail in prompts(3, seed=6, lo=2, hi=9)]
    want = {
        f"p{i}": reference_greedy(tiny_config, tiny_model_weights, p, 12) for i, p in enumerate(ps)
    }
    core = make_core(tiny_config, tiny_model_weights)
    assert run(core, [Request("p0", ps[0], GREEDY)]) == {"p0": want["p0"]}
    hits_before = core.stats().prefix_cache_hits
    assert run(core, [Request(f"p{i}", p, GREEDY) for i, p in enumerate(ps) if i]) == {
        k: v for k, v in want.items() if k != "p0"
    }
    # Both later requests reuse the shared prompt's two full blocks (32 tokens).
    assert core.stats().prefix_cache_hits - hits_before == 64
    assert_blocks_released(core)


def test_preemption_under_small_kv_budget_gives_same_tokens(
    tiny_config, tiny_model_weights
) -> None:
    # 8 blocks = 128 tokens for six requests growing to 26-52 tokens each: decodes that
    # cross a block boundary must preempt others, which later resume by recompute.
    ps = prompts(6, seed=3, lo=20, hi=40)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    want = {
        f"c{i}": reference_greedy(tiny_config, tiny_model_weights, p, 12) for i, p in enumerate(ps)
    }
    core = make_core(tiny_config, tiny_model_weights, num_blocks=8, prefix_caching=False)
    got = run(core, [Request(f"c{i}", p, params) for i, p in enumerate(ps)])
    assert got == want
    assert core.stats().num_preemptions > 0
    assert_blocks_released(core)


def test_chunked_prefill_of_a_long_prompt(tiny_config, tiny_model_weights) -> None:
    long_prompt = prompts(1, seed=9, lo=300, hi=301)[0]
    want = reference_greedy(tiny_config, tiny_model_weights, long_prompt, 12)
    core = make_core(tiny_config, tiny_model_weights, max_batched=24)
    steps_before = core.stats().num_steps
    assert run(core, [Request("long", long_prompt, GREEDY)]) == {"long": want}
    # 300 prompt tokens in chunks of 24 -> 13 prefill steps, then 11 more decodes.
    assert core.stats().num_steps - steps_before == 13 + 11
    assert_blocks_released(core)


def test_abort_frees_blocks_at_once(tiny_config, tiny_model_weights) -> None:
    core = make_core(tiny_config, tiny_model_weights)
    for i, p in enumerate(prompts(4)):
        core.add_request(Request(f"x{i}", p, SamplingParams(temperature=0.0, max_tokens=100)))
    core.step()
    core.step()
    assert core.stats().num_kv_blocks_used > 0
    core.abort_requests([f"x{i}" for i in range(4)])
    assert core.stats().num_kv_blocks_used == 0
    assert not core.has_unfinished_requests()
    assert core.step() == []


def test_impossible_requests_rejected_at_once(tiny_config, tiny_model_weights) -> None:
    core = make_core(tiny_config, tiny_model_weights, num_blocks=4)
    with pytest.raises(ValueError, match="max_model_len"):
        core.add_request(Request("too-long", [1] * 600, SamplingParams(max_tokens=1)))
    with pytest.raises(ValueError):
        core.add_request(Request("never-fits", [1] * 100, SamplingParams(max_tokens=1)))
    with pytest.raises(ValueError, match="vocabulary"):
        core.add_request(Request("bad-ids", [1, 999], SamplingParams(max_tokens=1)))
    with pytest.raises(ValueError, match="empty"):
        core.add_request(Request("empty", [], SamplingParams(max_tokens=1)))
    assert not core.has_unfinished_requests()


def test_same_seed_same_tokens_alone_and_in_any_batch(tiny_config, tiny_model_weights) -> None:
    core = make_core(tiny_config, tiny_model_weights)
    prompt = prompts(1, seed=11)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20)
    alone = run(core, [Request("alone", prompt, seeded)])["alone"]
    others = [
        Request(f"o{i}", p, SamplingParams(temperature=0.7, seed=i if i % 2 else None, max_tokens=25))
        for i, p in enumerate(prompts(5, seed=12))
    ]
    in_batch = run(core, [*others[:2], Request("in-batch", prompt, seeded), *others[2:]])["in-batch"]
    assert in_batch == alone
    different_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=20)
    assert run(core, [Request("other-seed", prompt, different_seed)])["other-seed"] != alone


def test_n_siblings_share_the_prompt_blocks(tiny_config, tiny_model_weights) -> None:
    core = make_core(tiny_config, tiny_model_weights)
    prompt = prompts(1, seed=13, lo=50, hi=51)[0]
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=4, n=3)
    siblings = [Request(f"s#{i}", prompt, params.child(i)) for i in range(3)]
    for r in siblings:
        core.add_request(r)
    core.step()  # all three prefill in one step
    # 50-token prompt = 3 full blocks + 2 tokens: siblings 2 and 3 hit the 3 full blocks.
    assert [r.num_cached_tokens for r in siblings] == [0, 48, 48]
    # 3 shared blocks + 1 private partial block each.
    assert core.stats().num_kv_blocks_used == 3 + 3
    while core.has_unfinished_requests():
        core.step()
    assert core.stats().num_kv_blocks_used == 0
