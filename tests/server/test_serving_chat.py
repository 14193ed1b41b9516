"""/v1/chat/completions over the FakeEngine: shapes, streaming, parameter mapping."""

from __future__ import annotations

from typing import Any

from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_harness import parse_sse

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
# The fake template renders "<user>hi\n<assistant>": 20 byte tokens.
PROMPT = "<user>hi\n<assistant>"


def post(client: TestClient, **fields: Any) -> Any:
    response = client.post(CHAT, json={"model": "fake-model", "messages": USER, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def stream(client: TestClient, **fields: Any) -> list[Any]:
    body = {"model": "fake-model", "messages": USER, "stream": True, **fields}
    with client.stream("POST", CHAT, json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        return parse_sse(response.read().decode())


def test_non_streaming_shape(client: TestClient, engine: FakeEngine) -> None:
    body = post(client, max_tokens=5, temperature=0)
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == "fake-model"
    assert isinstance(body["created"], int)
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": PROMPT[:5], "refusal": None},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": 5,
        "total_tokens": len(PROMPT) + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert engine.calls[0].prompt == list(PROMPT.encode())


def test_streaming_chunk_sequence(client: TestClient) -> None:
    events = stream(client, max_tokens=3)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert [c["choices"] for c in chunks] == [
        [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {"content": "<"}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {"content": "u"}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {"content": "s"}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}],
    ]


def test_streaming_include_usage(client: TestClient) -> None:
    events = stream(client, max_tokens=2, stream_options={"include_usage": True})
    chunks = events[:-1]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": len(PROMPT),
        "completion_tokens": 2,
        "total_tokens": len(PROMPT) + 2,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_streaming_with_n_numbers_each_choice(client: TestClient) -> None:
    events = stream(client, max_tokens=3, n=2)
    texts = {0: "", 1: ""}
    roles, finishes = [], []
    for chunk in events[:-1]:
        (choice,) = chunk["choices"]
        if "role" in choice["delta"]:
            roles.append(choice["index"])
        texts[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            finishes.append(choice["index"])
    assert roles == [0, 1]
    assert sorted(finishes) == [0, 1]
    # Sample j of the fake starts j tokens into the prompt.
    assert texts == {0: PROMPT[0:3], 1: PROMPT[1:4]}
    body = post(client, max_tokens=3, n=2)
    assert [c["message"]["content"] for c in body["choices"]] == [texts[0], texts[1]]


def test_max_tokens_rules(client: TestClient, engine: FakeEngine) -> None:
    post(client, max_tokens=7, max_completion_tokens=3)
    assert engine.calls[-1].params.max_tokens == 3
    post(client, max_tokens=4)
    assert engine.calls[-1].params.max_tokens == 4
    # Default: the room the context leaves.
    post(client)
    assert engine.calls[-1].params.max_tokens == engine.max_model_len - len(PROMPT)
    over = client.post(CHAT, json={"messages": USER, "max_completion_tokens": engine.max_model_len})
    assert over.status_code == 400
    assert over.json()["error"]["param"] == "max_completion_tokens"
    long_prompt = [{"role": "user", "content": "x" * engine.max_model_len}]
    too_long = client.post(CHAT, json={"messages": long_prompt})
    assert too_long.status_code == 400
    assert too_long.json()["error"]["param"] == "messages"
    assert len(engine.calls) == 3


def test_sampling_fields_reach_the_engine(client: TestClient, engine: FakeEngine) -> None:
    post(
        client,
        max_tokens=4,
        temperature=0.7,
        top_p=0.9,
        seed=11,
        stop=["zz", "yy"],
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        logit_bias={"65": 5.0},
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.1,
        min_tokens=2,
        ignore_eos=True,
        priority=3,
        cache_salt="salt",
        stop_token_ids=[7],
        include_stop_str_in_output=True,
        skip_special_tokens=False,
    )
    call = engine.calls[-1]
    p = call.params
    assert (p.temperature, p.top_p, p.seed, p.stop) == (0.7, 0.9, 11, ["zz", "yy"])
    assert (p.presence_penalty, p.frequency_penalty, p.logit_bias) == (0.5, -0.5, {65: 5.0})
    assert (p.top_k, p.min_p, p.repetition_penalty, p.min_tokens) == (20, 0.05, 1.1, 2)
    assert (p.ignore_eos, p.stop_token_ids, p.include_stop_str_in_output) == (True, [7], True)
    assert (p.skip_special_tokens, p.logprobs, p.n) == (False, None, 1)
    assert (call.priority, call.cache_salt) == (3, "salt")
    # OpenAI defaults when absent.
    post(client, max_tokens=1)
    p = engine.calls[-1].params
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.stop) == (1.0, 1.0, None, None, [])


def test_stop_string_finishes_with_stop(client: TestClient) -> None:
    body = post(client, max_tokens=10, stop="h")
    assert body["choices"][0]["message"]["content"] == "<user>"
    assert body["choices"][0]["finish_reason"] == "stop"


def test_logprobs_chat_format(client: TestClient, engine: FakeEngine) -> None:
    body = post(client, max_tokens=2, logprobs=True, top_logprobs=2)
    assert engine.calls[-1].params.logprobs == 2
    assert body["choices"][0]["logprobs"] == {
        "content": [
            {
                "token": "<",
                "logprob": -0.5,
                "bytes": [60],
                "top_logprobs": [
                    {"token": "<", "logprob": -0.5, "bytes": [60]},
                    {"token": "=", "logprob": -1.5, "bytes": [61]},
                ],
            },
            {
                "token": "u",
                "logprob": -0.5,
                "bytes": [117],
                "top_logprobs": [
                    {"token": "u", "logprob": -0.5, "bytes": [117]},
                    {"token": "v", "logprob": -1.5, "bytes": [118]},
                ],
            },
        ],
        "refusal": None,
    }
    # logprobs without top_logprobs: the chosen token only.
    body = post(client, max_tokens=1, logprobs=True)
    assert engine.calls[-1].params.logprobs == 0
    assert body["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []
    # Streamed logprobs are the same entries, chunk by chunk.
    events = stream(client, max_tokens=2, logprobs=True, top_logprobs=2)
    streamed = [e for c in events[:-1] for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == ["<", "u"]
    assert streamed[1]["top_logprobs"][1] == {"token": "v", "logprob": -1.5, "bytes": [118]}


def test_cached_tokens_come_from_the_engine(client: TestClient) -> None:
    post(client, max_tokens=1)
    body = post(client, max_tokens=1)
    # The fake reports full 4-token blocks of a repeated prompt as cached.
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 20}


def test_messages_forms(client: TestClient, engine: FakeEngine) -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok", "name": "bot"},
        {"role": "user", "content": "c"},
    ]
    response = client.post(CHAT, json={"messages": messages, "max_tokens": 1})
    assert response.status_code == 200
    text = bytes(engine.calls[-1].prompt).decode()
    assert text == "<system>be brief\n<user>a\nb\n<assistant>ok\n<user>c\n<assistant>"


def test_template_error_is_400(client: TestClient, engine: FakeEngine) -> None:
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "RAISE"}]
    response = client.post(CHAT, json={"messages": messages})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages"
    assert engine.calls == []


def test_engine_refusal_is_400_or_an_error_event(client: TestClient, engine: FakeEngine) -> None:
    engine.refuse = "never fits the KV cache"
    response = client.post(CHAT, json={"messages": USER, "max_tokens": 1})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "never fits the KV cache"
    events = stream(client, max_tokens=1)
    assert events[-2] == {
        "error": {"message": "never fits the KV cache", "type": "invalid_request_error", "param": None, "code": None}
    }
    assert events[-1] == "[DONE]"


def test_engine_failure_is_500_and_the_server_lives(client: TestClient, engine: FakeEngine) -> None:
    engine.fail = "kernel exploded"
    response = client.post(CHAT, json={"messages": USER, "max_tokens": 5})
    assert response.status_code == 500
    assert response.json()["error"] == {
        "message": "Internal server error", "type": "server_error", "param": None, "code": "internal_error"
    }
    assert response.headers["x-request-id"]
    events = stream(client, max_tokens=5)
    assert events[-2]["error"]["type"] == "server_error"
    assert events[-1] == "[DONE]"
    engine.fail = None
    assert client.post(CHAT, json={"messages": USER, "max_tokens": 1}).status_code == 200


def test_engine_refusal_of_a_constraint_is_a_400_even_when_streaming(client: TestClient, engine: FakeEngine) -> None:
    engine.refuse_prepare = 'unsupported JSON schema: Unimplemented keys: ["if", "then"]'
    schema = {"type": "object", "if": {}, "then": {}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for streaming in (False, True):
        response = client.post(
            CHAT, json={"model": "fake-model", "messages": USER, "response_format": fmt, "stream": streaming}
        )
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["message"] == engine.refuse_prepare
        assert error["param"] == "response_format"
    assert engine.prepared[-1].structured_outputs is not None
