"""Percentiles, SLOs, goodput and the summary, on hand-made results with exact values."""

from __future__ import annotations

import pytest

from tokenmill.bench.client import RequestResult
from tokenmill.bench.metrics import SLO, distribution_ms, measured_duration, percentile, summarize


def ok(start: float, ttft: float, e2e: float, tokens: int, itl: list[float], prompt: int = 10) -> RequestResult:
    return RequestResult(
        ok=True, start_s=start, ttft_s=ttft, e2e_s=e2e, itl_s=itl, output_tokens=tokens, prompt_tokens=prompt
    )


def test_percentile_interpolates_linearly() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 90) == pytest.approx(3.7)  # position 2.7: 3 + 0.7 * (4 - 3)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_distribution_in_milliseconds() -> None:
    assert distribution_ms([0.001, 0.003]) == {
        "mean": 2.0, "median": 2.0, "p90": pytest.approx(2.8), "p99": pytest.approx(2.98), "min": 1.0, "max": 3.0,
    }
    assert distribution_ms([]) == dict.fromkeys(("mean", "median", "p90", "p99", "min", "max"))


def test_slo_parse_and_errors() -> None:
    assert SLO.parse("ttft=500,tpot=50") == SLO(ttft_ms=500.0, tpot_ms=50.0, e2e_ms=None)
    assert SLO.parse("e2e=1000") == SLO(e2e_ms=1000.0)
    for bad in ("ttft", "latency=5", "ttft=fast", "tpot=-1", ""):
        with pytest.raises(ValueError):
            SLO.parse(bad)


def test_slo_is_met_per_request() -> None:
    slo = SLO(ttft_ms=100, tpot_ms=20)
    # ttft 0.1 s, tpot (0.5 - 0.1) / 20 = 0.02 s: both exactly at the limit
    assert slo.is_met(ok(0, 0.1, 0.5, 21, []))
    assert not slo.is_met(ok(0, 0.101, 0.5, 21, []))
    assert not slo.is_met(ok(0, 0.1, 0.6, 21, []))  # tpot 0.025
    assert slo.is_met(ok(0, 0.1, 9.0, 1, []))  # one token: no tpot
    assert not slo.is_met(RequestResult(ok=False, error="x"))


def test_summarize_exact() -> None:
    results = [
        # start, ttft, e2e, output tokens, ITL gaps
        ok(0.0, 0.5, 2.5, 5, [0.5, 0.5, 0.5, 0.5]),  # tpot 0.5
        ok(1.0, 1.0, 2.0, 3, [0.25, 0.75], prompt=20),  # tpot 0.5, ends at 3.0
        ok(2.0, 0.25, 0.25, 1, []),  # no tpot
        RequestResult(ok=False, error="HTTP 500: boom", start_s=2.5, e2e_s=0.1),
        RequestResult(ok=False, error="HTTP 500: boom", start_s=2.6, e2e_s=0.1),
        RequestResult(ok=False, error="timeout", start_s=2.7, e2e_s=0.3),
    ]
    assert measured_duration(results) == 3.0
    report = summarize(results, 4.0, SLO(ttft_ms=600))
    assert report["completed"] == 3
    assert report["failed"] == 3
    assert report["errors"] == {"HTTP 500: boom": 2, "timeout": 1}
    assert report["total_input_tokens"] == 40
    assert report["total_output_tokens"] == 9
    assert report["request_throughput"] == 0.75
    assert report["output_throughput"] == 2.25
    assert report["total_token_throughput"] == 12.25
    assert report["goodput"] == 0.5  # two of three meet ttft <= 600 ms
    assert report["slo"] == {"ttft_ms": 600, "tpot_ms": None, "e2e_ms": None}
    assert report["ttft_ms"]["mean"] == pytest.approx(1750 / 3)
    assert report["ttft_ms"]["median"] == 500.0
    assert report["tpot_ms"] == {"mean": 500.0, "median": 500.0, "p90": 500.0, "p99": 500.0, "min": 500.0, "max": 500.0}
    assert report["itl_ms"]["median"] == 500.0
    assert report["itl_ms"]["min"] == 250.0 and report["itl_ms"]["max"] == 750.0
    assert report["e2e_ms"]["max"] == 2500.0


def test_summarize_without_slo_has_no_goodput() -> None:
    report = summarize([ok(0, 0.1, 0.2, 2, [0.1])], 1.0)
    assert report["goodput"] is None and report["slo"] is None
    with pytest.raises(ValueError):
        summarize([], 0.0)
