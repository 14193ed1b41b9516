"""Reading tool calls out of a model's text, incrementally, as it streams.

A ToolParser is fed a choice's text deltas and turns them into pieces: content text, the
start of a call (index, id, name) and fragments of its arguments (a JSON text). The same
parser serves streaming (each piece becomes a delta) and non-streaming (the pieces are
summed into one message), so both paths give the same answer by construction. One parser
per convention; `tool_choice: "auto"` uses the model's convention, and the constrained
modes (a named function, "required") have their own readers in tool_calls.py.

The Hermes convention (Qwen2.5, Hermes, many others), used by HermesToolParser:

    Let me check.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Each `<tool_call>...</tool_call>` block whose body is a JSON object naming a known tool,
with an `arguments` object, is a call. Anything else is content: text outside blocks, a
block that does not parse or names an unknown tool (returned as its original text, never
dropped), and an unclosed block at the end. While streaming, content is sent as it comes,
except a tail that could be the start of `<tool_call>` and a trailing run of whitespace
(the separator before a block is dropped when the block is a call, kept otherwise); the
whitespace right after a call's closing tag is dropped too.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    # The call's position in this choice's tool_calls.
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    index: int
    # A fragment of the arguments' JSON text; the fragments of a call concatenate to it.
    text: str


Piece = Content | ToolCallStart | ToolCallArguments


class ToolParser(Protocol):
    def feed(self, text: str) -> list[Piece]:
        """The pieces `text` (the next delta) completes."""
        ...

    def finish(self) -> list[Piece]:
        """The output ended: whatever is still held back."""
        ...


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class HermesToolParser:
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"

    def __init__(self, tool_names: Collection[str], *, parallel: bool = True) -> None:
        """`parallel` False: only the first valid block is a call; later ones stay text."""
        self._tool_names = frozenset(tool_names)
        self._parallel = parallel
        self._buffer = ""
        self._in_block = False
        # Whitespace held back at the end of the content sent so far.
        self._held = ""
        self._after_call = False
        self._num_calls = 0

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        pieces: list[Piece] = []
        while True:
            if not self._in_block:
                start = self._buffer.find(self.OPEN)
                if start < 0:
                    keep = _partial_suffix(self._buffer, self.OPEN)
                    self._content(self._buffer[: len(self._buffer) - keep], pieces)
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return pieces
                self._content(self._buffer[:start], pieces)
                self._buffer = self._buffer[start + len(self.OPEN) :]
                self._in_block = True
            end = self._buffer.find(self.CLOSE)
            if end < 0:
                return pieces
            body = self._buffer[:end]
            self._buffer = self._buffer[end + len(self.CLOSE) :]
            self._in_block = False
            self._block(body, pieces)

    def finish(self) -> list[Piece]:
        rest = (self.OPEN if self._in_block else "") + self._buffer
        self._buffer, self._in_block = "", False
        pieces: list[Piece] = []
        if self._after_call:
            rest = rest.lstrip()
        text = self._held + rest
        self._held = ""
        if text:
            pieces.append(Content(text))
        return pieces

    def _content(self, text: str, pieces: list[Piece]) -> None:
        """Send `text` as content, holding back its trailing whitespace."""
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._held + text
        body = text.rstrip()
        self._held = text[len(body) :]
        if body:
            pieces.append(Content(body))

    def _block(self, body: str, pieces: list[Piece]) -> None:
        call = self._parse(body) if self._parallel or self._num_calls == 0 else None
        if call is None:
            self._after_call = False
            pieces.append(Content(self._held + self.OPEN + body + self.CLOSE))
            self._held = ""
            return
        name, arguments = call
        index = self._num_calls
        self._num_calls += 1
        self._held = ""
        self._after_call = True
        pieces.append(ToolCallStart(index, new_call_id(), name))
        pieces.append(ToolCallArguments(index, arguments))

    def _parse(self, body: str) -> tuple[str, str] | None:
        """(name, arguments JSON) of a block's body, or None when it is not a valid call."""
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or value.get("name") not in self._tool_names:
            return None
        arguments = value.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        return value["name"], compact_json(arguments)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
