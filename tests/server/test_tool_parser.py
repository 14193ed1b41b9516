"""HermesToolParser: calls out of `<tool_call>` blocks, the rest as content, any split."""

from __future__ import annotations

import json

import pytest

from tokenmill.server.tool_calls import assemble
from tokenmill.server.tool_parser import (
    Content,
    HermesToolParser,
    Piece,
    ToolCallArguments,
    ToolCallStart,
)

TOOLS = ["get_weather", "get_time"]
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def parse(text: str, *, parallel: bool = True, step: int | None = None) -> list[Piece]:
    parser = HermesToolParser(TOOLS, parallel=parallel)
    pieces: list[Piece] = []
    chunks = [text] if step is None else [text[i : i + step] for i in range(0, len(text), step)]
    for chunk in chunks:
        pieces += parser.feed(chunk)
    return pieces + parser.finish()


def summary(pieces: list[Piece]) -> tuple[str | None, list[tuple[str, dict[str, object]]]]:
    message = assemble(pieces)
    return message.content, [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]


CASES = [
    ("Hello there.\n", ("Hello there.\n", [])),
    ("", ("", [])),
    (WEATHER, (None, [("get_weather", {"city": "Paris"})])),
    ("Let me check.\n" + WEATHER, ("Let me check.", [("get_weather", {"city": "Paris"})])),
    (WEATHER + "\n" + TIME + "\n", (None, [("get_weather", {"city": "Paris"}), ("get_time", {})])),
    (WEATHER + "\nDone.", ("Done.", [("get_weather", {"city": "Paris"})])),
    # Not a call: kept as text, whitespace included.
    ("a\n<tool_call>\nnot json\n</tool_call>", ("a\n<tool_call>\nnot json\n</tool_call>", [])),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', [])),
    ('<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>', ('<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>', [])),
    ('x <tool_call>{"name": "get_time", "arguments"', ('x <tool_call>{"name": "get_time", "arguments"', [])),
    ("3 <tool_ca", ("3 <tool_ca", [])),
    # arguments as a JSON string are decoded; missing arguments mean none.
    ('<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>', (None, [("get_time", {"tz": "UTC"})])),
    ('<tool_call>{"name": "get_time"}</tool_call>', (None, [("get_time", {})])),
    # A bad block between two good ones stays text, in place.
    (WEATHER + "\n<tool_call>oops</tool_call>\n" + TIME, ("<tool_call>oops</tool_call>", [("get_weather", {"city": "Paris"}), ("get_time", {})])),
]


@pytest.mark.parametrize(("text", "expected"), CASES)
def test_whole_text(text: str, expected: tuple[str | None, list[tuple[str, dict[str, object]]]]) -> None:
    assert summary(parse(text)) == expected


@pytest.mark.parametrize("step", [1, 2, 3, 5, 7, 11])
@pytest.mark.parametrize(("text", "expected"), CASES)
def test_any_split_gives_the_same_message(
    text: str, expected: tuple[str | None, list[tuple[str, dict[str, object]]]], step: int
) -> None:
    assert summary(parse(text, step=step)) == expected


def test_not_parallel_keeps_only_the_first_call() -> None:
    content, calls = summary(parse(WEATHER + "\n" + TIME, parallel=False))
    assert calls == [("get_weather", {"city": "Paris"})]
    assert content == TIME


def without_ids(pieces: list[Piece]) -> list[Piece]:
    return [ToolCallStart(p.index, "", p.name) if isinstance(p, ToolCallStart) else p for p in pieces]


def test_streaming_holds_back_only_a_possible_opener_and_trailing_blanks() -> None:
    parser = HermesToolParser(TOOLS)
    assert parser.feed("Sure") == [Content("Sure")]
    assert parser.feed(", one moment <tool") == [Content(", one moment")]
    assert parser.feed("_call>\n") == []
    assert without_ids(parser.feed('{"name": "get_time", "arguments": {}}\n</tool_call>')) == [
        ToolCallStart(0, "", "get_time"),
        ToolCallArguments(0, "{}"),
    ]
    assert parser.feed("\n") == []
    assert parser.feed("Bye ") == [Content("Bye")]
    assert parser.finish() == [Content(" ")]


def test_call_ids_are_fresh() -> None:
    ids = {p.id for p in parse(WEATHER + TIME) if isinstance(p, ToolCallStart)}
    assert len(ids) == 2
    assert all(i.startswith("call_") and len(i) == 29 for i in ids)
