"""Sweep points, their file names, and the plot."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.bench.runner import LoadConfig
from tokenmill.bench.sweep import SweepPoint, parse_list, plot_sweep, point_path, sweep_points


def test_sweep_points() -> None:
    base = LoadConfig(concurrency=8, num_warmups=1, seed=3)
    points = sweep_points(base, concurrencies=[1, 4])
    assert points == [
        SweepPoint("c1", LoadConfig(concurrency=1, num_warmups=1, seed=3), 0),
        SweepPoint("c4", LoadConfig(concurrency=4, num_warmups=1, seed=3), 1),
    ]
    rates = sweep_points(base, rates=[0.5, 2.0])
    assert [p.label for p in rates] == ["r0.5", "r2"]
    assert rates[1].load == LoadConfig(concurrency=8, request_rate=2.0, num_warmups=1, seed=3)
    with pytest.raises(ValueError, match="not both"):
        sweep_points(base, [1], [1.0])


def test_parse_list_and_point_path() -> None:
    assert parse_list("1,4,16", int) == [1, 4, 16]
    assert parse_list("0.5, 2", float) == [0.5, 2.0]
    for bad in ("", "1,x", "0,1"):
        with pytest.raises(ValueError):
            parse_list(bad, int)
    assert point_path(Path("out/run.json"), "c4") == Path("out/run_c4.json")
    assert point_path(Path("run"), "r2") == Path("run_r2.json")


def report(throughput: float, latency: float) -> dict:
    stats = {"mean": latency, "median": latency, "p90": latency, "p99": 2 * latency}
    return {"output_throughput": throughput, "ttft_ms": stats, "tpot_ms": stats, "e2e_ms": stats}


def test_plot_writes_a_png(tmp_path: Path) -> None:
    out = tmp_path / "plots" / "sweep.png"
    plot_sweep([("c1", report(10.0, 5.0)), ("c4", report(30.0, 9.0))], out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
