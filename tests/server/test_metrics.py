"""/metrics: vLLM's names under `tokenmill:`, labelled model_name, moving with requests."""

from __future__ import annotations

import threading
import time
from typing import Any

from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"]
COUNTERS = ["prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens"]
HISTOGRAMS = [
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
]


def scrape(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict[Any, float], name: str, **labels: str) -> float:
    key = (f"tokenmill:{name}", tuple(sorted({"model_name": "fake-model", **labels}.items())))
    return samples[key]


def test_names_and_labels_exist_before_any_request(client: TestClient) -> None:
    samples = scrape(client)
    for name in GAUGES:
        assert value(samples, name) == 0.0
    for name in COUNTERS:
        assert value(samples, f"{name}_total") == 0.0
    for name in HISTOGRAMS:
        assert value(samples, f"{name}_count") == 0.0
    for reason in ("stop", "length", "abort"):
        assert value(samples, "request_success_total", finished_reason=reason) == 0.0


def test_metrics_move_with_requests(client: TestClient, engine: FakeEngine) -> None:
    engine.paused = True
    worker = threading.Thread(
        target=lambda: client.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 3, "n": 2})
    )
    worker.start()
    deadline = time.monotonic() + 5
    while not engine.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    samples = scrape(client)
    assert value(samples, "num_requests_waiting") == 1.0
    assert value(samples, "num_requests_running") == 0.0
    engine.paused = False
    worker.join(5)
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "stop": ">", "max_tokens": 50})
    samples = scrape(client)
    assert value(samples, "num_requests_running") == 0.0
    assert value(samples, "num_requests_waiting") == 0.0
    assert value(samples, "prompt_tokens_total") == engine.num_prompt_tokens == 4 + len("<user>x\n<assistant>")
    assert value(samples, "generation_tokens_total") == engine.num_generation_tokens
    # Per sample: two "length" (n=2), one "stop".
    assert value(samples, "request_success_total", finished_reason="length") == 2.0
    assert value(samples, "request_success_total", finished_reason="stop") == 1.0
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert value(samples, f"{name}_count") == 2.0, name
    # Gaps between outputs: 3 steps (2 gaps), then "<user>" ending at the stop ">" (6 steps, 5 gaps).
    assert engine.num_steps == 3 + 6
    assert value(samples, "inter_token_latency_seconds_count") == 2.0 + 5.0
    assert value(samples, "request_queue_time_seconds_sum") > 0.0


def test_running_gauge_while_generating(client: TestClient, engine: FakeEngine) -> None:
    engine.step_delay_s = 0.05
    worker = threading.Thread(target=lambda: client.post("/v1/completions", json={"prompt": "a", "max_tokens": 20}))
    worker.start()
    deadline = time.monotonic() + 5
    while not engine.stats().num_running_reqs and time.monotonic() < deadline:
        time.sleep(0.01)
    samples = scrape(client)
    assert value(samples, "num_requests_running") == 1.0
    assert value(samples, "kv_cache_usage_perc") == 0.1
    worker.join(5)
    assert value(scrape(client), "num_requests_running") == 0.0


def test_success_counts_every_sample_of_n(client: TestClient, engine: FakeEngine) -> None:
    # Sample 0 of "xy>" stops at ">" on step 3, sample 1 ("y>x...") on step 2: they end
    # in different deltas.
    client.post("/v1/completions", json={"prompt": "xy>", "max_tokens": 10, "n": 2, "stop": ">"})
    samples = scrape(client)
    assert value(samples, "request_success_total", finished_reason="stop") == 2.0
    assert value(samples, "e2e_request_latency_seconds_count") == 1.0


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "tool_call")


def test_structured_output_series_exist_before_any_request(client: TestClient) -> None:
    samples = scrape(client)
    for kind in STRUCTURED_KINDS:
        assert value(samples, "structured_output_requests_total", kind=kind) == 0.0
    assert value(samples, "structured_output_invalid_total") == 0.0
    assert value(samples, "grammar_compile_seconds_count") == 0.0


def test_structured_requests_are_counted_by_kind_and_bad_stops_as_invalid(
    client: TestClient, engine: FakeEngine
) -> None:
    engine.max_model_len = 4096  # room for the tools block in byte tokens
    chat = "/v1/chat/completions"
    user = [{"role": "user", "content": "x"}]
    engine.reply = '{"a":1}'
    client.post(chat, json={"messages": user, "response_format": {"type": "json_object"}, "n": 2})
    client.post(chat, json={"messages": user, "structured_outputs": {"json": {"type": "object"}}})
    # Not an object: both samples end "stop" and fail the re-check.
    engine.reply = "[1]"
    client.post(chat, json={"messages": user, "response_format": {"type": "json_object"}, "n": 2})
    # Cut by max_tokens: "length" is never re-checked.
    client.post("/v1/completions", json={"prompt": "p", "max_tokens": 2, "structured_outputs": {"regex": "x"}})
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    client.post(chat, json={"messages": user, "tools": [tool], "tool_choice": "required"})
    client.post(chat, json={"messages": user, "tools": [tool]})
    samples = scrape(client)
    counts = {kind: value(samples, "structured_output_requests_total", kind=kind) for kind in STRUCTURED_KINDS}
    assert counts == {"json": 1.0, "json_object": 2.0, "regex": 1.0, "choice": 0.0, "grammar": 0.0, "tool_call": 1.0}
    # Invalid: the two json_object samples, and "[1]" as "required" calls (not call objects).
    assert value(samples, "structured_output_invalid_total") == 3.0


def test_grammar_compile_times_are_drained_at_scrape(client: TestClient, engine: FakeEngine) -> None:
    engine.grammar_compile_times = [0.002, 0.3]
    samples = scrape(client)
    assert value(samples, "grammar_compile_seconds_count") == 2.0
    assert value(samples, "grammar_compile_seconds_bucket", le="0.0025") == 1.0
    assert value(samples, "grammar_compile_seconds_sum") == 0.302
    assert engine.grammar_compile_times == []
    assert value(scrape(client), "grammar_compile_seconds_count") == 2.0
