"""Tool calling: what `tools` + `tool_choice` ask of a chat request, and its calls back out.

    tool_choice            prompt gets tools   output constraint               read by
    "none"                 no                  none (free text)                 -
    "auto" (the default)   yes                 none: the model chooses          HermesToolParser
    "required"             yes                 a JSON array of calls            RequiredCallsReader
    {"function": {name}}   yes                 that function's `parameters`     NamedCallReader

With "required" the output is constrained to

    [{"name": <one tool's name>, "arguments": <that tool's parameters>}, ...]

(an anyOf over the tools; `minItems` 1, and `maxItems` 1 when `parallel_tool_calls` is
false), so each element is a call whose arguments satisfy its function's schema; with a
named function the whole output *is* the arguments object. A function without
`parameters` takes none: its arguments are `{}`. The choice's finish_reason becomes
"tool_calls" when the engine ended it with "stop" and it holds a call; "length" stays
"length" (a call cut mid-arguments keeps its partial arguments, as streamed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from tokenmill.engine.structured_output.spec import StructuredOutputsParams
from tokenmill.server.constraints import Constraint, json_schema_validator
from tokenmill.server.errors import invalid
from tokenmill.server.protocol import ChatCompletionRequest, NamedToolChoice, Tool
from tokenmill.server.responses import FunctionCall, ToolCallOut
from tokenmill.server.tool_parser import (
    Content,
    HermesToolParser,
    Piece,
    ToolCallArguments,
    ToolCallStart,
    ToolParser,
    compact_json,
    new_call_id,
)

Mode = Literal["none", "auto", "required", "named"]
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolPlan:
    mode: Mode
    tools: tuple[Tool, ...]
    parallel: bool
    # The function tool_choice names (mode "named").
    named: str | None = None

    @classmethod
    def of(cls, body: ChatCompletionRequest) -> ToolPlan | None:
        """None when the request has no tools; a 400 for an inconsistent tool_choice."""
        tools = tuple(body.tools or ())
        choice = body.tool_choice
        if not tools:
            if choice not in (None, "none"):
                raise invalid("'tool_choice' is only allowed when 'tools' are specified", "tool_choice")
            if body.parallel_tool_calls is not None:
                raise invalid("'parallel_tool_calls' is only allowed when 'tools' are specified", "parallel_tool_calls")
            return None
        names = [t.function.name for t in tools]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise invalid(f"tool name {name!r} is defined twice", f"tools[{i}].function.name")
        for i, tool in enumerate(tools):
            if tool.function.parameters is not None:
                json_schema_validator(tool.function.parameters, f"tools[{i}].function.parameters")
        parallel = body.parallel_tool_calls is not False
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise invalid(
                    f"tool_choice names {choice.function.name!r}, which is not in 'tools' "
                    f"({', '.join(names)})",
                    "tool_choice.function.name",
                )
            return cls("named", tools, parallel, choice.function.name)
        return cls(choice or "auto", tools, parallel)

    @property
    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template sees them; None with "none" (the model may not call)."""
        if self.mode == "none":
            return None
        return [t.model_dump(mode="json", exclude_none=True) for t in self.tools]

    def constraint(self) -> Constraint | None:
        if self.mode == "named":
            arguments = self._parameters(self.named)
            return Constraint.of(StructuredOutputsParams(json=arguments), "tool_call")
        if self.mode == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": t.function.name},
                        "arguments": self._parameters(t.function.name),
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for t in self.tools
            ]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
            return Constraint.of(StructuredOutputsParams(json=schema), "tool_call")
        return None

    def new_parser(self) -> ToolParser | None:
        """A fresh reader for one choice; None when the output is plain content."""
        if self.mode == "named":
            assert self.named is not None
            return NamedCallReader(self.named)
        if self.mode == "required":
            return RequiredCallsReader()
        if self.mode == "auto":
            return HermesToolParser([t.function.name for t in self.tools], parallel=self.parallel)
        return None

    def _parameters(self, name: str | None) -> dict[str, Any]:
        tool = next(t for t in self.tools if t.function.name == name)
        return dict(tool.function.parameters) if tool.function.parameters is not None else NO_ARGUMENTS


class NamedCallReader:
    """The whole output is the arguments of one call: each delta is a fragment of them."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._started = False

    def feed(self, text: str) -> list[Piece]:
        pieces: list[Piece] = self._start()
        if text:
            pieces.append(ToolCallArguments(0, text))
        return pieces

    def finish(self) -> list[Piece]:
        return self._start()

    def _start(self) -> list[Piece]:
        if self._started:
            return []
        self._started = True
        return [ToolCallStart(0, new_call_id(), self._name)]


class RequiredCallsReader:
    """The output is a JSON array of {"name", "arguments"}: each element becomes a call as
    soon as its closing brace arrives. A scan of the top level tracks depth and strings;
    text that never completes an element (a cut output) is returned as content."""

    def __init__(self) -> None:
        self._text = ""
        self._scanned = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._element_start: int | None = None
        # End of the last element turned into a call.
        self._consumed = 0
        self._num_calls = 0

    def feed(self, text: str) -> list[Piece]:
        self._text += text
        pieces: list[Piece] = []
        for pos in range(self._scanned, len(self._text)):
            char = self._text[pos]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "[{":
                if self._depth == 1 and char == "{":
                    self._element_start = pos
                self._depth += 1
            elif char in "]}":
                self._depth -= 1
                if self._depth == 1 and char == "}" and self._element_start is not None:
                    pieces += self._element(self._text[self._element_start : pos + 1])
                    self._element_start = None
                    self._consumed = pos + 1
        self._scanned = len(self._text)
        return pieces

    def finish(self) -> list[Piece]:
        rest = self._text[self._consumed :].strip().lstrip("[,").strip()
        if rest in ("", "]"):
            return []
        return [Content(rest)]

    def _element(self, text: str) -> list[Piece]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return [Content(text)]
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return [Content(text)]
        index = self._num_calls
        self._num_calls += 1
        arguments = compact_json(value.get("arguments", {}))
        return [ToolCallStart(index, new_call_id(), value["name"]), ToolCallArguments(index, arguments)]


@dataclass
class ParsedMessage:
    content: str | None
    tool_calls: list[ToolCallOut]


def assemble(pieces: list[Piece]) -> ParsedMessage:
    """Sum a choice's pieces into its message: content is None when it is empty and there
    are calls."""
    content = ""
    calls: list[ToolCallOut] = []
    for piece in pieces:
        if isinstance(piece, Content):
            content += piece.text
        elif isinstance(piece, ToolCallStart):
            calls.append(ToolCallOut(id=piece.id, function=FunctionCall(name=piece.name, arguments="")))
        else:
            call = calls[piece.index]
            call.function.arguments += piece.text
    return ParsedMessage(None if calls and not content else content, calls)


def stream_delta(piece: ToolCallStart | ToolCallArguments) -> dict[str, Any]:
    """One piece of a call as an OpenAI streaming `tool_calls` delta."""
    if isinstance(piece, ToolCallStart):
        entry: dict[str, Any] = {
            "index": piece.index,
            "id": piece.id,
            "type": "function",
            "function": {"name": piece.name, "arguments": ""},
        }
    else:
        entry = {"index": piece.index, "function": {"arguments": piece.text}}
    return {"tool_calls": [entry]}


def finish_reason(engine_reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if engine_reason == "stop" and has_calls else engine_reason
