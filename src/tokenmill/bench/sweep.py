"""Sweeps: one run per concurrency or per request rate, and the latency-vs-throughput plot.

Each point is a full run (its own warm-ups) with the workload rebuilt from `seed + i` for
point i, so no point's prompts sit in the prefix cache from an earlier point. Each
point's report is written next to `--json OUT` as OUT_c{N}.json or OUT_r{R}.json.

The plot has one panel per latency (TTFT, TPOT, E2E): median and p99 against output
throughput, each point labelled with its concurrency or rate. Where the curve turns up
steeply is the server's knee: more offered load buys latency, not throughput.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tokenmill.bench.runner import LoadConfig


@dataclass(frozen=True)
class SweepPoint:
    label: str
    load: LoadConfig
    # Offset added to the workload seed for this point.
    seed_offset: int


def sweep_points(
    base: LoadConfig,
    concurrencies: Sequence[int] = (),
    rates: Sequence[float] = (),
) -> list[SweepPoint]:
    """Closed-loop points per concurrency, or open-loop points per rate (not both)."""
    if concurrencies and rates:
        raise ValueError("sweep either concurrency or rate, not both")
    if concurrencies:
        return [
            SweepPoint(f"c{c}", replace(base, concurrency=c, request_rate=None), i)
            for i, c in enumerate(concurrencies)
        ]
    return [
        SweepPoint(f"r{r:g}", replace(base, request_rate=r), i) for i, r in enumerate(rates)
    ]


def parse_list(text: str, kind: type) -> list[Any]:
    """'1,4,16' -> [1, 4, 16] (ints or floats)."""
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"expected a comma-separated list of numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"expected positive numbers, got {text!r}")
    return values


def point_path(json_out: Path, label: str) -> Path:
    """OUT.json -> OUT_{label}.json."""
    return json_out.with_name(f"{json_out.stem}_{label}{json_out.suffix or '.json'}")


def plot_sweep(points: Sequence[tuple[str, dict[str, Any]]], out: Path) -> None:
    """Median and p99 of TTFT, TPOT and E2E against output throughput, to a PNG."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    throughput = [report["output_throughput"] for _, report in points]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, title in zip(axes, ("ttft_ms", "tpot_ms", "e2e_ms"), ("TTFT", "TPOT", "E2E"), strict=True):
        for stat, style in (("median", "o-"), ("p99", "s--")):
            values = [report[key][stat] for _, report in points]
            ax.plot(throughput, [float("nan") if v is None else v for v in values], style, label=stat)
        for (label, report), x in zip(points, throughput, strict=True):
            if report[key]["p99"] is not None:
                ax.annotate(label, (x, report[key]["p99"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_title(f"{title} vs throughput")
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"{title} (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
