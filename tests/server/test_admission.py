"""A full waiting queue answers 429 with Retry-After at once."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from fake_engine import FakeEngine

from tokenmill.server.admission import AdmissionController
from tokenmill.server.errors import APIError


def test_controller_counts_until_first_output() -> None:
    controller = AdmissionController(max_queue_len=2, retry_after_s=3)
    a = controller.admit(num_engine_waiting=0)
    b = controller.admit(num_engine_waiting=0)
    with pytest.raises(APIError) as info:
        controller.admit(num_engine_waiting=0)
    assert (info.value.status_code, info.value.headers) == (429, {"Retry-After": "3"})
    a.started()
    a.release()
    assert controller.num_queued == 1
    # The engine's own waiting count also fills the queue.
    with pytest.raises(APIError):
        controller.admit(num_engine_waiting=2)
    c = controller.admit(num_engine_waiting=1)
    b.release()
    b.release()
    c.release()
    assert controller.num_queued == 0


def test_full_queue_is_429_and_frees_up(make_client: Any, engine: FakeEngine) -> None:
    client = make_client(engine, max_queue_len=1, retry_after_s=2)
    engine.paused = True
    results: list[int] = []
    worker = threading.Thread(
        target=lambda: results.append(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code)
    )
    worker.start()
    deadline = time.monotonic() + 5
    while not engine.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 429
    assert response.headers["retry-after"] == "2"
    assert response.json()["error"] == {
        "message": "The server's request queue is full (1 waiting); retry later",
        "type": "rate_limit_error",
        "param": None,
        "code": "queue_full",
    }
    engine.paused = False
    worker.join(5)
    assert results == [200]
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 200
    # Others queued in the engine count too.
    engine.extra_waiting = 1
    assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).status_code == 429
