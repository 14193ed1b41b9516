"""StructuredOutputsParams: exactly one constraint, canonical cache keys."""

from __future__ import annotations

import pytest

from tokenmill.engine.request import SamplingParams
from tokenmill.engine.structured_output.spec import StructuredOutputsParams


def test_kinds_and_keys() -> None:
    assert StructuredOutputsParams(json_object=True).key == ("json_object", "")
    assert StructuredOutputsParams(choice=["b", "a"]).key == ("choice", '["b","a"]')
    assert StructuredOutputsParams(json='{"type":"string"}').json == {"type": "string"}
    assert StructuredOutputsParams(grammar="start: /a/").kind == "grammar"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, r"exactly one of .* \(got none\)"),
        ({"regex": "a", "choice": ["x"]}, r"\(got regex, choice\)"),
        ({"choice": []}, "must not be empty"),
        ({"choice": "abc"}, "list of strings"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": [1]}, "must be a JSON schema"),
        ({"regex": ""}, "non-empty string"),
    ],
)
def test_invalid(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_stop_sequences_cannot_cut_a_constraint() -> None:
    spec = StructuredOutputsParams(regex="a+")
    with pytest.raises(ValueError, match="cannot be combined with structured outputs"):
        SamplingParams(structured_outputs=spec, stop=["}"])
    with pytest.raises(ValueError, match="cannot be combined"):
        SamplingParams(structured_outputs=spec, stop_token_ids=[3])
