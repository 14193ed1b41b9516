"""The shipped processors through the whole engine: stateful rules stay exact across
chunked prefill (no logits until a prompt is done) and forced preemption (a row is
removed and comes back with its history)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.logits.builtin import ForceTokens, NoRepeatPrevious
from tokenmill.engine.logits.processor import ProcessorContext
from tokenmill.engine.logits.registry import registered_processors
from tokenmill.engine.models.llama import LlamaForCausalLM, causal_attention
from tokenmill.engine.request import Request, SamplingParams

PROCESSORS = {"no_repeat": NoRepeatPrevious, "force_tokens": ForceTokens}


def reference(config, weights, prompt, max_tokens, rule) -> list[int]:
    """Cache-free greedy decoding with `rule(logits, tokens)` applied each step."""
    model = LlamaForCausalLM(config, 512)
    model.load_weights(dict(weights))
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(max_tokens):
            hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), causal_attention)
            logits = model.compute_logits(hidden[-1:])[0].float()
            rule(logits, tokens[len(prompt):], tokens)
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt):]


def no_repeat_rule(logits, outputs, tokens) -> None:
    logits[tokens[-1]] = float("-inf")


def run(core, requests):
    for r in requests:
        core.add_request(r)
    out = {r.request_id: [] for r in requests}
    while core.has_unfinished_requests():
        for o in core.step():
            out[o.req_id].extend(o.new_token_ids)
    return out


PROMPTS = [[(11 * i + 3 * j) % 250 for j in range(30 + 17 * i)] for i in range(5)]


@pytest.mark.parametrize("num_blocks", [256, 9])
def test_no_repeat_is_exact_across_chunked_prefill_and_preemption(
    byte_model, make_byte_core, num_blocks
) -> None:
    config, weights, _ = byte_model
    params = SamplingParams(temperature=0.0, max_tokens=40, logits_processors=["no_repeat"])
    plain = SamplingParams(temperature=0.0, max_tokens=40)
    core = make_byte_core(num_blocks=num_blocks, max_batched=16, logits_processors=PROCESSORS)
    reqs = [Request(f"r{i}", p, params if i % 2 == 0 else plain) for i, p in enumerate(PROMPTS)]
    got = run(core, reqs)
    if num_blocks == 9:
        assert core.stats().num_preemptions > 0
    for i, p in enumerate(PROMPTS):
        rule = no_repeat_rule if i % 2 == 0 else (lambda *_: None)
        assert got[f"r{i}"] == reference(config, weights, p, 40, rule), i
    # The rule changes the output: the plain model repeats itself.
    assert any(a == b for a, b in zip(got["r1"], got["r1"][1:], strict=False))
    assert core.stats().num_kv_blocks_used == 0


def test_force_tokens_then_free(byte_model, make_byte_core) -> None:
    config, weights, _ = byte_model
    forced = [104, 105, 33]
    params = SamplingParams(
        temperature=0.0, max_tokens=10,
        logits_processors=[{"name": "force_tokens", "args": {"token_ids": forced}}],
    )
    core = make_byte_core(logits_processors=PROCESSORS)
    got = run(core, [Request("f", PROMPTS[0], params)])["f"]

    def rule(logits, outputs, tokens):
        if len(outputs) < len(forced):
            keep = logits[forced[len(outputs)]].clone()
            logits[:] = float("-inf")
            logits[forced[len(outputs)]] = keep

    assert got[:3] == forced
    assert got == reference(config, weights, PROMPTS[0], 10, rule)


def test_bad_arguments_and_unknown_names_fail_at_add(make_byte_core) -> None:
    from tokenmill.engine.logits.processor import LogitsProcessorSpec

    core = make_byte_core(logits_processors=PROCESSORS)
    cases = [
        (LogitsProcessorSpec("no_repeat", {"max_tokens": 0}), "max_tokens must be an integer >= 1"),
        (LogitsProcessorSpec("no_repeat", {"bogus": 1}), r"takes only max_tokens \(got \['bogus'\]\)"),
        (LogitsProcessorSpec("force_tokens", {"token_ids": [999]}), r"vocabulary \[0, 258\)"),
        (LogitsProcessorSpec("missing"), "unknown logits processor 'missing'"),
    ]
    for spec, message in cases:
        with pytest.raises(ValueError, match=message):
            core.add_request(Request("x", [1, 2], SamplingParams(logits_processors=[spec])))
    assert not core.has_unfinished_requests()


def test_entry_points_register_the_shipped_processors() -> None:
    found = registered_processors()
    assert found["no_repeat"] is NoRepeatPrevious and found["force_tokens"] is ForceTokens


def test_no_repeat_max_tokens_limits_the_rule() -> None:
    processor = NoRepeatPrevious(ProcessorContext(8, torch.device("cpu"), ()))
    from tokenmill.engine.logits.processor import AddedRow, BatchUpdate

    outputs = [3]
    params = SamplingParams(logits_processors=[{"name": "no_repeat", "args": {"max_tokens": 2}}])
    processor.update_state(BatchUpdate(1, added=[AddedRow(0, "a", params, [1, 2], outputs)]))
    logits = processor.apply(torch.zeros(1, 8))
    assert logits[0].tolist() == [0, 0, 0, float("-inf"), 0, 0, 0, 0]
    outputs.append(5)
    assert processor.apply(torch.zeros(1, 8))[0].tolist() == [0.0] * 8
