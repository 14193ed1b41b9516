"""Chat messages (and tools) -> the model's chat template -> prompt token ids.

The template writes the special tokens, so the text is tokenized without adding any, and
the prompt length is known before submission. Messages are checked per role first (a 400
naming `messages[i].<field>`): `tool` messages need `tool_call_id` and `content`,
`tool_calls` belong to assistant messages and `tool_call_id` to tool messages.

Tools and tool turns go through the template when it knows them. Whether it does is
probed by rendering: a template that renders the same text with and without `tools`
ignores them, and one whose output lacks a probe call's name ignores `tool_calls`. For a
template that ignores them (the default model's ChatML template does), the server writes
them into the messages in the Hermes convention, as Qwen2.5's template does:

- tools: a `# Tools` block in the system message (added when there is none) listing each
  tool's JSON signature inside `<tools></tools>`, and asking for
  `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`;
- an assistant message's calls: that same `<tool_call>` text after its content;
- tool results: `<tool_response>\\n...\\n</tool_response>` in a user turn, consecutive
  results sharing one turn.

Assistant `tool_calls` reach a template that knows them with `arguments` decoded to an
object when they are JSON (as transformers' templates expect), else as the string.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tokenmill.server.errors import invalid
from tokenmill.server.protocol import ChatMessage

if TYPE_CHECKING:
    from tokenmill.engine.loader.tokenizer import Tokenizer

_PROBE_NAME = "tokenmill_probe_function"
_PROBE_TOOL: dict[str, Any] = {"type": "function", "function": {"name": _PROBE_NAME, "parameters": {"type": "object"}}}
_PROBE_USER: dict[str, Any] = {"role": "user", "content": "probe"}

HERMES_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
HERMES_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


@dataclass(frozen=True)
class TemplateSupport:
    """What the chat template renders itself."""

    tools: bool
    tool_calls: bool

    @classmethod
    def probe(cls, tokenizer: Tokenizer) -> TemplateSupport:
        plain = _try_render(tokenizer, [_PROBE_USER], None)
        with_tools = _try_render(tokenizer, [_PROBE_USER], [_PROBE_TOOL])
        call = {"id": "call_probe", "type": "function", "function": {"name": _PROBE_NAME, "arguments": {}}}
        turn: list[dict[str, Any]] = [_PROBE_USER, {"role": "assistant", "content": "", "tool_calls": [call]}]
        with_call = _try_render(tokenizer, turn, None)
        return cls(
            tools=plain is not None and with_tools is not None and with_tools != plain,
            tool_calls=with_call is not None and _PROBE_NAME in with_call,
        )


def render_chat_prompt(
    tokenizer: Tokenizer,
    messages: list[ChatMessage],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Messages -> chat-template text -> token ids; a message the template rejects is a 400."""
    if not messages:
        raise invalid("'messages' must contain at least one message", "messages")
    for i, message in enumerate(messages):
        _check_message(i, message)
    uses_tools = bool(tools) or any(m.role == "tool" or m.tool_calls for m in messages)
    support = TemplateSupport.probe(tokenizer) if uses_tools else TemplateSupport(True, True)
    if support.tool_calls:
        rendered = [_template_entry(m) for m in messages]
    else:
        rendered = _hermes_entries(messages)
    template_tools = tools if tools and support.tools else None
    if tools and not support.tools:
        rendered = _with_hermes_tools(rendered, tools)
    try:
        text = tokenizer.apply_chat_template(
            rendered, add_generation_prompt=add_generation_prompt, tools=template_tools
        )
    except ValueError as exc:
        raise invalid(str(exc), "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


def _check_message(i: int, message: ChatMessage) -> None:
    where = f"messages[{i}]"
    if message.role == "tool":
        if message.tool_call_id is None:
            raise invalid("a tool message needs 'tool_call_id'", f"{where}.tool_call_id")
        if message.content is None:
            raise invalid("a tool message needs 'content'", f"{where}.content")
    elif message.tool_call_id is not None:
        raise invalid("'tool_call_id' belongs to tool messages only", f"{where}.tool_call_id")
    if message.tool_calls is not None and message.role != "assistant":
        raise invalid("'tool_calls' belongs to assistant messages only", f"{where}.tool_calls")
    if message.content is None and message.role not in ("assistant", "tool"):
        raise invalid(f"a {message.role} message needs 'content'", f"{where}.content")


def _base_entry(message: ChatMessage) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": message.text(),
    }
    if message.name is not None:
        entry["name"] = message.name
    return entry


def _template_entry(message: ChatMessage) -> dict[str, Any]:
    entry = _base_entry(message)
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        entry["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _decoded(call.function.arguments)},
            }
            for call in message.tool_calls
        ]
    return entry


def _hermes_entries(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Tool turns as Hermes text, for a template that does not render them."""
    rendered: list[dict[str, Any]] = []
    previous_was_tool = False
    for message in messages:
        entry = _base_entry(message)
        if message.role == "tool":
            response = f"<tool_response>\n{entry['content']}\n</tool_response>"
            if previous_was_tool:
                rendered[-1]["content"] += "\n" + response
            else:
                rendered.append({"role": "user", "content": response})
            previous_was_tool = True
            continue
        previous_was_tool = False
        if message.tool_calls:
            calls = [
                "<tool_call>\n"
                + json.dumps(
                    {"name": c.function.name, "arguments": _decoded(c.function.arguments)}, ensure_ascii=False
                )
                + "\n</tool_call>"
                for c in message.tool_calls
            ]
            content = entry["content"]
            entry["content"] = (content + "\n" if content else "") + "\n".join(calls)
        rendered.append(entry)
    return rendered


def _with_hermes_tools(rendered: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    block = HERMES_TOOLS_HEADER + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    block += HERMES_TOOLS_FOOTER
    if rendered and rendered[0]["role"] == "system":
        first = dict(rendered[0])
        first["content"] = (first["content"] + "\n\n" if first["content"] else "") + block
        return [first, *rendered[1:]]
    return [{"role": "system", "content": block}, *rendered]


def _decoded(arguments: str) -> Any:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return value if isinstance(value, dict) else arguments


def _try_render(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str | None:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    except Exception:  # a template that cannot render the probe does not support it
        return None
