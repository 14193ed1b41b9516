"""`tokenmill plan` through the argparse entry point."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tokenmill.cli.main import main
from tokenmill.cli.plan import parse_bandwidth, parse_bytes


def test_parse_sizes() -> None:
    assert parse_bytes("80GB") == 80e9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("512MB") == 512e6
    assert parse_bytes("80") == 80e9
    assert parse_bandwidth("3.35TB/s") == 3.35e12
    assert parse_bandwidth("900") == 900e9
    for bad in ("lots", "80XB", "-1GB"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)


def test_json_plan_with_a_bench_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = tmp_path / "b.json"
    bench.write_text(json.dumps({
        "completed": 10, "request_throughput": 4.0, "ttft_ms": {"p99": 300.0}, "tpot_ms": {"p99": 40.0},
        "config": {"concurrency": 32},
    }))
    code = main([
        "plan", "--model", "llama-3-8b", "--dtype", "bf16", "--kv-dtype", "bf16", "--gpu-memory", "80GB",
        "--peak-qps", "10", "--avg-qps", "5", "--input-len", "1024", "--input-len-p99", "4096", "--output-len", "256",
        "--output-len-p99", "1024", "--slo", "ttft=500,tpot=50", "--bench", str(bench), "--gpu-hour-price", "2",
        "--api-input-price", "0.5", "--api-output-price", "1.5", "--json",
    ])
    assert code == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["weights_bytes"] == 16_060_522_496
    assert plan["kv_bytes_per_token"] == 131_072
    assert plan["max_concurrency"] == 83
    assert plan["replicas"] == 4
    assert plan["monthly_cost_self_hosted"] == 5840.0
    assert plan["monthly_cost_api"] == pytest.approx(11_773.44)
    assert plan["break_even_tokens_per_month"] == pytest.approx(8_342_857_142.857, rel=1e-9)


def test_table_plan_with_explicit_shape_and_roofline(capsys: pytest.CaptureFixture[str]) -> None:
    code = main([
        "plan", "--params", "1e9", "--layers", "16", "--kv-heads", "8", "--head-dim", "128", "--gpu-memory", "10GB",
        "--memory-utilization", "1.0", "--bandwidth", "1000GB/s", "--tflops", "100", "--peak-qps", "50",
        "--input-len", "1000", "--output-len", "200", "--slo", "tpot=10",
    ])
    assert code == 0
    lines = dict(line.split("  ", 1) for line in capsys.readouterr().out.splitlines() if "  " in line)
    assert lines["max concurrency (p99 lengths)"].strip() == "101"
    assert lines["replicas (30% headroom)"].strip() == "4"
    assert "at concurrency 46" in lines["per replica (roofline)"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "gpt-17"], "not a config.json path nor a known id"),
        (["--params", "1e9"], "give --model, or all of"),
        (["--model", "llama-3-8b", "--layers", "3"], "not both"),
        (["--model", "llama-3-8b", "--slo", "e2e=5"], "--slo is ttft=MS,tpot=MS"),
        (["--model", "llama-3-8b", "--bench", "/nonexistent.json"], "bench report not found"),
        (["--model", "llama-3-8b", "--headroom", "0.1", "--bandwidth", "1TB/s"], "headroom must be in"),
    ],
)
def test_errors(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--gpu-memory", "80GB", "--peak-qps", "1", "--input-len", "10", "--output-len", "10", *args])
    assert code == 2
    assert message in capsys.readouterr().err
