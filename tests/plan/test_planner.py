"""The planner's formulas on hand-computed cases (the arithmetic is in the comments)."""

from __future__ import annotations

import pytest

from tokenmill.plan.model import ModelShape, resolve_model
from tokenmill.plan.planner import (
    Hardware,
    Prices,
    Traffic,
    kv_bytes_per_token,
    make_plan,
    weights_bytes,
)

LLAMA_3_8B = resolve_model("llama-3-8b")
GB = 10**9


def bench_report(rps: float, ttft_p99: float, tpot_p99: float, concurrency: int) -> dict:
    return {
        "completed": 64,
        "request_throughput": rps,
        "ttft_ms": {"p99": ttft_p99},
        "tpot_ms": {"p99": tpot_p99},
        "config": {"concurrency": concurrency},
    }


def test_weights_and_kv_bytes_by_dtype() -> None:
    assert weights_bytes(LLAMA_3_8B, "bf16") == 16_060_522_496  # 8,030,261,248 x 2
    assert weights_bytes(LLAMA_3_8B, "fp8") == 8_030_261_248
    assert weights_bytes(LLAMA_3_8B, "int4") == 4_015_130_624
    # 2 (K, V) x 32 layers x 8 kv heads x 128 head dim x 2 bytes = 131,072 (128 KiB per token)
    assert kv_bytes_per_token(LLAMA_3_8B, "bf16") == 131_072
    assert kv_bytes_per_token(LLAMA_3_8B, "int8") == 65_536
    with pytest.raises(ValueError, match="weight dtype must be one of"):
        weights_bytes(LLAMA_3_8B, "fp4")


def test_llama_3_8b_bf16_on_80gb_with_a_bench_report() -> None:
    traffic = Traffic(
        peak_qps=10, avg_qps=5, input_len_p50=1024, output_len_p50=256, input_len_p99=4096, output_len_p99=1024,
        slo_ttft_ms=500, slo_tpot_ms=50,
    )
    reports = [
        bench_report(4.0, ttft_p99=300, tpot_p99=40, concurrency=32),  # meets the SLO
        bench_report(6.0, ttft_p99=900, tpot_p99=70, concurrency=64),  # faster, misses it
    ]
    plan = make_plan(
        LLAMA_3_8B, "bf16", "bf16", Hardware(memory_bytes=80 * GB), traffic,
        Prices(gpu_hour=2.0, api_input_per_million=0.5, api_output_per_million=1.5), reports,
    )
    assert plan.weights_bytes == 16_060_522_496
    assert plan.kv_bytes_per_token == 131_072
    # 80e9 x 0.9 - 16,060,522,496 = 55,939,477,504 bytes of KV cache
    assert plan.kv_cache_bytes == 55_939_477_504
    # / (131,072 x 16) = 26,674 blocks = 426,784 tokens
    assert plan.kv_capacity_tokens == 426_784
    # p99 sequence 4096 + 1024 = 5120 tokens = 320 blocks; 26,674 // 320 = 83
    assert plan.max_concurrency == 83
    assert plan.performance.source == "bench" and plan.performance.request_throughput == 4.0
    assert plan.performance.meets_slo
    # ceil(10 / (4.0 x 0.7)) = ceil(3.57) = 4
    assert plan.replicas == 4
    # 4 x $2 x 730 h
    assert plan.monthly_cost_self_hosted == 5_840.0
    # 5 qps x 2,628,000 s x 1024 in / 256 out
    assert plan.monthly_input_tokens == 13_455_360_000
    assert plan.monthly_output_tokens == 3_363_840_000
    # 13,455.36 M x $0.5 + 3,363.84 M x $1.5
    assert plan.monthly_cost_api == pytest.approx(11_773.44)
    # blended (1024 x 0.5 + 256 x 1.5) / 1280 = $0.7 per 1M tokens: 5840 / 0.7e-6
    assert plan.break_even_tokens_per_month == pytest.approx(8_342_857_142.857, rel=1e-9)
    assert plan.notes == []
    d = plan.to_dict()
    for key in ("weights_bytes", "kv_bytes_per_token", "max_concurrency", "replicas", "monthly_cost_self_hosted",
                "monthly_cost_api", "break_even_tokens_per_month"):
        assert key in d


def test_no_report_meets_the_slo_picks_the_fastest_responding_one_flagged() -> None:
    traffic = Traffic(peak_qps=1, input_len_p50=128, output_len_p50=128, input_len_p99=128, output_len_p99=128,
                      slo_ttft_ms=100)
    plan = make_plan(
        LLAMA_3_8B, "bf16", "bf16", Hardware(memory_bytes=80 * GB), traffic, None,
        [bench_report(3.0, 900, 10, 8), bench_report(2.0, 400, 10, 4000)],
    )
    assert plan.performance.request_throughput == 2.0 and not plan.performance.meets_slo
    assert plan.monthly_cost_self_hosted is None and plan.monthly_cost_api is None
    assert plan.break_even_tokens_per_month is None
    assert any("KV cache holds" in n for n in plan.notes)  # 4000 in flight > what fits
    assert any("SLO is not met" in n for n in plan.notes)


def test_roofline_by_hand() -> None:
    # 1e9 params bf16 = 2e9 bytes; KV 2 x 16 x 8 x 128 x 2 = 65,536 bytes/token
    model = ModelShape("toy", 10**9, 16, 8, 128)
    hardware = Hardware(memory_bytes=10 * GB, memory_utilization=1.0, bandwidth_bytes_s=1e12, flops=1e14)
    traffic = Traffic(peak_qps=50, input_len_p50=1000, output_len_p50=200, input_len_p99=1000,
                      output_len_p99=200, slo_tpot_ms=10)
    plan = make_plan(model, "bf16", "bf16", hardware, traffic)
    # KV 8e9 bytes / (65,536 x 16) = 7,629 blocks; 1200 tokens = 75 blocks per sequence -> 101
    assert plan.kv_cache_bytes == 8 * GB and plan.max_concurrency == 101
    # prefill 2e9 x 1000 / 1e14 = 0.02 s; context 1000 + 100 = 1100
    # step(B) = (2e9 + B x 1100 x 65,536) / 1e12 = 0.002 + 7.20896e-5 B
    # cycle(B) = 200 step(B) + 0.02 B = 0.4 + 0.03441792 B;  TPOT = cycle / 200 = 2 + 0.1720896 B ms
    # TPOT <= 10 ms: B <= 46.49 -> 46
    perf = plan.performance
    assert perf.source == "roofline" and perf.concurrency == 46 and perf.meets_slo
    assert perf.tpot_p99_ms == pytest.approx(9.9161216)
    assert perf.request_throughput == pytest.approx(46 / 1.98322432)  # 23.19 req/s
    assert perf.ttft_p99_ms == pytest.approx(20.0)
    assert plan.replicas == 4  # ceil(50 / (23.19 x 0.7)) = ceil(3.08)
    # without a TPOT SLO the batch is the KV ceiling: 101 / (0.4 + 0.03441792 x 101)
    loose = make_plan(model, "bf16", "bf16", hardware, Traffic(50, 1000, 200, 1000, 200))
    assert loose.performance.concurrency == 101
    assert loose.performance.request_throughput == pytest.approx(101 / 3.87620992)


def test_roofline_unmeetable_tpot_runs_one_sequence_flagged() -> None:
    model = ModelShape("toy", 10**9, 16, 8, 128)
    hardware = Hardware(memory_bytes=10 * GB, memory_utilization=1.0, bandwidth_bytes_s=1e12)
    plan = make_plan(model, "bf16", "bf16", hardware, Traffic(1, 1000, 200, 1000, 200, slo_tpot_ms=1.0))
    assert plan.performance.concurrency == 1 and not plan.performance.meets_slo
    assert plan.performance.ttft_p99_ms is None  # no flops given


def test_invalid_plans() -> None:
    traffic = Traffic(1, 128, 128, 128, 128)
    with pytest.raises(ValueError, match="do not fit"):
        make_plan(LLAMA_3_8B, "bf16", "bf16", Hardware(memory_bytes=16 * GB), traffic, bench_reports=[{}])
    with pytest.raises(ValueError, match="needs --bandwidth"):
        make_plan(LLAMA_3_8B, "bf16", "bf16", Hardware(memory_bytes=80 * GB), traffic)
    with pytest.raises(ValueError, match="headroom"):
        make_plan(LLAMA_3_8B, "bf16", "bf16", Hardware(memory_bytes=80 * GB), traffic, headroom=0.5)
    with pytest.raises(ValueError, match="bench serve --json"):
        make_plan(LLAMA_3_8B, "bf16", "bf16", Hardware(memory_bytes=80 * GB), traffic, bench_reports=[{"x": 1}])
    with pytest.raises(ValueError, match="p99 lengths"):
        Traffic(1, 128, 128, 64, 128)
    with pytest.raises(ValueError, match="memory utilization"):
        Hardware(memory_bytes=GB, memory_utilization=1.5)
