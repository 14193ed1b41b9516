"""/v1/completions over the FakeEngine: prompt forms, echo, logprobs, streaming."""

from __future__ import annotations

from typing import Any

from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_harness import parse_sse

COMPLETIONS = "/v1/completions"


def post(client: TestClient, **fields: Any) -> Any:
    response = client.post(COMPLETIONS, json={"model": "fake-model", **fields})
    assert response.status_code == 200, response.text
    return response.json()


def stream(client: TestClient, **fields: Any) -> list[Any]:
    body = {"model": "fake-model", "stream": True, **fields}
    with client.stream("POST", COMPLETIONS, json=body) as response:
        assert response.status_code == 200
        return parse_sse(response.read().decode())


def test_non_streaming_shape_and_legacy_default(client: TestClient, engine: FakeEngine) -> None:
    body = post(client, prompt="abc")
    assert engine.calls[0].params.max_tokens == 16
    assert engine.calls[0].prompt == [97, 98, 99]
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["choices"] == [
        {"index": 0, "text": "abc" * 5 + "a", "logprobs": None, "finish_reason": "length"}
    ]
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 16,
        "total_tokens": 19,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    post(client, prompt="abc", max_tokens=None)
    assert engine.calls[1].params.max_tokens == 16


def test_prompt_forms_and_choice_indexes(client: TestClient, engine: FakeEngine) -> None:
    body = post(client, prompt=["ab", "xy"], max_tokens=2, n=2)
    assert [(c["index"], c["text"]) for c in body["choices"]] == [
        (0, "ab"), (1, "ba"), (2, "xy"), (3, "yx")
    ]
    assert body["usage"]["prompt_tokens"] == 4
    assert body["usage"]["completion_tokens"] == 8
    post(client, prompt=[65, 66], max_tokens=1)
    assert engine.calls[-1].prompt == [65, 66]
    body = post(client, prompt=[[65], [66, 67]], max_tokens=1)
    assert engine.calls[-2].prompt == [65]
    assert engine.calls[-1].prompt == [66, 67]
    assert [c["text"] for c in body["choices"]] == ["A", "B"]


def test_prompt_too_long_for_max_tokens(client: TestClient, engine: FakeEngine) -> None:
    response = client.post(COMPLETIONS, json={"prompt": "a" * 250, "max_tokens": 7})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"
    assert "256" in response.json()["error"]["message"]
    assert engine.calls == []
    assert post(client, prompt="a" * 250, max_tokens=6)["usage"]["completion_tokens"] == 6


def test_echo(client: TestClient) -> None:
    body = post(client, prompt="hey", max_tokens=2, echo=True)
    assert body["choices"][0]["text"] == "hey" + "he"
    body = post(client, prompt=[104, 105], max_tokens=1, echo=True)
    assert body["choices"][0]["text"] == "hi" + "h"


def test_logprobs_completions_format(client: TestClient, engine: FakeEngine) -> None:
    body = post(client, prompt="ab", max_tokens=2, logprobs=2)
    assert engine.calls[-1].params.logprobs == 2
    assert engine.calls[-1].params.prompt_logprobs is None
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["a", "b"],
        "token_logprobs": [-0.5, -0.5],
        "top_logprobs": [{"a": -0.5, "b": -1.5}, {"b": -0.5, "c": -1.5}],
        "text_offset": [0, 1],
    }


def test_echo_with_logprobs_includes_prompt_tokens(client: TestClient, engine: FakeEngine) -> None:
    body = post(client, prompt="ab", max_tokens=1, logprobs=0, echo=True)
    assert engine.calls[-1].params.prompt_logprobs == 0
    assert body["choices"][0]["text"] == "aba"
    # logprobs=0: no alternatives, but the chosen token is always listed.
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["a", "b", "a"],
        "token_logprobs": [None, -1.0, -0.5],
        "top_logprobs": [None, {"b": -1.0}, {"a": -0.5}],
        "text_offset": [0, 1, 2],
    }


def test_streaming_chunks(client: TestClient) -> None:
    events = stream(client, prompt="ab", max_tokens=3, stream_options={"include_usage": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert [c["choices"] for c in chunks[:-1]] == [
        [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": "b", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": "a", "logprobs": None, "finish_reason": "length"}],
    ]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 3


def test_streaming_echo_and_logprob_offsets_match_non_streaming(client: TestClient) -> None:
    fields = {"prompt": ["ab", "cd"], "max_tokens": 3, "n": 2, "echo": True, "logprobs": 1}
    whole = post(client, **fields)
    events = stream(client, **fields)
    texts: dict[int, str] = {}
    offsets: dict[int, list[int]] = {}
    finishes: dict[int, str] = {}
    for chunk in events[:-1]:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            offsets.setdefault(choice["index"], []).extend(choice["logprobs"]["text_offset"])
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    for choice in whole["choices"]:
        assert texts[choice["index"]] == choice["text"]
        assert offsets[choice["index"]] == choice["logprobs"]["text_offset"]
        assert finishes[choice["index"]] == choice["finish_reason"]
    assert len(whole["choices"]) == 4
