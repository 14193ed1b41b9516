"""Constrained decoding end to end on the tiny byte-level model: random weights produce
junk, so every valid output below is the grammar's doing."""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest

from tokenmill.engine.request import Request, SamplingParams
from tokenmill.engine.structured_output.spec import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 3, "maximum": 70},
        "tag": {"enum": ["red", "green"]},
        "xs": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
        "note": {"anyOf": [{"type": "null"}, {"type": "string", "pattern": "^[a-z]{1,4}$"}]},
    },
    "required": ["id", "tag", "xs", "note"],
    "additionalProperties": False,
}


def run(core, requests):
    for r in requests:
        core.add_request(r)
    tokens = {r.request_id: [] for r in requests}
    finish = {}
    while core.has_unfinished_requests():
        for o in core.step():
            tokens[o.req_id].extend(o.new_token_ids)
            if o.finish_reason is not None:
                finish[o.req_id] = (str(o.finish_reason), o.grammar_ended)
    return tokens, finish


def text(tokens: list[int]) -> str:
    return bytes(t for t in tokens if t < 256).decode("utf-8")


def constrained(spec: StructuredOutputsParams, **kwargs) -> SamplingParams:
    return SamplingParams(structured_outputs=spec, **{"max_tokens": 200, **kwargs})


def test_json_schema_outputs_validate_greedy_and_sampled(make_byte_core) -> None:
    core = make_byte_core()
    spec = StructuredOutputsParams(json=SCHEMA)
    params = [constrained(spec, temperature=0.0)] + [
        constrained(spec, temperature=1.0, seed=s) for s in range(6)
    ]
    reqs = [Request(f"r{i}", [1 + i, 2, 3], p, eos_token_ids=(256,)) for i, p in enumerate(params)]
    tokens, finish = run(core, reqs)
    for rid, toks in tokens.items():
        assert finish[rid][0] == "stop", (rid, text(toks))
        jsonschema.validate(json.loads(text(toks)), SCHEMA)
        assert " " not in text(toks).replace('" "', "")  # compact: no free whitespace
    assert core.stats().num_kv_blocks_used == 0


def test_max_tokens_mid_object_is_length_not_stop(make_byte_core) -> None:
    core = make_byte_core()
    params = constrained(StructuredOutputsParams(json=SCHEMA), temperature=0.0, max_tokens=5)
    tokens, finish = run(core, [Request("r", [5, 6], params, eos_token_ids=(256,))])
    assert finish["r"] == ("length", False)
    assert len(tokens["r"]) == 5 and text(tokens["r"]).startswith('{"')


def test_grammar_end_stops_the_request_even_with_ignore_eos(make_byte_core) -> None:
    core = make_byte_core()
    spec = StructuredOutputsParams(choice=("alpha", "beta"))
    tokens, finish = run(
        core,
        [
            Request("a", [9, 9], constrained(spec, temperature=0.0), eos_token_ids=(256,)),
            Request("b", [7], constrained(spec, temperature=0.0, ignore_eos=True), eos_token_ids=(256,)),
        ],
    )
    for rid in "ab":
        assert text(tokens[rid]) in ("alpha", "beta")
        assert finish[rid] == ("stop", True)  # ended by the grammar, on its last byte


def test_regex_and_lark_grammar(make_byte_core) -> None:
    core = make_byte_core()
    regex = StructuredOutputsParams(regex=r"[0-9]{3}-[a-c]+")
    lark = StructuredOutputsParams(grammar='start: "(" item ("," item)* ")"\nitem: /[xy]/')
    tokens, finish = run(
        core,
        [
            Request("re", [3], constrained(regex, temperature=1.0, seed=1, max_tokens=30), eos_token_ids=(256,)),
            Request("lark", [4], constrained(lark, temperature=1.0, seed=2, max_tokens=60), eos_token_ids=(256,)),
        ],
    )
    import re

    if finish["re"][0] == "stop":
        assert re.fullmatch(r"[0-9]{3}-[a-c]+", text(tokens["re"]))
    else:
        assert re.fullmatch(r"[0-9]{3}-[a-c]*|[0-9]{0,3}", text(tokens["re"]))
    assert finish["lark"][0] == "stop"
    assert re.fullmatch(r"\([xy](,[xy])*\)", text(tokens["lark"]))


@pytest.mark.parametrize("budget", [None, 14])
def test_constrained_greedy_is_the_same_under_chunked_prefill_and_preemption(
    make_byte_core, budget
) -> None:
    """A preempted request rebuilds its matcher from its history: its greedy output is
    token-identical to the run that never preempted."""
    spec = StructuredOutputsParams(json=SCHEMA)
    prompts = [[(7 * i + j) % 250 for j in range(40 + 9 * i)] for i in range(6)]

    def requests():
        return [Request(f"q{i}", p, constrained(spec, temperature=0.0, max_tokens=120), eos_token_ids=(256,))
                for i, p in enumerate(prompts)]

    reference, _ = run(make_byte_core(), requests())
    core = make_byte_core(num_blocks=budget or 256, max_batched=16)
    tokens, finish = run(core, requests())
    assert tokens == reference
    if budget:
        assert core.stats().num_preemptions > 0
    for rid, toks in tokens.items():
        assert finish[rid][0] == "stop"
        jsonschema.validate(json.loads(text(toks)), SCHEMA)
    assert core.stats().num_kv_blocks_used == 0


def test_n_samples_each_follow_their_own_grammar_state(make_byte_core) -> None:
    core = make_byte_core()
    params = constrained(StructuredOutputsParams(json=SCHEMA), temperature=1.0, seed=11)
    core.add_samples([(f"s{i}", params.child(i)) for i in range(4)], [1, 2, 3], eos_token_ids=(256,))
    outputs = {f"s{i}": [] for i in range(4)}
    while core.has_unfinished_requests():
        for o in core.step():
            outputs[o.req_id].extend(o.new_token_ids)
    for toks in outputs.values():
        jsonschema.validate(json.loads(text(toks)), SCHEMA)
    # Each sample is what its seed gives alone: no state shared between the n matchers.
    alone, _ = run(make_byte_core(), [Request("alone", [1, 2, 3], params.child(2), eos_token_ids=(256,))])
    assert outputs["s2"] == alone["alone"]


def test_unsupported_schema_and_bad_grammar_are_refused_at_add(make_byte_core) -> None:
    core = make_byte_core()
    bad = StructuredOutputsParams(json={"type": "object", "if": {"required": ["a"]}, "then": {}})
    with pytest.raises(ValueError, match=r'unsupported JSON schema: .*"if", "then"'):
        core.add_request(Request("x", [1], constrained(bad)))
    with pytest.raises(ValueError, match="unsupported regex"):
        core.add_request(Request("y", [1], constrained(StructuredOutputsParams(regex="(unclosed"))))
    assert not core.has_unfinished_requests()


def test_bf16_mask_fused_into_the_logits_conversion_samples_as_the_mask_applied_after(
    make_byte_core, monkeypatch
) -> None:
    """In bfloat16 the runner writes the grammar mask into the logits' float conversion
    (one pass); the same requests with the mask applied after a plain conversion, as the
    processors' apply() does, give the same tokens, greedy and seeded, row for row."""
    import tokenmill.engine.runner.model_runner as model_runner

    spec = StructuredOutputsParams(json=SCHEMA)
    params = [constrained(spec, temperature=0.0)] + [constrained(spec, temperature=1.0, seed=s) for s in range(5)]

    def requests():
        # One unconstrained row among them: its logits row is converted, never masked.
        plain = Request("plain", [9, 9], SamplingParams(max_tokens=30, temperature=0.0), eos_token_ids=(256,))
        return [Request(f"r{i}", [1 + i, 2, 3], p, eos_token_ids=(256,)) for i, p in enumerate(params)] + [plain]

    fused_calls = []
    real = model_runner.masked_float
    monkeypatch.setattr(model_runner, "masked_float", lambda *a, **k: fused_calls.append(1) or real(*a, **k))
    fused, finish = run(make_byte_core(dtype="bfloat16"), requests())
    assert len(fused_calls) > 20
    fused_calls.clear()
    unfused_core = make_byte_core(dtype="bfloat16")
    monkeypatch.setattr(unfused_core.runner, "_fuses_grammar", lambda *a: False)
    unfused, _ = run(unfused_core, requests())
    assert fused_calls == []
    assert fused == unfused
    for i in range(len(params)):
        assert finish[f"r{i}"][0] == "stop"
        jsonschema.validate(json.loads(text(fused[f"r{i}"])), SCHEMA)


def test_prefetched_masks_survive_rows_leaving_and_joining(make_byte_core) -> None:
    """Rows finish at different steps and new ones join mid-run: each step uses the masks
    prefetched for the rows that stayed (by row, whatever index they move to) and fills
    only the new ones. Outputs equal each request run alone."""
    spec = StructuredOutputsParams(json=SCHEMA)
    lengths = [200, 9, 200, 17, 200, 5]  # some end by length early, moving the others
    reqs = [Request(f"m{i}", [3 + i, 1], constrained(spec, temperature=1.0, seed=i, max_tokens=n),
                    eos_token_ids=(256,)) for i, n in enumerate(lengths)]
    core = make_byte_core()
    fills = []
    processor = core.runner.processors._structured
    real_fill = processor._fill
    processor._fill = lambda rows, start: fills.append((threading.current_thread().name, len(rows))) or real_fill(
        rows, start
    )
    for r in reqs[:4]:
        core.add_request(r)
    tokens = {r.request_id: [] for r in reqs}
    steps = 0
    while core.has_unfinished_requests():
        steps += 1
        if steps == 4:  # two join while four decode
            core.add_request(reqs[4])
            core.add_request(reqs[5])
        for o in core.step():
            tokens[o.req_id].extend(o.new_token_ids)
    for r in reqs:
        alone, _ = run(make_byte_core(), [Request("a", r.prompt_token_ids, r.sampling_params, eos_token_ids=(256,))])
        assert tokens[r.request_id] == alone["a"], r.request_id
    # The engine's thread filled only rows that had no prefetch: the first four at their
    # first step, then the two that joined; the worker filled every other step's masks.
    assert [n for name, n in fills if not name.startswith("tokenmill-mask")] == [4, 2]
    assert sum(1 for name, _ in fills if name.startswith("tokenmill-mask")) > 20
    assert core.stats().num_kv_blocks_used == 0
