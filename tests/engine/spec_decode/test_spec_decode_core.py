"""Speculative decoding end to end on tiny random models: with either proposer, greedy
outputs are token-identical to decoding without speculation (mixed batches, structured
outputs, logits processors, forced preemption, chunked prefill), seeded sampling gives
the same tokens too, nothing overshoots max_tokens and no KV block leaks."""

from __future__ import annotations

import dataclasses
import json
import random

import jsonschema
import pytest
import torch

from tokenmill.engine.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.logits.builtin import ForceTokens, NoRepeatPrevious
from tokenmill.engine.request import Request, SamplingParams
from tokenmill.engine.runner.kv_cache_tensors import bytes_per_block
from tokenmill.engine.spec_decode.config import SpeculativeConfig
from tokenmill.engine.structured_output.spec import StructuredOutputsParams

BYTE_EOS = 256  # the byte model's end of sequence (tests/engine/conftest.py)
NGRAM = SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3, adaptive=False)
SELF = SpeculativeConfig("draft", 3, model="self", num_layers=2, adaptive=False)
PROPOSERS = pytest.mark.parametrize("spec", [NGRAM, SELF], ids=["ngram", "self-draft"])
GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


@pytest.fixture(autouse=True)
def _model(deep_tiny_model):
    global CONFIG, WEIGHTS
    CONFIG, WEIGHTS = deep_tiny_model


def make_core(spec, *, num_blocks=256, max_batched=256, prefix_caching=True, draft=None) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=CONFIG,
            cache=CacheConfig(
                block_size=16,
                kv_cache_memory_bytes=num_blocks * bytes_per_block(CONFIG, 16, torch.float32),
                enable_prefix_caching=prefix_caching,
            ),
            scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_batched, max_model_len=512),
            device=DeviceConfig(dtype="float32"),
            speculative=spec,
        ),
        WEIGHTS,
        logits_processors={"no_repeat": NoRepeatPrevious, "force_tokens": ForceTokens},
        draft=draft,
    )


def run(core, requests):
    for r in requests:
        core.add_request(r)
    out = {r.request_id: [] for r in requests}
    finish = {}
    while core.has_unfinished_requests():
        for o in core.step():
            out[o.req_id].extend(o.new_token_ids)
            if o.finish_reason is not None:
                finish[o.req_id] = str(o.finish_reason)
    return out, finish


def prompts(n=8, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(128) for _ in range(rng.randrange(3, 60))] for _ in range(n)]


def assert_no_leak(core) -> None:
    kv = core.scheduler.kv_cache
    assert not core.scheduler.requests
    assert kv.num_free_blocks == kv.num_blocks


MIXED = [
    GREEDY,
    SamplingParams(temperature=0.0, max_tokens=33, repetition_penalty=1.3),
    SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=40),
    SamplingParams(temperature=0.0, max_tokens=25, logits_processors=["no_repeat"]),
    SamplingParams(temperature=1.0, top_k=5, seed=3, max_tokens=40, frequency_penalty=0.5),
    SamplingParams(temperature=0.0, max_tokens=40, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=7, min_tokens=3),
    SamplingParams(temperature=0.5, min_p=0.1, seed=1, max_tokens=40, presence_penalty=1.0),
]


def mixed_requests():
    return [Request(f"r{i}", p, MIXED[i]) for i, p in enumerate(prompts())]


@PROPOSERS
def test_greedy_is_token_identical_and_drafts_are_accepted(spec) -> None:
    requests = lambda: [Request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts())]  # noqa: E731
    reference, _ = run(make_core(None), requests())
    core = make_core(spec)
    out, _ = run(core, requests())
    assert out == reference
    stats = core.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_draft_tokens >= stats.spec_decode_num_accepted_tokens
    lengths = stats.spec_decode_acceptance_lengths
    assert sum(n * i for i, n in enumerate(lengths)) == stats.spec_decode_num_accepted_tokens
    assert_no_leak(core)


@PROPOSERS
@pytest.mark.parametrize("num_blocks,max_batched", [(256, 256), (12, 16)], ids=["roomy", "preempting"])
def test_mixed_batch_is_identical_under_chunked_prefill_and_preemption(spec, num_blocks, max_batched) -> None:
    """Greedy, penalized, seeded, processor and logprob requests in one batch: every one
    gives the tokens (and logprobs) it gives without speculation."""
    reference, ref_finish = run(make_core(None), mixed_requests())
    core = make_core(spec, num_blocks=num_blocks, max_batched=max_batched)
    out, finish = run(core, mixed_requests())
    assert out == reference
    assert finish == ref_finish
    if num_blocks == 12:
        assert core.stats().num_preemptions > 0
    assert core.stats().spec_decode_num_accepted_tokens > 0
    assert_no_leak(core)


def test_logprobs_are_those_of_decoding_without_speculation() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=30, logprobs=3)

    def logprobs(core):
        core.add_request(Request("a", prompts(1)[0], params))
        got = []
        while core.has_unfinished_requests():
            for o in core.step():
                got.extend(zip(o.new_token_ids, o.new_logprobs, strict=True))
        return got

    # A verification scores positions in one multi-token forward: same values up to
    # float32 rounding.
    spec, plain = logprobs(make_core(NGRAM)), logprobs(make_core(None))
    assert [t for t, _ in spec] == [t for t, _ in plain] and len(spec) == 30
    for (_, a), (_, b) in zip(spec, plain, strict=True):
        assert list(a) == list(b)
        assert all(abs(a[k].logprob - b[k].logprob) < 1e-4 and a[k].rank == b[k].rank for k in a)


@PROPOSERS
def test_max_tokens_stop_ids_and_n_children(spec) -> None:
    base = prompts(4, seed=5)
    # The reference's 6th token as a stop id: the accepted drafts past it are dropped.
    reference, _ = run(make_core(None), [Request("s", base[0], GREEDY)])
    stop = reference["s"][5]
    params = [
        SamplingParams(temperature=0.0, max_tokens=9),
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop]),
        *[SamplingParams(temperature=0.9, seed=4, max_tokens=20, n=3).child(i) for i in range(3)],
    ]
    prompts_ = [base[1], base[0], base[2], base[2], base[2]]
    requests = lambda: [Request(f"q{i}", p, s) for i, (p, s) in enumerate(zip(prompts_, params, strict=True))]  # noqa: E731
    expected, expected_finish = run(make_core(None), requests())
    core = make_core(spec)
    out, finish = run(core, requests())
    assert out == expected and finish == expected_finish
    assert len(out["q0"]) == 9 and finish["q0"] == "length"
    assert out["q1"][-1] == stop and len(out["q1"]) == reference["s"].index(stop) + 1
    assert len({tuple(out[f"q{i}"]) for i in (2, 3, 4)}) == 3  # the n children differ
    assert_no_leak(core)


def test_prefix_cache_holds_only_verified_tokens() -> None:
    """A second request with the first one's prompt + output hits exactly the full blocks
    of verified tokens, and decodes the same as without speculation."""
    core = make_core(NGRAM)
    first, _ = run(core, [Request("a", prompts(1)[0], GREEDY)])
    again = prompts(1)[0] + first["a"]
    out, _ = run(core, [Request("b", again, GREEDY)])
    reference, _ = run(make_core(None), [Request("b", again, GREEDY)])
    assert out == reference
    stats = core.stats()
    assert stats.prefix_cache_hits == (len(again) - 1) // 16 * 16
    assert_no_leak(core)


SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 3, "maximum": 70},
        "xs": {"type": "array", "items": {"enum": ["ab", "cd"]}, "minItems": 2, "maxItems": 6},
    },
    "required": ["id", "xs"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "spec",
    [SpeculativeConfig("ngram", 4, prompt_lookup_min=1, prompt_lookup_max=3, adaptive=False),
     SpeculativeConfig("draft", 3, model="self", num_layers=1, adaptive=False)],
    ids=["ngram", "self-draft"],
)
@pytest.mark.parametrize("num_blocks", [256, 9], ids=["roomy", "preempting"])
def test_structured_outputs_are_identical_and_valid(make_byte_core, spec, num_blocks) -> None:
    so = StructuredOutputsParams(json=SCHEMA)
    params = [
        SamplingParams(temperature=0.0, max_tokens=90, structured_outputs=so),
        SamplingParams(temperature=0.9, seed=2, max_tokens=90, structured_outputs=so),
        SamplingParams(temperature=0.0, max_tokens=60),
    ]
    prompt = list(b'{"id": 5, "xs": ["ab", "cd", "ab", "cd"]} again: ')
    requests = lambda: [  # noqa: E731
        Request(f"j{i}", list(f"{i}: ".encode()) + prompt, p, eos_token_ids=(BYTE_EOS,))
        for i, p in enumerate(params)
    ]
    reference, ref_finish = run(make_byte_core(), requests())
    core = make_byte_core(num_blocks=num_blocks, max_batched=32, speculative=spec)
    out, finish = run(core, requests())
    assert out == reference and finish == ref_finish
    for i in (0, 1):
        assert finish[f"j{i}"] == "stop"
        jsonschema.validate(json.loads(bytes(t for t in out[f"j{i}"] if t < 256)), SCHEMA)
    assert core.stats().spec_decode_num_accepted_tokens > 0
    assert (core.stats().num_preemptions > 0) == (num_blocks == 9)
    assert_no_leak(core)


@pytest.mark.parametrize("num_blocks", [256, 12], ids=["roomy", "preempting"])
def test_a_separate_draft_model_with_its_own_kv(tiny_config, tiny_model_weights, num_blocks) -> None:
    """A 2-layer draft (other weights, same vocabulary) keeps its own paged K/V, caught up
    lazily; the target's budget shrinks by the draft's bytes per block."""
    spec = SpeculativeConfig("draft", 3, model="tiny-draft", adaptive=False)
    draft = (tiny_config, tiny_model_weights)
    budget = num_blocks * bytes_per_block(CONFIG, 16, torch.float32)
    reference, ref_finish = run(make_core(None), mixed_requests())
    core = make_core(spec, num_blocks=num_blocks, draft=draft)
    # 4 target layers + 2 draft layers per block: the target gets 4/6 of the budget.
    assert core.runner.num_blocks == budget * 4 // 6 // bytes_per_block(CONFIG, 16, torch.float32)
    out, finish = run(core, mixed_requests())
    assert out == reference and finish == ref_finish
    stats = core.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert (stats.num_preemptions > 0) == (num_blocks == 12)
    assert_no_leak(core)


def test_bad_drafts_are_refused(tiny_config, tiny_model_weights) -> None:
    with pytest.raises(ValueError, match=r"num_layers \(4\) must be below the model's 4 layers"):
        make_core(SpeculativeConfig("draft", 2, model="self", num_layers=4))
    other = dataclasses.replace(tiny_config, vocab_size=64)
    weights = dict(tiny_model_weights)
    weights["model.embed_tokens.weight"] = weights["model.embed_tokens.weight"][:64]
    with pytest.raises(ValueError, match=r"vocabulary \(64\) differs from the target's \(128\)"):
        make_core(SpeculativeConfig("draft", 2, model="x"), draft=(other, weights))
