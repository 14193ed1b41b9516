"""Workloads are deterministic per seed and have exactly the shape they promise."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from tokenmill.bench.workloads import (
    DEFAULT_ID_RANGE,
    BenchRequest,
    LengthRange,
    flatten_messages,
    multi_turn_requests,
    random_requests,
    sharegpt_requests,
)


class WordTokenizer:
    """One token per whitespace-separated word; ids are a fixed 8-word vocabulary."""

    words = ("<s>", "a", "b", "c", "d", "e", "f", "g")
    vocab_size = len(words)
    special_token_ids = frozenset({0})

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.words.index(w) if w in self.words else 1 for w in text.split()]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return " ".join(self.words[i] for i in ids)


def test_length_range() -> None:
    assert LengthRange.parse("256") == LengthRange(256, 256)
    assert LengthRange.parse("128:512") == LengthRange(128, 512)
    assert LengthRange(7, 7).sample(random.Random(0)) == 7
    samples = {LengthRange(2, 4).sample(random.Random(s)) for s in range(50)}
    assert samples == {2, 3, 4}
    for bad in ("x", "1:2:3", "0", "5:4", ""):
        with pytest.raises(ValueError):
            LengthRange.parse(bad)


def test_random_requests_with_a_tokenizer() -> None:
    tok = WordTokenizer()
    requests = random_requests(5, LengthRange(6, 6), LengthRange(2, 9), seed=3, tokenizer=tok)
    assert requests == random_requests(5, LengthRange(6, 6), LengthRange(2, 9), seed=3, tokenizer=tok)
    assert requests != random_requests(5, LengthRange(6, 6), LengthRange(2, 9), seed=4, tokenizer=tok)
    for r in requests:
        assert isinstance(r.prompt, list) and len(r.prompt) == 6 == r.prompt_len
        assert set(r.prompt) <= set(range(1, 8))  # the special id 0 is never drawn
        assert r.messages == [{"role": "user", "content": tok.decode(r.prompt)}]
        assert 2 <= r.output_len <= 9
    assert len({r.output_len for r in requests}) > 1


def test_random_requests_without_a_tokenizer_are_ids_only() -> None:
    (request,) = random_requests(1, LengthRange(50, 50), LengthRange(4, 4), seed=0)
    assert isinstance(request.prompt, list)
    assert all(DEFAULT_ID_RANGE[0] <= i < DEFAULT_ID_RANGE[1] for i in request.prompt)
    assert request.completion_prompt() == request.prompt
    with pytest.raises(ValueError, match="chat endpoint needs text"):
        request.chat_messages()


def write_sharegpt(path: Path) -> Path:
    def conv(prompt: str, reply: str) -> dict:
        return {"conversations": [{"from": "human", "value": prompt}, {"from": "gpt", "value": reply}]}

    data = [
        conv("a b c d", "e f g a b"),  # 4 / 5 tokens: kept
        conv("a b", "c d e f"),  # prompt too short
        conv("a b c d e", "f g"),  # reply too short
        conv("b " * 1025, "a b c d"),  # prompt too long
        conv("c " * 1000, "d " * 1049),  # 2049 in all: too long
        conv("d e f g", "a a a a a a"),  # kept
        {"conversations": [{"from": "gpt", "value": "x"}, {"from": "human", "value": "y"}]},  # wrong order
        {"id": "no conversations"},
    ]
    path.write_text(json.dumps(data))
    return path


def test_sharegpt_filters_and_lengths(tmp_path: Path) -> None:
    path = write_sharegpt(tmp_path / "sg.json")
    requests = sharegpt_requests(path, 2, seed=0, tokenizer=WordTokenizer())
    by_prompt = {r.prompt: r for r in requests}
    assert set(by_prompt) == {"a b c d", "d e f g"}
    assert by_prompt["a b c d"].output_len == 5 and by_prompt["a b c d"].prompt_len == 4
    assert by_prompt["d e f g"].output_len == 6
    assert by_prompt["d e f g"].messages == [{"role": "user", "content": "d e f g"}]
    fixed = sharegpt_requests(path, 2, seed=0, tokenizer=WordTokenizer(), output_len=32)
    assert {r.output_len for r in fixed} == {32}
    with pytest.raises(ValueError, match="2 usable conversations, 3 were asked for"):
        sharegpt_requests(path, 3, seed=0, tokenizer=WordTokenizer())


def test_sharegpt_without_tokenizer_needs_output_len(tmp_path: Path) -> None:
    path = write_sharegpt(tmp_path / "sg.json")
    with pytest.raises(ValueError, match="needs a tokenizer or a fixed output length"):
        sharegpt_requests(path, 1, seed=0)
    # unfiltered without a tokenizer: 6 human->gpt pairs
    assert len(sharegpt_requests(path, 6, seed=0, output_len=8)) == 6
    with pytest.raises(ValueError, match="not found"):
        sharegpt_requests(tmp_path / "missing.json", 1, seed=0, output_len=8)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        sharegpt_requests(tmp_path / "bad.json", 1, seed=0, output_len=8)


def test_multi_turn_shares_system_prompts_and_history() -> None:
    requests = multi_turn_requests(
        5, output_len=16, seed=1, num_system_prompts=2, system_prompt_len=20, num_turns=2, turn_len=3
    )
    # ceil(5 / 2) = 3 conversations; all first turns, then second turns (5 requests in all)
    assert [len(r.messages or []) for r in requests] == [2, 2, 2, 4, 4]
    first, second = requests[:3], requests[3:]
    systems = [r.messages[0]["content"] for r in first]  # type: ignore[index]
    assert systems[0] == systems[2] != systems[1]  # conversation c uses system prompt c % 2
    assert len(systems[0].split()) == 20
    for r in requests:
        assert r.prompt is None and r.output_len == 16 and r.prompt_len is None
        assert r.messages is not None and r.messages[0]["role"] == "system"
    # turn 2 of conversation 0 repeats its turn-1 question, then a synthetic reply
    c0 = second[0].messages
    assert c0 is not None and first[0].messages is not None
    assert c0[:2] == first[0].messages
    assert [m["role"] for m in c0] == ["system", "user", "assistant", "user"]
    assert len(c0[2]["content"].split()) == 3
    assert requests == multi_turn_requests(
        5, output_len=16, seed=1, num_system_prompts=2, system_prompt_len=20, num_turns=2, turn_len=3
    )
    with pytest.raises(ValueError, match="num_turns"):
        multi_turn_requests(1, 4, 0, num_turns=0)


def test_multi_turn_counts_prompt_tokens_with_a_tokenizer() -> None:
    (request,) = multi_turn_requests(1, 4, 0, system_prompt_len=10, num_turns=1, turn_len=2, tokenizer=WordTokenizer())
    assert request.prompt_len == len(flatten_messages(request.messages or []).split())


def test_flatten_messages_and_request_validation() -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert flatten_messages(messages) == "system: s\n\nuser: u\n\nassistant:"
    with pytest.raises(ValueError):
        BenchRequest(None, None, 4, None)
    with pytest.raises(ValueError):
        BenchRequest("p", None, 0, None)
