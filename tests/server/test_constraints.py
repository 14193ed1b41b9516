"""response_format / structured_outputs / logits_processors -> SamplingParams, the 400s,
and the server's re-check of constrained outputs."""

from __future__ import annotations

from typing import Any

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from tokenmill.engine.logits.processor import LogitsProcessorSpec
from tokenmill.engine.structured_output.spec import StructuredOutputsParams
from tokenmill.server.constraints import Constraint

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 3}}, "required": ["a"]}


def chat(client: TestClient, **fields: Any) -> Any:
    return client.post(CHAT, json={"messages": USER, "max_tokens": 2, **fields})


def completion(client: TestClient, **fields: Any) -> Any:
    return client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2, **fields})


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
         StructuredOutputsParams(json=SCHEMA)),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA)),
        ({"structured_outputs": {"json": '{"type": "string"}'}}, StructuredOutputsParams(json={"type": "string"})),
        ({"structured_outputs": {"json_object": True}}, StructuredOutputsParams(json_object=True)),
        ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputsParams(regex="[0-9]+")),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutputsParams(choice=("yes", "no"))),
        ({"structured_outputs": {"grammar": 'start: "a"'}}, StructuredOutputsParams(grammar='start: "a"')),
    ],
)
@pytest.mark.parametrize("endpoint", [chat, completion])
def test_constraints_reach_the_engine(
    client: TestClient, engine: FakeEngine, endpoint: Any, fields: dict[str, Any], expected: Any
) -> None:
    response = endpoint(client, **fields)
    assert response.status_code == 200, response.text
    assert engine.calls[-1].params.structured_outputs == expected


def test_logits_processors_reach_the_engine(client: TestClient, engine: FakeEngine) -> None:
    response = chat(client, logits_processors=["no_repeat", {"name": "other", "args": {"k": [1, 2]}}])
    assert response.status_code == 200, response.text
    assert engine.calls[-1].params.logits_processors == [
        LogitsProcessorSpec("no_repeat", {}),
        LogitsProcessorSpec("other", {"k": [1, 2]}),
    ]
    assert completion(client, logits_processors=[{"name": "no_repeat"}]).status_code == 200
    assert engine.calls[-1].params.logits_processors == [LogitsProcessorSpec("no_repeat", {})]


@pytest.mark.parametrize(
    ("fields", "param", "code"),
    [
        ({"response_format": {"type": "xml"}}, "response_format.type", "invalid_value"),
        ({"response_format": {"type": "text", "json_schema": {"name": "x", "schema": {}}}}, "response_format.json_schema", "invalid_value"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "missing_required_parameter"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema", "missing_required_parameter"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x y", "schema": {}}}}, "response_format.json_schema.name", "invalid_value"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "extra": 1}}}, "response_format.json_schema.extra", "unknown_parameter"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}}, "response_format.json_schema.schema", "invalid_value"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs", "invalid_value"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "invalid_value"),
        ({"structured_outputs": {}}, "structured_outputs", "invalid_value"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "invalid_value"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "invalid_value"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex", "invalid_value"),
        ({"structured_outputs": {"guided_json": {}}}, "structured_outputs.guided_json", "unknown_parameter"),
        ({"structured_outputs": {"regex": "a"}, "stop": ["x"]}, "stop", "invalid_value"),
        ({"response_format": {"type": "json_object"}, "stop_token_ids": [1]}, "stop_token_ids", "invalid_value"),
        ({"logits_processors": "no_repeat"}, "logits_processors", "invalid_value"),
        ({"logits_processors": ["a", "a"]}, "logits_processors[1]", "invalid_value"),
        ({"logits_processors": [""]}, "logits_processors[0]", "invalid_value"),
        ({"logits_processors": [{"name": "a", "kwargs": {}}]}, "logits_processors[0].kwargs", "unknown_parameter"),
    ],
)
@pytest.mark.parametrize("endpoint", [chat, completion])
def test_bad_constraints_are_400(
    client: TestClient, engine: FakeEngine, endpoint: Any, fields: dict[str, Any], param: str, code: str
) -> None:
    response = endpoint(client, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code), error
    assert engine.calls == []


def test_an_engine_refusal_of_a_schema_is_400_with_its_message(client: TestClient, engine: FakeEngine) -> None:
    engine.refuse = 'unsupported JSON schema: Unimplemented keys: ["if", "then"]'
    response = chat(client, structured_outputs={"json": {"if": {"type": "string"}, "then": {}}})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == engine.refuse


@pytest.mark.parametrize(
    ("params", "text", "holds"),
    [
        (StructuredOutputsParams(json=SCHEMA), '{"a":3}', True),
        (StructuredOutputsParams(json=SCHEMA), '{"a":4}', False),
        (StructuredOutputsParams(json=SCHEMA), '{"b":1}', False),
        (StructuredOutputsParams(json=SCHEMA), '{"a":', False),
        (StructuredOutputsParams(json={"type": "string", "format": "ipv4"}), '"10.0.0.1"', True),
        (StructuredOutputsParams(json={"type": "string", "format": "ipv4"}), '"10.0.0.300"', False),
        (StructuredOutputsParams(json_object=True), '{"x":[1]}', True),
        (StructuredOutputsParams(json_object=True), "[1]", False),
        (StructuredOutputsParams(regex="[0-9]{3}"), "123", True),
        (StructuredOutputsParams(regex="[0-9]{3}"), "1234", False),
        # A regex Python cannot compile is not checkable: it holds.
        (StructuredOutputsParams(regex="(?<name>x)"), "y", True),
        (StructuredOutputsParams(choice=("yes", "no")), "no", True),
        (StructuredOutputsParams(choice=("yes", "no")), "n", False),
        (StructuredOutputsParams(grammar='start: "a"'), "b", True),
    ],
)
def test_holds(params: StructuredOutputsParams, text: str, holds: bool) -> None:
    assert Constraint.of(params).holds(text) is holds
