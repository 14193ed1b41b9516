"""Strict validation: every bad body is a 400 in OpenAI's shape naming the field."""

from __future__ import annotations

from typing import Any

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": USER, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": "hi", **fields}


def assert_error(response: Any, status: int, param: str | None, code: str | None) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param
    assert body["error"]["code"] == code
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (chat(temperature=-0.1), "temperature", "invalid_value"),
        (chat(temperature=2.01), "temperature", "invalid_value"),
        (chat(top_p=0), "top_p", "invalid_value"),
        (chat(top_p=1.5), "top_p", "invalid_value"),
        (chat(n=0), "n", "invalid_value"),
        (chat(n=129), "n", "invalid_value"),
        (chat(max_tokens=0), "max_tokens", "invalid_value"),
        (chat(max_completion_tokens=0), "max_completion_tokens", "invalid_value"),
        (chat(presence_penalty=2.5), "presence_penalty", "invalid_value"),
        (chat(frequency_penalty=-3), "frequency_penalty", "invalid_value"),
        (chat(top_logprobs=21, logprobs=True), "top_logprobs", "invalid_value"),
        (chat(min_p=1.5), "min_p", "invalid_value"),
        (chat(repetition_penalty=0), "repetition_penalty", "invalid_value"),
        (chat(top_k=-5), "top_k", "invalid_value"),
        (chat(logit_bias={"12": 101}), "logit_bias", "invalid_value"),
        (chat(logit_bias={"abc": 1}), "logit_bias", "invalid_value"),
        (chat(logit_bias={"999": 1}), "logit_bias", "invalid_value"),
        (chat(stop_token_ids=[999]), "stop_token_ids", "invalid_value"),
        (chat(stop=[""]), "stop", "invalid_value"),
        # wrong types: strict, no coercion
        (chat(temperature="0.5"), "temperature", "invalid_value"),
        (chat(n=1.0), "n", "invalid_value"),
        (chat(stream="yes"), "stream", "invalid_value"),
        (chat(stop=5), "stop", "invalid_value"),
        (chat(messages="hi"), "messages", "invalid_value"),
        (chat(messages=[]), "messages", "invalid_value"),
        (chat(messages=[{"role": "robot", "content": "x"}]), "messages[0].role", "invalid_value"),
        (chat(messages=[{"role": "tool", "content": "x"}]), "messages[0].tool_call_id", "invalid_value"),
        (chat(messages=[{"role": "tool", "tool_call_id": "c"}]), "messages[0].content", "invalid_value"),
        (chat(messages=[{"role": "user"}]), "messages[0].content", "invalid_value"),
        (chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages[0].content[0].type", "invalid_value"),
        (chat(messages=[{"role": "user", "content": "x", "tool_call_id": "a"}]), "messages[0].tool_call_id", "invalid_value"),
        (chat(messages=[{"role": "user", "content": "x", "tool_calls": []}]), "messages[0].tool_calls", "invalid_value"),
        (chat(messages=[{"role": "user", "content": "x", "refusal": "a"}]), "messages[0].refusal", "unknown_parameter"),
        ({"model": "fake-model"}, "messages", "missing_required_parameter"),
        # unknown fields
        (chat(foo=1), "foo", "unknown_parameter"),
        (chat(stream=True, stream_options={"include_usage": True, "x": 1}), "stream_options.x", "unknown_parameter"),
        (chat(echo=True), "echo", "unknown_parameter"),
        # known but not honored
        (chat(functions=[{"name": "f"}]), "functions", "unsupported_parameter"),
        (chat(function_call="auto"), "function_call", "unsupported_parameter"),
        (chat(audio={"voice": "x"}), "audio", "unsupported_parameter"),
        (chat(modalities=["text", "audio"]), "modalities", "unsupported_parameter"),
        (chat(prediction={"type": "content", "content": "x"}), "prediction", "unsupported_parameter"),
        (chat(reasoning_effort="high"), "reasoning_effort", "unsupported_parameter"),
        (chat(top_logprobs=2), "top_logprobs", "unsupported_parameter"),
        (chat(stream_options={"include_usage": True}), "stream_options", "unsupported_parameter"),
        (completion(suffix="x"), "suffix", "unsupported_parameter"),
        (completion(best_of=2), "best_of", "unsupported_parameter"),
        (completion(logprobs=21), "logprobs", "invalid_value"),
        (completion(logprobs=True), "logprobs", "invalid_value"),
        (completion(prompt=[]), "prompt", "invalid_value"),
        (completion(prompt=""), "prompt", "invalid_value"),
        (completion(prompt=[1, "a"]), "prompt[0]", "invalid_value"),
        (completion(prompt=[[1, 2], [300]]), "prompt[1]", "invalid_value"),
        (completion(prompt=[[1], [-1]]), "prompt[1]", "invalid_value"),
        (completion(prompt=[True]), "prompt", "invalid_value"),
        (completion(prompt={"a": 1}), "prompt", "invalid_value"),
        (completion(min_tokens=20), "min_tokens", "invalid_value"),
    ],
)
def test_invalid_bodies_are_400_naming_the_field(
    client: TestClient, engine: FakeEngine, body: dict[str, Any], param: str, code: str
) -> None:
    path = COMPLETIONS if "prompt" in body else CHAT
    assert_error(client.post(path, json=body), 400, param, code)
    assert engine.calls == []


def test_harmless_and_noop_fields_are_accepted(client: TestClient, engine: FakeEngine) -> None:
    body = chat(
        max_tokens=2,
        metadata={"k": "v"},
        store=False,
        service_tier="auto",
        user="u1",
        safety_identifier="s",
        prompt_cache_key="p",
        response_format={"type": "text"},
        tools=[],
        tool_choice="none",
        modalities=["text"],
    )
    response = client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert len(engine.calls) == 1


@pytest.mark.parametrize("raw", [b"{bad", b"", b"[1, 2]", b"null", b'{"messages": [}'])
def test_malformed_json_is_400(client: TestClient, raw: bytes) -> None:
    response = client.post(CHAT, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_unknown_model_is_404(client: TestClient, engine: FakeEngine) -> None:
    response = client.post(CHAT, json={**chat(), "model": "gpt-4o"})
    assert_error(response, 404, "model", "model_not_found")
    response = client.post(COMPLETIONS, json={**completion(), "model": "other"})
    assert_error(response, 404, "model", "model_not_found")
    assert engine.calls == []


def test_missing_model_means_the_served_one(client: TestClient, engine: FakeEngine) -> None:
    response = client.post(CHAT, json={"messages": USER, "max_tokens": 1})
    assert response.status_code == 200
    assert response.json()["model"] == "fake-model"
