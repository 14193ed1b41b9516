"""Structured outputs, tool calls and logits processors on the real server and model, with
the official client: every constrained output that ends "stop" validates (checked here
with `jsonschema`), and what cannot be enforced is a 400.

One `tokenmill serve` subprocess for the module (as test_real_server.py starts it).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import free_port
from test_real_server import KEY, MODEL, ROOT, Server, running_server

pytestmark = pytest.mark.slow

FORMAT_CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER
ASK = [{"role": "user", "content": "Describe a person as JSON."}]

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested_objects": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 24}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array_bounds": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 2, "maxItems": 4}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]}},
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, "email": {"type": "string", "format": "email", "maxLength": 40}},
        "required": ["id", "email"],
        "additionalProperties": False,
    },
    "anyof_null": {
        "type": "object",
        "properties": {"nickname": {"anyOf": [{"type": "string", "maxLength": 16}, {"type": "null"}]}, "age": {"type": ["integer", "null"], "minimum": 0, "maximum": 150}},
        "required": ["nickname", "age"],
        "additionalProperties": False,
    },
    "number_ranges": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "temperature": {"type": "number", "exclusiveMinimum": -50, "exclusiveMaximum": 60},
        },
        "required": ["age", "score", "temperature"],
        "additionalProperties": False,
    },
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "pattern": "^[A-Za-z/_]{1,30}$"}}, "required": ["timezone"], "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone", "parameters": TIME}},
]
TOOL_SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, "-m", "tokenmill.cli.main", "serve", MODEL, "--port", str(port), "--api-key", KEY, "--max-model-len", "2048"]
    with running_server(cmd, env, port, log) as server:
        yield server


def assert_valid(text: str | None, schema: dict[str, Any]) -> Any:
    assert text is not None
    value = json.loads(text)
    jsonschema.validate(value, schema, format_checker=FORMAT_CHECKER)
    # Compact: no free whitespace outside strings.
    assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', "", text)), text
    return value


def json_schema_format(schema: dict[str, Any]) -> Any:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def structured_metrics(server: Server) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.base}/metrics").text):
        for s in family.samples:
            if "structured_output" in s.name or "grammar_compile" in s.name:
                suffix = "{" + s.labels["kind"] + "}" if "kind" in s.labels else ""
                if "le" not in s.labels:
                    out[s.name + suffix] = s.value
    return out


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_valid_at_temperature_0_and_1(server: Server, name: str) -> None:
    client = server.client()
    schema = SCHEMAS[name]
    greedy = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=json_schema_format(schema), temperature=0, max_tokens=300  # type: ignore[arg-type]
    )
    assert greedy.choices[0].finish_reason == "stop"
    assert_valid(greedy.choices[0].message.content, schema)
    # Three seeded samples (seeds 7, 8, 9), through vLLM's extra body this time.
    sampled = client.chat.completions.create(
        model=MODEL, messages=ASK, temperature=1.0, seed=7, n=3, max_tokens=300,  # type: ignore[arg-type]
        extra_body={"structured_outputs": {"json": schema}},
    )
    for choice in sampled.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert_valid(choice.message.content, schema)


def test_json_object(server: Server) -> None:
    client = server.client()
    messages = [{"role": "user", "content": "Give a JSON object with a key 'city' naming a big city."}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, response_format={"type": "json_object"}, temperature=0, max_tokens=200  # type: ignore[arg-type]
    )
    assert response.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(response.choices[0].message.content or ""), dict)


def test_regex_and_choice(server: Server) -> None:
    client = server.client()
    for temperature, seed in ((0.0, None), (1.0, 3)):
        out = client.completions.create(
            model=MODEL, prompt="Call me at", max_tokens=30, temperature=temperature, seed=seed,
            extra_body={"structured_outputs": {"regex": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"}},
        )
        assert out.choices[0].finish_reason == "stop"
        assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", out.choices[0].text)
    choices = ["positive", "negative", "neutral"]
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Sentiment of 'I love it'?"}], max_tokens=10, n=4,
        temperature=1.0, seed=5, extra_body={"structured_outputs": {"choice": choices}},
    )
    assert all(c.finish_reason == "stop" and c.message.content in choices for c in response.choices)


def test_grammar_lark_and_gbnf(server: Server) -> None:
    client = server.client()
    grammars = {
        "lark": 'start: "The answer is " ANSWER "."\nANSWER: /(yes|no)/',
        "gbnf": 'root ::= "The answer is " ("yes" | "no") "."',
    }
    for grammar in grammars.values():
        response = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Is water wet?"}], max_tokens=20, temperature=0,
            extra_body={"structured_outputs": {"grammar": grammar}},
        )
        assert response.choices[0].finish_reason == "stop"
        assert response.choices[0].message.content in ("The answer is yes.", "The answer is no.")


def test_streaming_equals_non_streaming(server: Server) -> None:
    client = server.client()
    schema = SCHEMAS["enum"]
    kwargs: dict[str, Any] = {"model": MODEL, "messages": ASK, "response_format": json_schema_format(schema), "temperature": 0, "max_tokens": 300}
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    assert_valid(text, schema)


def test_16_concurrent_constrained_requests(server: Server) -> None:
    names = sorted(SCHEMAS)

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, str | None]:
        name = names[i % len(names)]
        response = await client.chat.completions.create(
            model=MODEL, messages=ASK, response_format=json_schema_format(SCHEMAS[name]),  # type: ignore[arg-type]
            temperature=1.0, seed=100 + i, max_tokens=300,
        )
        return name, response.choices[0].finish_reason, response.choices[0].message.content

    async def run_all() -> list[tuple[str, str | None, str | None]]:
        client = openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key=KEY, max_retries=0, timeout=600)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(16)))
        finally:
            await client.close()

    for name, finish, text in asyncio.run(run_all()):
        assert finish == "stop", (name, text)
        assert_valid(text, SCHEMAS[name])


def test_max_tokens_cut_is_length(server: Server) -> None:
    client = server.client()
    before = structured_metrics(server)
    response = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=json_schema_format(SCHEMAS["nested_objects"]), temperature=0, max_tokens=5  # type: ignore[arg-type]
    )
    assert response.choices[0].finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(response.choices[0].message.content or "")
    after = structured_metrics(server)
    assert after["tokenmill:structured_output_invalid_total"] == before["tokenmill:structured_output_invalid_total"]


@pytest.mark.parametrize(
    ("schema", "named"),
    [
        ({"type": "string", "if": {"minLength": 1}, "then": {"maxLength": 3}}, '"if"'),
        ({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas"),
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"not": {"type": "string"}}, '"not"'),
        ({"type": "string", "format": "credit-card"}, "credit-card"),
    ],
)
def test_unsupported_schema_keyword_is_400_naming_it(server: Server, schema: dict[str, Any], named: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(
            model=MODEL, messages=ASK, response_format=json_schema_format(schema), max_tokens=10  # type: ignore[arg-type]
        )
    assert named in str(info.value)


def test_stop_with_a_constraint_is_400(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(
            model=MODEL, messages=ASK, response_format={"type": "json_object"}, stop=["}"], max_tokens=10
        )
    assert info.value.body["param"] == "stop"  # type: ignore[index]


def test_named_tool_call_validates(server: Server) -> None:
    client = server.client()
    choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    response = client.chat.completions.create(
        model=MODEL, messages=WEATHER_QUESTION, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=100  # type: ignore[arg-type]
    )
    (result,) = response.choices
    assert result.finish_reason == "tool_calls"
    assert result.message.content is None
    (call,) = result.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert_valid(call.function.arguments, WEATHER)  # type: ignore[union-attr]
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=WEATHER_QUESTION, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=100, stream=True  # type: ignore[arg-type]
        )
    )
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function and deltas[0].function.name == "get_weather"
    arguments = "".join((d.function.arguments or "") if d.function else "" for d in deltas)
    assert arguments == call.function.arguments  # type: ignore[union-attr]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_tool_calls_validate(server: Server) -> None:
    client = server.client()
    for temperature, seed in ((0.0, None), (1.0, 11), (1.0, 12)):
        response = client.chat.completions.create(
            model=MODEL, messages=WEATHER_QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,  # type: ignore[arg-type]
            temperature=temperature, seed=seed, max_tokens=150,
        )
        (result,) = response.choices
        assert result.finish_reason == "tool_calls"
        (call,) = result.message.tool_calls or []
        name = call.function.name  # type: ignore[union-attr]
        assert_valid(call.function.arguments, TOOL_SCHEMAS[name])  # type: ignore[union-attr]
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=WEATHER_QUESTION, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=300, stream=True  # type: ignore[arg-type]
        )
    )
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    starts = [d for d in deltas if d.id]
    assert starts and all(d.function and d.function.name in TOOL_SCHEMAS for d in starts)
    for start in starts:
        arguments = "".join(d.function.arguments or "" for d in deltas if d.index == start.index and d.function)
        assert_valid(arguments, TOOL_SCHEMAS[start.function.name])  # type: ignore[union-attr, index]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_and_a_multi_turn_tool_result(server: Server) -> None:
    client = server.client()
    response = client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, tools=TOOLS, temperature=0, max_tokens=60)  # type: ignore[arg-type]
    (result,) = response.choices
    # The model chooses; whatever it chose, the message is consistent with the finish reason.
    assert (result.finish_reason == "tool_calls") == bool(result.message.tool_calls)
    for call in result.message.tool_calls or []:
        assert call.function.name in TOOL_SCHEMAS  # type: ignore[union-attr]
        json.loads(call.function.arguments)  # type: ignore[union-attr]
    arguments = json.dumps({"city": "Paris", "unit": "celsius"})
    turns: list[Any] = [
        *WEATHER_QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    with_tools = httpx.post(f"{server.base}/tokenize", json={"messages": turns}, headers=server.auth).json()
    assert with_tools["count"] > 0
    answer = client.chat.completions.create(model=MODEL, messages=turns, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=30)  # type: ignore[arg-type]
    assert answer.choices[0].message.content
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_logits_processors(server: Server) -> None:
    client = server.client()
    messages = [{"role": "user", "content": "Say 'ha' twenty times, separated by spaces."}]
    response = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=40, logprobs=True,  # type: ignore[arg-type]
        extra_body={"logits_processors": ["no_repeat"]},
    )
    tokens = [t.token for t in response.choices[0].logprobs.content or []]  # type: ignore[union-attr]
    assert len(tokens) >= 2
    assert all(a != b for a, b in itertools.pairwise(tokens)), tokens
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, extra_body={"logits_processors": ["no_such_processor"]})
    assert "no_such_processor" in str(info.value)


def test_metrics_count_kinds_and_no_invalid_output(server: Server) -> None:
    client = server.client()
    before = structured_metrics(server)
    client.chat.completions.create(model=MODEL, messages=ASK, response_format={"type": "json_object"}, max_tokens=5)
    client.chat.completions.create(model=MODEL, messages=ASK, response_format=json_schema_format({"type": "integer"}), max_tokens=5)  # type: ignore[arg-type]
    client.completions.create(model=MODEL, prompt="n:", max_tokens=5, extra_body={"structured_outputs": {"regex": "[0-9]+"}})
    client.completions.create(model=MODEL, prompt="n:", max_tokens=5, extra_body={"structured_outputs": {"choice": ["a", "b"]}})
    client.completions.create(model=MODEL, prompt="n:", max_tokens=5, extra_body={"structured_outputs": {"grammar": 'start: "x"'}})
    client.chat.completions.create(model=MODEL, messages=WEATHER_QUESTION, tools=TOOLS, tool_choice="required", max_tokens=5)  # type: ignore[arg-type]
    after = structured_metrics(server)
    for kind in ("json", "json_object", "regex", "choice", "grammar", "tool_call"):
        name = f"tokenmill:structured_output_requests_total{{{kind}}}"
        assert after[name] - before[name] == 1, kind
    # Over every request this server has served so far.
    assert after["tokenmill:structured_output_invalid_total"] == 0
    assert after["tokenmill:grammar_compile_seconds_count"] >= 1
