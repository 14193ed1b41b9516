"""Constrained decoding end to end on the tiny byte-level model: random weights produce
junk, so every valid output below is the grammar's doing."""

from __future__ import annotations

import json

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
