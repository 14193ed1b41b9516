"""A client that goes away aborts its engine request (real sockets, FakeEngine)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import httpx
import pytest
from fake_engine import FakeEngine
from server_harness import ThreadedServer

from tokenmill.server.state import get_state


def wait_for(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_streaming_disconnect_aborts(live_server: ThreadedServer, engine: FakeEngine) -> None:
    engine.step_delay_s = 0.02
    body = {"prompt": "a", "max_tokens": 200, "stream": True}
    with httpx.Client(base_url=live_server.base_url) as client, client.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    (call,) = engine.calls
    # Within a couple of steps the request is aborted and nothing runs.
    wait_for(lambda: call.request_id in engine.aborted)
    wait_for(lambda: engine.stats().num_running_reqs == 0)
    assert engine.finished == []
    assert engine.num_generation_tokens < 50
    state = get_state(live_server.server.config.app)
    assert state.admission.num_queued == 0
    metrics = httpx.get(f"{live_server.base_url}/metrics").text
    assert 'tokenmill:request_success_total{finished_reason="abort",model_name="fake-model"} 1.0' in metrics


def test_non_streaming_disconnect_aborts(
    live_server: ThreadedServer, engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    engine.step_delay_s = 0.02
    caplog.set_level(logging.INFO, logger="tokenmill.server.access")
    with pytest.raises(httpx.ReadTimeout):
        body = {"prompt": "a", "max_tokens": 200}
        httpx.post(f"{live_server.base_url}/v1/completions", json=body, timeout=0.3, headers={"x-request-id": "gone-1"})
    (call,) = engine.calls
    wait_for(lambda: call.request_id in engine.aborted)
    wait_for(lambda: engine.stats().num_running_reqs == 0)
    assert engine.finished == []
    assert engine.num_generation_tokens < 100
    # Logged as 499 (client closed request), with its request id.
    wait_for(lambda: any('"request_id": "gone-1"' in r.getMessage() for r in caplog.records))
    (line,) = [json.loads(r.getMessage()) for r in caplog.records if '"gone-1"' in r.getMessage()]
    assert line["status"] == 499


def test_disconnect_while_queued_releases_the_slot(live_server: ThreadedServer, engine: FakeEngine) -> None:
    engine.paused = True
    state = get_state(live_server.server.config.app)
    with pytest.raises(httpx.ReadTimeout):
        body = {"messages": [{"role": "user", "content": "x"}], "stream": True}
        with httpx.stream("POST", f"{live_server.base_url}/v1/chat/completions", json=body, timeout=0.3) as r:
            for _ in r.iter_lines():
                pass
    wait_for(lambda: engine.calls != [] and engine.calls[0].request_id in engine.aborted)
    wait_for(lambda: state.admission.num_queued == 0)
    assert engine.stats().num_waiting_reqs == 0
