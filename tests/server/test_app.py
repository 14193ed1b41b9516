"""Cross-cutting behaviour: auth, request ids, body limit, routes, start-up states."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from tokenmill.server.state import get_state

CHAT_BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def test_api_key_guards_v1_and_tokenize_only(make_client: Any, engine: FakeEngine) -> None:
    client = make_client(engine, api_key="s3cret")
    for method, path, body in [
        ("POST", "/v1/chat/completions", CHAT_BODY),
        ("POST", "/v1/completions", {"prompt": "a"}),
        ("POST", "/v1/embeddings", {"input": "a"}),
        ("GET", "/v1/models", None),
        ("POST", "/tokenize", {"prompt": "a"}),
        ("POST", "/detokenize", {"tokens": [1]}),
    ]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}, {"Authorization": "Basic s3cret"}):
            response = client.request(method, path, json=body, headers=headers)
            assert response.status_code == 401, (path, headers)
            assert response.json()["error"]["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"] == "Bearer"
        ok = client.request(method, path, json=body, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200, (path, ok.text)
    assert engine.calls and len(engine.calls) == 2
    for path in ("/health", "/ready", "/metrics"):
        assert client.get(path).status_code == 200


def test_request_id_is_returned_and_logged(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="tokenmill.server.access"):
        response = client.post("/v1/chat/completions", json=CHAT_BODY, headers={"x-request-id": "abc-123"})
        generated = client.get("/health").headers["x-request-id"]
    assert response.headers["x-request-id"] == "abc-123"
    assert len(generated) == 32
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "tokenmill.server.access"]
    assert [(line["request_id"], line["path"], line["status"]) for line in lines] == [
        ("abc-123", "/v1/chat/completions", 200),
        (generated, "/health", 200),
    ]
    assert all(line["event"] == "access" and line["duration_ms"] >= 0 for line in lines)
    # An insane header is replaced.
    assert client.get("/health", headers={"x-request-id": "x" * 200}).headers["x-request-id"] != "x" * 200


def test_body_over_limit_is_413(make_client: Any, engine: FakeEngine) -> None:
    client = make_client(engine, max_body_bytes=100)
    big = {"messages": [{"role": "user", "content": "x" * 200}]}
    response = client.post("/v1/chat/completions", json=big)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"

    def chunks() -> Any:
        yield b'{"messages": [{"role": "user", "content": "'
        yield b"x" * 200
        yield b'"}]}'

    chunked = client.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert chunked.status_code == 413
    assert engine.calls == []
    assert client.post("/v1/chat/completions", json=CHAT_BODY).status_code == 200


def test_unknown_route_and_method_are_openai_shaped(client: TestClient) -> None:
    response = client.get("/v1/nope")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"
    response = client.get("/v1/chat/completions")
    assert response.status_code == 405
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_models_routes(client: TestClient) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert (card["id"], card["object"], card["root"], card["max_model_len"]) == ("fake-model", "model", "fake/path", 256)
    assert client.get("/v1/models/fake-model").json() == card
    assert client.get("/v1/models/other").status_code == 404


def test_engine_not_attached_yet_is_503(make_client: Any, engine: FakeEngine) -> None:
    client = make_client(None)
    assert client.get("/health").json() == {"status": "starting", "detail": None}
    assert client.get("/health").status_code == 200
    assert client.get("/ready").status_code == 503
    response = client.post("/v1/chat/completions", json=CHAT_BODY)
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "server_error"
    assert response.headers["retry-after"] == "1"
    get_state(client.app).attach_engine(engine)
    assert client.get("/ready").status_code == 200
    assert client.post("/v1/chat/completions", json=CHAT_BODY).status_code == 200


def test_engine_warming_up_is_503(client: TestClient, engine: FakeEngine) -> None:
    engine.ready = False
    assert client.get("/ready").json()["status"] == "not_ready"
    assert client.post("/v1/completions", json={"prompt": "a"}).status_code == 503
    assert engine.calls == []


def test_draining_refuses_new_work(client: TestClient, engine: FakeEngine) -> None:
    get_state(client.app).draining = True
    assert client.get("/ready").json()["status"] == "draining"
    assert client.post("/v1/completions", json={"prompt": "a"}).json()["error"]["code"] == "draining"
