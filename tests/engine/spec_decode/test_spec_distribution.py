"""Sampling with speculation draws from the target's distribution: a chi-square test on a
tiny random model, over thousands of unseeded samples.

The self-draft (3 of 4 layers) proposes 2 tokens after the first; the second output token
is the first one the verifier decides (accepted draft or resampled). Its empirical
distribution must match the target's exact marginal P(x2) = sum_x1 p(x1) p(x2 | x1),
computed with a cache-free reference forward. As a control the same counts are tested
against the draft's own marginal, which they must fail: the test has power."""

from __future__ import annotations

import math
from collections import Counter

import torch

from tokenmill.engine.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.models.llama import LlamaForCausalLM, causal_attention
from tokenmill.engine.request import Request, SamplingParams
from tokenmill.engine.runner.kv_cache_tensors import bytes_per_block
from tokenmill.engine.spec_decode.config import SpeculativeConfig

PROMPT = [3, 17, 42, 99, 5, 64, 23, 8]
NUM_SAMPLES = 3000
TEMPERATURE = 1.0


def marginal_of_second_token(config, weights, num_layers=None) -> torch.Tensor:
    model = LlamaForCausalLM(config, 512)
    model.load_weights(dict(weights))

    def probs(tokens: list[int]) -> torch.Tensor:
        hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), causal_attention, num_layers)
        return torch.softmax(model.compute_logits(hidden[-1:])[0].double() / TEMPERATURE, dim=-1)

    with torch.inference_mode():
        first = probs(PROMPT) if num_layers is None else marginal_of_second_token.target_first
        total = torch.zeros_like(first)
        for x1 in range(config.vocab_size):
            if first[x1] > 1e-6:
                total += first[x1] * probs([*PROMPT, x1])
        if num_layers is None:
            marginal_of_second_token.target_first = first
    return total


def chi_square(counts: Counter, expected_p: torch.Tensor, n: int) -> tuple[float, int]:
    """Statistic and degrees of freedom, bins with expected count < 5 pooled."""
    expected = (expected_p * n).tolist()
    stat, pooled_obs, pooled_exp, bins = 0.0, 0, 0.0, 0
    for token, e in enumerate(expected):
        if e >= 5:
            stat += (counts.get(token, 0) - e) ** 2 / e
            bins += 1
        else:
            pooled_obs += counts.get(token, 0)
            pooled_exp += e
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        bins += 1
    return stat, bins - 1


def critical(df: int) -> float:
    """~ the 0.999 quantile of chi-square(df) (Wilson-Hilferty)."""
    z = 3.09
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_second_token_follows_the_target_distribution(deep_tiny_model) -> None:
    config, weights = deep_tiny_model
    spec = SpeculativeConfig("draft", 2, model="self", num_layers=3, adaptive=False)
    core = EngineCore(
        EngineConfig(
            model=config,
            cache=CacheConfig(block_size=16, kv_cache_memory_bytes=256 * bytes_per_block(config, 16, torch.float32)),
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=512),
            device=DeviceConfig(dtype="float32"),
            speculative=spec,
        ),
        weights,
    )
    torch.manual_seed(1234)
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=3)
    seconds: Counter = Counter()
    for start in range(0, NUM_SAMPLES, 64):
        outputs: dict[str, list[int]] = {}
        for i in range(start, min(start + 64, NUM_SAMPLES)):
            core.add_request(Request(f"s{i}", PROMPT, params))
            outputs[f"s{i}"] = []
        while core.has_unfinished_requests():
            for o in core.step():
                outputs[o.req_id].extend(o.new_token_ids)
        seconds.update(tokens[1] for tokens in outputs.values())
    stats = core.stats()
    lengths = stats.spec_decode_acceptance_lengths
    assert lengths[0] > 100 and sum(lengths[1:]) > 100  # both rejections and acceptances

    target = marginal_of_second_token(config, weights)
    stat, df = chi_square(seconds, target, NUM_SAMPLES)
    assert stat < critical(df), (stat, df)
    draft = marginal_of_second_token(config, weights, num_layers=3)
    stat_draft, df_draft = chi_square(seconds, draft, NUM_SAMPLES)
    assert stat_draft > critical(df_draft), (stat_draft, df_draft)
