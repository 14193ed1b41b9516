"""Tool calling over the FakeEngine: the constraint each tool_choice sends, the calls that
come back (non-streaming and as OpenAI deltas), finish reasons and the 400s."""

from __future__ import annotations

from typing import Any

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_harness import parse_sse

from tokenmill.engine.structured_output.spec import StructuredOutputsParams
from tokenmill.server.tool_calls import RequiredCallsReader, assemble
from tokenmill.server.tool_parser import Content, ToolCallArguments, ToolCallStart

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "weather?"}]
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time"}},
]
NO_ARGS = {"type": "object", "properties": {}, "additionalProperties": False}


@pytest.fixture
def engine() -> FakeEngine:
    # Byte tokens: the Hermes tools block alone is ~700 of them.
    return FakeEngine(max_model_len=4096)


def post(client: TestClient, **fields: Any) -> Any:
    response = client.post(CHAT, json={"messages": USER, "tools": TOOLS, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def stream(client: TestClient, **fields: Any) -> list[Any]:
    body = {"messages": USER, "tools": TOOLS, "stream": True, **fields}
    with client.stream("POST", CHAT, json=body) as response:
        assert response.status_code == 200
        return parse_sse(response.read().decode())


def sent(engine: FakeEngine) -> StructuredOutputsParams | None:
    return engine.calls[-1].params.structured_outputs


def test_named_function_is_constrained_to_its_parameters(client: TestClient, engine: FakeEngine) -> None:
    engine.reply = '{"city":"Paris","days":2}'
    body = post(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert sent(engine) == StructuredOutputsParams(json=WEATHER_PARAMS)
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_")
    assert call == {
        "id": call["id"],
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Paris","days":2}'},
    }


def test_required_is_an_array_of_calls_over_every_tool(client: TestClient, engine: FakeEngine) -> None:
    engine.reply = '[{"name":"get_weather","arguments":{"city":"Oslo"}},{"name":"get_time","arguments":{}}]'
    body = post(client, tool_choice="required")
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, params in (("get_weather", WEATHER_PARAMS), ("get_time", NO_ARGS))
    ]
    assert sent(engine) == StructuredOutputsParams(json={"type": "array", "minItems": 1, "items": {"anyOf": calls}})
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [
        ("get_weather", '{"city":"Oslo"}'),
        ("get_time", "{}"),
    ]
    post(client, tool_choice="required", parallel_tool_calls=False)
    schema = sent(engine)
    assert schema is not None and isinstance(schema.json, dict)
    assert schema.json["maxItems"] == 1


def test_auto_parses_hermes_calls_and_keeps_the_text(client: TestClient, engine: FakeEngine) -> None:
    engine.reply = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    body = post(client)
    assert sent(engine) is None
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Checking."
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":"Rome"}'}


def test_auto_without_a_call_is_plain_text(client: TestClient, engine: FakeEngine) -> None:
    engine.reply = "It is sunny. <tool_call>{broken}</tool_call>"
    body = post(client, tool_choice="auto")
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": engine.reply, "refusal": None}


def test_none_sends_no_tools_and_parses_nothing(client: TestClient, engine: FakeEngine) -> None:
    engine.reply = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    body = post(client, tool_choice="none")
    assert body["choices"][0]["message"]["content"] == engine.reply
    assert body["choices"][0]["finish_reason"] == "stop"
    assert "# Tools" not in bytes(engine.calls[-1].prompt).decode()


def test_length_stays_length_with_the_partial_call(client: TestClient, engine: FakeEngine) -> None:
    engine.reply = '{"city":"Paris"}'
    body = post(client, tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=5)
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"cit'


def test_streamed_named_call_deltas(client: TestClient, engine: FakeEngine) -> None:
    engine.reply = '{"city":"Rio"}'
    events = stream(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    first = deltas[1]["tool_calls"][0]
    assert first == {
        "index": 0, "id": first["id"], "type": "function", "function": {"name": "get_weather", "arguments": ""}
    }
    fragments = [d["tool_calls"][0] for d in deltas[2:-1]]
    assert all(set(f) == {"index", "function"} and f["index"] == 0 for f in fragments)
    assert "".join(f["function"]["arguments"] for f in fragments) == engine.reply
    assert len(fragments) == len(engine.reply)
    assert deltas[-1] == {}
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_streamed_required_calls_arrive_as_each_object_completes(client: TestClient, engine: FakeEngine) -> None:
    engine.reply = '[{"name":"get_time","arguments":{}},{"name":"get_weather","arguments":{"city":"a}"}}]'
    events = stream(client, tool_choice="required")
    deltas = [e["choices"][0]["delta"] for e in events[1:-2]]
    assert [d["tool_calls"][0]["index"] for d in deltas] == [0, 0, 1, 1]
    assert [d["tool_calls"][0]["function"] for d in deltas] == [
        {"name": "get_time", "arguments": ""},
        {"arguments": "{}"},
        {"name": "get_weather", "arguments": ""},
        {"arguments": '{"city":"a}"}'},
    ]
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


def test_streamed_auto_content_then_calls_equals_non_streaming(client: TestClient, engine: FakeEngine) -> None:
    engine.reply = 'On it <tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>\n'
    events = stream(client)
    deltas = [e["choices"][0]["delta"] for e in events[1:-2]]
    content = "".join(d.get("content", "") for d in deltas)
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert content == "On it"
    assert [c["function"] for c in calls] == [{"name": "get_time", "arguments": ""}, {"arguments": '{"tz":"UTC"}'}]
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    message = post(client)["choices"][0]["message"]
    assert message["content"] == content
    assert message["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"tz":"UTC"}'}


def test_streaming_with_n_keeps_a_parser_per_choice(client: TestClient, engine: FakeEngine) -> None:
    engine.reply = '{"city":"X"}'
    events = stream(client, n=2, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for index in (0, 1):
        choice_events = [c for e in events[:-1] for c in e["choices"] if c["index"] == index]
        starts = [c["delta"]["tool_calls"][0] for c in choice_events if "id" in c["delta"].get("tool_calls", [{}])[0]]
        assert len(starts) == 1
        assert choice_events[-1]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tools": None, "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"tools": None, "parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [*TOOLS, TOOLS[1]]}, "tools[2].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]}, "tools[0].function.parameters"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"tool_choice": "required", "structured_outputs": {"regex": "a"}}, "structured_outputs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tool_choice": "required", "stop": ["x"]}, "stop"),
    ],
)
def test_bad_tool_requests_are_400(client: TestClient, engine: FakeEngine, fields: dict[str, Any], param: str) -> None:
    body = {"messages": USER, "tools": TOOLS, **fields}
    if body["tools"] is None:
        del body["tools"]
    response = client.post(CHAT, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert engine.calls == []


def test_tool_choice_none_without_tools_is_harmless(client: TestClient, engine: FakeEngine) -> None:
    response = client.post(CHAT, json={"messages": USER, "tool_choice": "none", "tools": [], "max_tokens": 1})
    assert response.status_code == 200, response.text


def test_required_reader_returns_a_cut_element_as_content() -> None:
    reader = RequiredCallsReader()
    pieces = reader.feed('[{"name":"f","arguments":{"a":"[{"}}, {"name":"g","argu')
    pieces += reader.finish()
    assert [type(p) for p in pieces] == [ToolCallStart, ToolCallArguments, Content]
    assert pieces[1] == ToolCallArguments(0, '{"a":"[{"}')
    assert pieces[2] == Content('{"name":"g","argu')
    message = assemble(pieces)
    assert message.content == '{"name":"g","argu'
    assert [c.function.name for c in message.tool_calls] == ["f"]
