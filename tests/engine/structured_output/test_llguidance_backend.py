"""The llguidance backend on the byte vocabulary: refusals name the keyword; masks admit
exactly the grammar's next bytes; a matcher accepts, terminates and rolls back."""

from __future__ import annotations

import pytest
import torch

from tokenmill.engine.structured_output.bitmask import allocate_bitmask
from tokenmill.engine.structured_output.llguidance_backend import LlguidanceBackend
from tokenmill.engine.structured_output.spec import StructuredOutputsParams as S


@pytest.fixture(scope="module")
def backend(byte_model) -> LlguidanceBackend:
    config, _, tokenizer = byte_model
    return LlguidanceBackend(tokenizer.backend.to_str(), config.vocab_size, tokenizer.eos_token_ids)


@pytest.mark.parametrize(
    ("schema", "message"),
    [
        ({"type": "object", "if": {}, "then": {}}, r'Unimplemented keys: \["if", "then"\]'),
        ({"dependentSchemas": {"a": {}}}, r'Unimplemented keys: \["dependentSchemas"\]'),
        ({"type": "string", "format": "color"}, "Unknown format: color"),
        ({"type": "array", "uniqueItems": True}, r'Unimplemented keys: \["uniqueItems"\]'),
        ({"not": {"type": "null"}}, r'Unimplemented keys: \["not"\]'),
    ],
)
def test_unenforceable_schemas_are_refused_by_name(backend, schema, message) -> None:
    with pytest.raises(ValueError, match="unsupported JSON schema: " + message):
        backend.compile(S(json=schema))


def allowed(backend, matcher) -> list[int]:
    mask = allocate_bitmask(1, 258)
    backend.fill_bitmask([(matcher, 0)], mask)
    bits = (mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten()[:258].nonzero().flatten().tolist()


def test_choice_mask_accept_terminate_rollback(backend) -> None:
    matcher = backend.compile(S(choice=("ab", "ac"))).matcher()
    assert allowed(backend, matcher) == [ord("a")]
    assert matcher.accept_token(ord("a"))
    assert allowed(backend, matcher) == [ord("b"), ord("c")]
    assert not matcher.is_terminated()
    assert matcher.accept_token(ord("c"))
    assert matcher.is_terminated()
    matcher.rollback(1)
    assert not matcher.is_terminated() and allowed(backend, matcher) == [ord("b"), ord("c")]
    assert not matcher.accept_token(ord("z"))


def test_json_is_compact_and_eos_only_when_complete(backend) -> None:
    matcher = backend.compile(S(json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})).matcher()
    assert allowed(backend, matcher) == [ord("{")]  # no leading whitespace
    for ch in '{"n":4':
        assert matcher.accept_token(ord(ch))
    assert 256 not in allowed(backend, matcher) and ord(" ") not in allowed(backend, matcher)
    assert matcher.accept_token(ord("}"))
    assert matcher.is_terminated()


def test_matchers_of_one_grammar_are_independent(backend) -> None:
    grammar = backend.compile(S(regex="x[0-9]"))
    a, b = grammar.matcher(), grammar.matcher()
    assert a.accept_token(ord("x"))
    assert allowed(backend, b) == [ord("x")]
    mask = allocate_bitmask(2, 258)
    backend.fill_bitmask([(a, 1), (b, 0)], mask)  # the whole batch in one call
    assert mask[1, 1].item() == (0b1111111111 << 16) and mask[0, 3].item() == 1 << (ord("x") - 96)
