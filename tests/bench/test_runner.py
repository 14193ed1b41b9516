"""The load loop: arrival times, the in-flight bound of each mode, warm-ups and the report."""

from __future__ import annotations

import asyncio
import itertools
import math
import statistics
from typing import Any

import httpx
import pytest
from scripted_server import Script, ScriptedTransport, completion_chunk, usage_chunk

from tokenmill.bench.client import SamplingOptions, StreamingClient
from tokenmill.bench.metrics import SLO
from tokenmill.bench.progress import NoProgress
from tokenmill.bench.runner import LoadConfig, Target, arrival_offsets, run_benchmark, run_load
from tokenmill.bench.workloads import BenchRequest


def script(body: dict[str, Any]) -> Script:
    """max_tokens chunks of one token each, 1 s apart after a 2 s first token."""
    n = body["max_tokens"]
    events: Script = [(2.0 if i == 0 else 1.0, completion_chunk("x")) for i in range(n)]
    return [*events, (0.0, usage_chunk(len(body["prompt"]), n)), (0.0, "[DONE]")]


def requests(num: int, output_len: int = 3) -> list[BenchRequest]:
    return [BenchRequest([1] * (i + 1), None, output_len, i + 1) for i in range(num)]


def test_arrival_offsets() -> None:
    assert arrival_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]
    offsets = arrival_offsets(20001, 4.0, 1.0, seed=7)
    assert offsets[0] == 0.0
    assert offsets == sorted(offsets) and offsets == arrival_offsets(20001, 4.0, 1.0, seed=7)
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.02)
    # gamma(shape k): squared coefficient of variation 1/k (Poisson: 1)
    for k in (0.5, 1.0, 4.0):
        g = [b - a for a, b in itertools.pairwise(arrival_offsets(20001, 4.0, k, 1))]
        assert statistics.pvariance(g) / statistics.fmean(g) ** 2 == pytest.approx(1 / k, rel=0.06)


def test_load_config_validation() -> None:
    for bad in (
        {"concurrency": 0},
        {"concurrency": None},
        {"request_rate": 0.0},
        {"request_rate": 1.0, "burstiness": 0.0},
        {"num_warmups": -1},
    ):
        with pytest.raises(ValueError):
            LoadConfig(**bad)  # type: ignore[arg-type]
    assert LoadConfig(concurrency=None, request_rate=2.0).is_open_loop


def run(load: LoadConfig, num: int) -> tuple[ScriptedTransport, list[Any], float]:
    transport = ScriptedTransport(script)

    async def go() -> tuple[list[Any], float]:
        async with httpx.AsyncClient(transport=transport) as http:
            client = StreamingClient(http, "http://s", "m", clock=transport.clock)
            return await run_load(client, requests(num), load, NoProgress())

    results, duration = asyncio.run(go())
    return transport, results, duration


@pytest.mark.parametrize(
    ("load", "expected_in_flight"),
    [
        (LoadConfig(concurrency=3), 3),  # closed loop
        (LoadConfig(concurrency=1), 1),
        (LoadConfig(concurrency=2, request_rate=math.inf), 2),  # open loop, capped
        (LoadConfig(concurrency=None, request_rate=math.inf), 10),  # open loop, uncapped
    ],
)
def test_in_flight_bound(load: LoadConfig, expected_in_flight: int) -> None:
    transport, results, _ = run(load, 10)
    assert transport.max_in_flight == expected_in_flight
    assert len(results) == 10 and all(r.ok for r in results)
    # results come back in request order, each request sent once
    assert [r.prompt_tokens for r in results] == list(range(1, 11))
    assert sorted(len(b["prompt"]) for b in transport.bodies) == list(range(1, 11))


def test_closed_loop_one_at_a_time_is_exact() -> None:
    # each request: 2 s to the first token, then 2 x 1 s: e2e 4 s; run back to back
    _, results, duration = run(LoadConfig(concurrency=1), 3)
    assert [r.start_s for r in results] == [0.0, 4.0, 8.0]
    assert all(r.ttft_s == 2.0 and r.e2e_s == 4.0 and r.tpot_s == 1.0 for r in results)
    assert duration == 12.0


def test_open_loop_releases_on_schedule() -> None:
    loop_times: list[float] = []

    class Recording(ScriptedTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            loop_times.append(asyncio.get_running_loop().time())
            return await super().handle_async_request(request)

    transport = Recording(script)
    load = LoadConfig(concurrency=None, request_rate=20.0, seed=5)

    async def go() -> None:
        async with httpx.AsyncClient(transport=transport) as http:
            client = StreamingClient(http, "http://s", "m", clock=transport.clock)
            await run_load(client, requests(6), load, NoProgress())

    asyncio.run(go())
    expected = arrival_offsets(6, 20.0, 1.0, 5)
    got = [t - loop_times[0] for t in loop_times]
    assert got == pytest.approx(expected, abs=0.03)


def test_run_benchmark_report() -> None:
    transport = ScriptedTransport(script)
    target = Target("http://s", "m", options=SamplingOptions(ignore_eos=True))
    report = asyncio.run(
        run_benchmark(
            target, requests(6), LoadConfig(concurrency=1, num_warmups=2), SLO(ttft_ms=2000),
            show_progress=False, transport=transport,
        )
    )
    assert len(transport.bodies) == 6  # 2 warm-ups + 4 measured
    assert report["config"]["num_prompts"] == 4 and report["config"]["num_warmups"] == 2
    assert report["config"]["ignore_eos"] is True and report["config"]["request_rate"] is None
    assert report["completed"] == 4 and report["failed"] == 0 and report["warmup_failed"] == 0
    assert report["total_output_tokens"] == 12
    assert report["total_input_tokens"] == 3 + 4 + 5 + 6  # the measured prompts, from usage
    assert set(report) >= {
        "completed", "failed", "output_throughput", "request_throughput", "goodput",
        "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "errors", "requests", "duration_s",
    }
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(report[key]) >= {"mean", "median", "p90", "p99"}
    assert [r["num_chunks"] for r in report["requests"]] == [3, 3, 3, 3]
    assert [r["max_tokens"] for r in report["requests"]] == [3, 3, 3, 3]


def test_run_benchmark_needs_measured_requests() -> None:
    with pytest.raises(ValueError, match="none to measure"):
        asyncio.run(run_benchmark(Target("http://s", "m"), requests(2), LoadConfig(num_warmups=2)))


def test_failures_are_counted_with_their_errors() -> None:
    transport = ScriptedTransport(script, status_code=500)
    report = asyncio.run(
        run_benchmark(Target("http://s", "m"), requests(3), LoadConfig(concurrency=2), show_progress=False,
                      transport=transport)
    )
    assert report["completed"] == 0 and report["failed"] == 3
    (error,) = report["errors"]
    assert error.startswith("HTTP 500") and report["errors"][error] == 3
    assert report["ttft_ms"]["mean"] is None
