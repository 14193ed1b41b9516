"""/v1/embeddings over the FakeEngine."""

from __future__ import annotations

import base64
import struct

from fake_engine import FakeEngine
from fastapi.testclient import TestClient


def test_embeddings_float_and_base64(client: TestClient, engine: FakeEngine) -> None:
    response = client.post("/v1/embeddings", json={"model": "fake-model", "input": ["ab", "c"]})
    assert response.status_code == 200
    body = response.json()
    expected = [engine_vector(engine, [97, 98]), engine_vector(engine, [99])]
    assert body == {
        "object": "list",
        "data": [
            {"object": "embedding", "index": 0, "embedding": expected[0]},
            {"object": "embedding", "index": 1, "embedding": expected[1]},
        ],
        "model": "fake-model",
        "usage": {"prompt_tokens": 3, "total_tokens": 3},
    }
    response = client.post("/v1/embeddings", json={"input": [[97, 98]], "encoding_format": "base64"})
    raw = base64.b64decode(response.json()["data"][0]["embedding"])
    decoded = struct.unpack("<3f", raw)
    assert decoded == struct.unpack("<3f", struct.pack("<3f", *expected[0]))


def engine_vector(engine: FakeEngine, ids: list[int]) -> list[float]:
    import asyncio

    return asyncio.run(engine.embed([ids]))[0]


def test_embedding_errors(client: TestClient, engine: FakeEngine) -> None:
    cases = [
        ({"input": []}, "input"),
        ({"input": "a", "dimensions": 8}, "dimensions"),
        ({"input": "a" * 300}, "input"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "model": "nope"}, "model"),
    ]
    for body, param in cases:
        response = client.post("/v1/embeddings", json=body)
        assert response.status_code in (400, 404), body
        assert response.json()["error"]["param"] == param
