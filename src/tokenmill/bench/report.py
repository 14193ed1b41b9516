"""The human-readable summary of a run's report (the JSON is the record)."""

from __future__ import annotations

from typing import Any

from tokenmill.bench.metrics import LATENCY_KEYS


def format_summary(report: dict[str, Any]) -> str:
    c = report["config"]
    if c["request_rate"] is None:
        load = f"closed loop, concurrency {c['concurrency']}"
    else:
        cap = "" if c["concurrency"] is None else f", at most {c['concurrency']} in flight"
        load = f"open loop, {c['request_rate']} req/s, burstiness {c['burstiness']}{cap}"
    rows = [
        ("server", f"{c['base_url']} ({c['endpoint']}, model {c['model']})"),
        ("load", load),
        ("completed / failed", f"{report['completed']} / {report['failed']}"),
        ("duration (s)", f"{report['duration_s']:.2f}"),
        ("input / output tokens", f"{report['total_input_tokens']} / {report['total_output_tokens']}"),
        ("request throughput (req/s)", f"{report['request_throughput']:.3f}"),
        ("output throughput (tok/s)", f"{report['output_throughput']:.1f}"),
        ("total throughput (tok/s)", f"{report['total_token_throughput']:.1f}"),
    ]
    if report["goodput"] is not None:
        slo = ", ".join(f"{k[:-3]} <= {v:g} ms" for k, v in report["slo"].items() if v is not None)
        rows.append((f"goodput (req/s; {slo})", f"{report['goodput']:.3f}"))
    width = max(len(name) for name, _ in rows)
    lines = [f"{name.ljust(width)}  {value}" for name, value in rows]
    lines.append("")
    lines.append(f"{'latency (ms)':<12}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}")
    for key in LATENCY_KEYS:
        stats = report[key]
        cells = "".join(
            f"{'-':>10}" if stats[s] is None else f"{stats[s]:>10.2f}" for s in ("mean", "median", "p90", "p99")
        )
        lines.append(f"{key[:-3].upper():<12}{cells}")
    for error, count in report["errors"].items():
        lines.append(f"error x{count}: {error}")
    return "\n".join(lines)
