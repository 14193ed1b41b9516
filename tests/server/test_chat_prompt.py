"""render_chat_prompt: tools and tool turns through a template that knows them, and in the
Hermes convention for one that does not (the fake's, like the default model's ChatML)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from fake_engine import FakeTokenizer

from tokenmill.engine.loader.chat_template import CHATML_TEMPLATE, ChatTemplate
from tokenmill.server.chat_prompt import TemplateSupport, render_chat_prompt
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import ChatMessage

TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}
CONVERSATION = [
    {"role": "user", "content": "time?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "13:00"}]},
]

# Qwen2.5's way with tools, cut down to what the test needs.
# (trim_blocks eats a newline written right after a tag, hence the {{ NL }}.)
TOOL_TEMPLATE = (
    "{% set NL = '\\n' %}"
    "{% if tools %}<sys>TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{{ NL }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}<tool id={{ m.tool_call_id }}>{{ m.content }}{{ NL }}"
    "{% elif m.tool_calls %}<assistant>{% for c in m.tool_calls %}"
    "CALL {{ c.function.name }} {{ c.function.arguments.tz }};{% endfor %}{{ NL }}"
    "{% else %}<{{ m.role }}>{{ m.content }}{{ NL }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


class TemplateTokenizer(FakeTokenizer):
    def __init__(self, source: str) -> None:
        self.template = ChatTemplate(source)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, tools: Any = None
    ) -> str:
        return self.template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)


def render(tokenizer: FakeTokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    parsed = [ChatMessage.model_validate(m) for m in messages]
    return bytes(render_chat_prompt(tokenizer, parsed, tools=tools)).decode()


def test_probe() -> None:
    assert TemplateSupport.probe(FakeTokenizer()) == TemplateSupport(tools=False, tool_calls=False)
    assert TemplateSupport.probe(TemplateTokenizer(CHATML_TEMPLATE)) == TemplateSupport(tools=False, tool_calls=False)
    assert TemplateSupport.probe(TemplateTokenizer(TOOL_TEMPLATE)) == TemplateSupport(tools=True, tool_calls=True)


def test_a_template_that_knows_tools_renders_them() -> None:
    text = render(TemplateTokenizer(TOOL_TEMPLATE), CONVERSATION, [TOOL])
    assert text == (
        "<sys>TOOLS:get_time;\n<user>time?\n<assistant>CALL get_time UTC;\n"
        "<tool id=call_1>12:00\n<tool id=call_2>13:00\n<assistant>"
    )


def test_hermes_fallback_for_a_template_that_ignores_them() -> None:
    text = render(FakeTokenizer(), CONVERSATION, [TOOL])
    assert text == (
        "<system># Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}\n'
        "</tools>\n\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n'
        "<user>time?\n"
        '<assistant><tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>\n'
        "<user><tool_response>\n12:00\n</tool_response>\n<tool_response>\n13:00\n</tool_response>\n"
        "<assistant>"
    )


def test_hermes_tools_join_an_existing_system_message_and_keep_assistant_text() -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "assistant", "content": "Checking.", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "not json"}}]},
    ]
    text = render(FakeTokenizer(), messages, [TOOL])
    assert text.startswith("<system>Be brief.\n\n# Tools\n")
    assert '<assistant>Checking.\n<tool_call>\n{"name": "f", "arguments": "not json"}\n</tool_call>\n' in text


def test_without_tools_nothing_changes() -> None:
    assert render(FakeTokenizer(), [{"role": "user", "content": "hi"}]) == "<user>hi\n<assistant>"


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "content": "x"}, "messages[0].tool_call_id"),
        ({"role": "tool", "tool_call_id": "c"}, "messages[0].content"),
        ({"role": "user", "content": "x", "tool_call_id": "c"}, "messages[0].tool_call_id"),
        ({"role": "system", "content": "x", "tool_calls": [CALL]}, "messages[0].tool_calls"),
        ({"role": "user"}, "messages[0].content"),
    ],
)
def test_role_rules(message: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        render(FakeTokenizer(), [message])
    assert info.value.status_code == 400
    assert info.value.param == param
