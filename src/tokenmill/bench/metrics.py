"""A run's summary: latency distributions, throughput and goodput.

Over the requests that completed (failures are counted and their errors grouped, but
they add no latency samples):

  * ttft_ms, tpot_ms, itl_ms, e2e_ms: mean, median, p90, p99 (and min, max). TPOT has one
    sample per request with at least 2 output tokens; ITL one per gap between content
    chunks, pooled over all requests. Percentiles interpolate linearly between order
    statistics (numpy's default), so p50 of [1, 2, 3, 4] is 2.5.
  * request_throughput = completed / duration; output_throughput = output tokens /
    duration; total_token_throughput = (prompt + output tokens) / duration, where the
    duration runs from the first measured request's send to the last one's end.
  * goodput = requests meeting every SLO / duration (DistServe's definition, as in vLLM's
    `--goodput`). A request meets `tpot` trivially when it has a single output token.
    Without an SLO, goodput is null.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tokenmill.bench.client import RequestResult

LATENCY_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; `values` must be non-empty."""
    if not values:
        raise ValueError("percentile of no values")
    data = sorted(values)
    position = (len(data) - 1) * q / 100.0
    low = int(position)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (position - low)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean / median / p90 / p99 / min / max in milliseconds (all None without samples)."""
    keys = ("mean", "median", "p90", "p99", "min", "max")
    if not values_s:
        return dict.fromkeys(keys)
    ms = [v * 1000.0 for v in values_s]
    return {
        "mean": sum(ms) / len(ms),
        "median": percentile(ms, 50),
        "p90": percentile(ms, 90),
        "p99": percentile(ms, 99),
        "min": min(ms),
        "max": max(ms),
    }


@dataclass(frozen=True)
class SLO:
    """Per-request latency objectives in milliseconds; None means unconstrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, text: str) -> SLO:
        """'ttft=500,tpot=50,e2e=10000' (any subset, at least one)."""
        values: dict[str, float] = {}
        for part in text.split(","):
            name, sep, value = part.strip().partition("=")
            if not sep or name not in ("ttft", "tpot", "e2e"):
                raise ValueError(f"an SLO is ttft=MS,tpot=MS,e2e=MS (any subset), got {text!r}")
            try:
                values[f"{name}_ms"] = float(value)
            except ValueError:
                raise ValueError(f"SLO {name} must be a number of milliseconds, got {value!r}") from None
            if values[f"{name}_ms"] <= 0:
                raise ValueError(f"SLO {name} must be positive, got {value}")
        return cls(**values)

    def is_met(self, result: RequestResult) -> bool:
        if not result.ok:
            return False
        tpot = result.tpot_s
        return (
            (self.ttft_ms is None or result.ttft_s * 1000 <= self.ttft_ms)
            and (self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms)
            and (self.e2e_ms is None or result.e2e_s * 1000 <= self.e2e_ms)
        )


def measured_duration(results: Sequence[RequestResult]) -> float:
    """First send to last end over all requests (failed ones included)."""
    if not results:
        return 0.0
    start = min(r.start_s for r in results)
    return max(r.start_s + r.e2e_s for r in results) - start


def summarize(
    results: Sequence[RequestResult], duration_s: float, slo: SLO | None = None
) -> dict[str, Any]:
    """The report's metrics over `results`, measured over `duration_s` seconds."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    good = sum(1 for r in ok if slo.is_met(r)) if slo is not None else None
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(Counter(r.error for r in results if not r.ok).most_common()),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "goodput": None if good is None else good / duration_s,
        "slo": None if slo is None else asdict(slo),
        "ttft_ms": distribution_ms([r.ttft_s for r in ok]),
        "tpot_ms": distribution_ms([t for r in ok if (t := r.tpot_s) is not None]),
        "itl_ms": distribution_ms([gap for r in ok for gap in r.itl_s]),
        "e2e_ms": distribution_ms([r.e2e_s for r in ok]),
    }
