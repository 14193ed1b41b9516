"""Capacity planning: memory, concurrency, replicas and cost for one model on one accelerator.

Memory (one replica = `gpus_per_replica` accelerators):

    weights_bytes       = num_params x bytes per weight (bf16 2, fp8 1, int8 1, int4 0.5;
                          quantization scales are not counted)
    kv_bytes_per_token  = 2 (K and V) x layers x kv_heads x head_dim x bytes per KV value
    kv_cache_bytes      = gpu_memory x gpus x memory_utilization - weights - overhead
    kv_blocks           = floor(kv_cache_bytes / (kv_bytes_per_token x block_size))
    max_concurrency     = floor(kv_blocks / ceil((input_p99 + output_p99) / block_size)):
                          how many sequences fit at once when every one reaches p99 length

Per-replica performance, preferably measured (`tokenmill bench serve` reports): of the
given runs, the highest request throughput whose p99 TTFT and p99 TPOT meet the SLO.
Without a measurement, a roofline estimate (an optimistic bound: real kernels reach some
fraction of it):

    step_s(B)   = (weights_bytes + B x context x kv_bytes_per_token) / bandwidth
                  one decode step of B sequences reads every weight and every sequence's KV
                  once; context = input_p50 + output_p50 / 2, the mean length mid-decode
    prefill_s   = 2 x num_params x input_p50 / flops   (0 when flops is not given)
    cycle_s(B)  = output_p50 x step_s(B) + B x prefill_s
                  a slot's life: its decode steps, stalled by the B prefills admitted meanwhile
    rps(B)      = B / cycle_s(B);  TPOT(B) = cycle_s(B) / output_p50
    TTFT        = 2 x num_params x input_p99 / flops   (no queueing, at the headroom below)
    B           = the largest batch <= max_concurrency whose TPOT meets the SLO

Replicas and cost:

    replicas        = ceil(peak_qps / (rps x (1 - headroom)))    headroom 0.2-0.4, default 0.3:
                      each replica runs at most at 70% of what it can sustain, so p99 holds
    self-hosted     = replicas x gpus_per_replica x $/GPU-hour x 730 hours/month
    API             = monthly input tokens x $/1M in + output tokens x $/1M out, where
                      monthly tokens = avg_qps x 730 x 3600 s x the p50 length
    break-even      = self-hosted $ / blended API $ per token, the blend weighted by the
                      p50 input and output lengths: above this many tokens a month the
                      self-hosted fleet (sized for the peak) is cheaper
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from tokenmill.plan.model import ModelShape

BYTES_PER_WEIGHT = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
BYTES_PER_KV_VALUE = {"bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
HOURS_PER_MONTH = 730
SECONDS_PER_MONTH = HOURS_PER_MONTH * 3600
HEADROOM_RANGE = (0.2, 0.4)


@dataclass(frozen=True)
class Hardware:
    """One kind of accelerator, and how many of them one replica spans."""

    memory_bytes: int
    # Fraction of memory the engine may use (weights + KV + overhead), as vLLM's flag.
    memory_utilization: float = 0.9
    # Bytes reserved for activations, CUDA graphs, fragmentation.
    overhead_bytes: int = 0
    # Memory bandwidth (bytes/s) and dense compute (FLOP/s) per accelerator: roofline only.
    bandwidth_bytes_s: float | None = None
    flops: float | None = None
    gpus_per_replica: int = 1

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise ValueError("accelerator memory must be positive")
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory utilization must be in (0, 1], got {self.memory_utilization}")
        if self.gpus_per_replica < 1:
            raise ValueError("gpus per replica must be >= 1")


@dataclass(frozen=True)
class Traffic:
    """What the fleet must serve."""

    peak_qps: float
    input_len_p50: int
    output_len_p50: int
    input_len_p99: int
    output_len_p99: int
    # Mean QPS over the month (monthly volume); defaults to the peak.
    avg_qps: float | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None

    def __post_init__(self) -> None:
        if not self.peak_qps > 0:
            raise ValueError(f"peak QPS must be positive, got {self.peak_qps}")
        if self.avg_qps is not None and not 0 < self.avg_qps <= self.peak_qps:
            raise ValueError("average QPS must be positive and at most the peak")
        if min(self.input_len_p50, self.output_len_p50) < 1:
            raise ValueError("lengths must be >= 1")
        if self.input_len_p99 < self.input_len_p50 or self.output_len_p99 < self.output_len_p50:
            raise ValueError("p99 lengths must be >= p50 lengths")

    @property
    def monthly_qps(self) -> float:
        return self.avg_qps if self.avg_qps is not None else self.peak_qps


@dataclass(frozen=True)
class Prices:
    gpu_hour: float | None = None
    api_input_per_million: float | None = None
    api_output_per_million: float | None = None


@dataclass(frozen=True)
class ReplicaPerformance:
    """What one replica sustains, and at what latency."""

    source: str  # "bench" or "roofline"
    request_throughput: float
    concurrency: int | None
    ttft_p99_ms: float | None
    tpot_p99_ms: float | None
    meets_slo: bool


@dataclass(frozen=True)
class Plan:
    model: str
    num_params: int
    weights_bytes: int
    kv_bytes_per_token: int
    kv_cache_bytes: int
    kv_capacity_tokens: int
    max_concurrency: int
    performance: ReplicaPerformance
    headroom: float
    replicas: int
    monthly_input_tokens: float
    monthly_output_tokens: float
    monthly_cost_self_hosted: float | None
    monthly_cost_api: float | None
    break_even_tokens_per_month: float | None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def weights_bytes(model: ModelShape, dtype: str) -> int:
    return math.ceil(model.num_params * _lookup(BYTES_PER_WEIGHT, dtype, "weight dtype"))


def kv_bytes_per_token(model: ModelShape, kv_dtype: str) -> int:
    value = _lookup(BYTES_PER_KV_VALUE, kv_dtype, "KV dtype")
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * value


def measured_performance(reports: Sequence[dict[str, Any]], traffic: Traffic) -> ReplicaPerformance:
    """The best bench run that meets the SLO at p99 (else the fastest-responding one, flagged)."""
    if not reports:
        raise ValueError("no bench reports")
    candidates = []
    for report in reports:
        try:
            ttft, tpot = report["ttft_ms"]["p99"], report["tpot_ms"]["p99"]
            rps = float(report["request_throughput"])
            concurrency = report.get("config", {}).get("concurrency")
        except (KeyError, TypeError):
            raise ValueError("a bench report must be `tokenmill bench serve --json` output") from None
        if report.get("completed", 0) < 1:
            raise ValueError("a bench report has no completed requests")
        meets = (traffic.slo_ttft_ms is None or (ttft is not None and ttft <= traffic.slo_ttft_ms)) and (
            traffic.slo_tpot_ms is None or (tpot is not None and tpot <= traffic.slo_tpot_ms)
        )
        candidates.append(ReplicaPerformance("bench", rps, concurrency, ttft, tpot, meets))
    meeting = [c for c in candidates if c.meets_slo]
    if meeting:
        return max(meeting, key=lambda c: c.request_throughput)
    return min(candidates, key=lambda c: (c.ttft_p99_ms or math.inf, c.tpot_p99_ms or math.inf))


def roofline_performance(
    model: ModelShape, weights: int, kv_per_token: int, max_concurrency: int, hardware: Hardware, traffic: Traffic
) -> ReplicaPerformance:
    if hardware.bandwidth_bytes_s is None:
        raise ValueError("without a bench report the roofline estimate needs --bandwidth")
    bandwidth = hardware.bandwidth_bytes_s * hardware.gpus_per_replica
    flops = None if hardware.flops is None else hardware.flops * hardware.gpus_per_replica
    context = traffic.input_len_p50 + traffic.output_len_p50 / 2
    prefill_s = 0.0 if flops is None else 2 * model.num_params * traffic.input_len_p50 / flops

    def cycle_s(batch: int) -> float:
        step_s = (weights + batch * context * kv_per_token) / bandwidth
        return traffic.output_len_p50 * step_s + batch * prefill_s

    def tpot_ms(batch: int) -> float:
        return cycle_s(batch) / traffic.output_len_p50 * 1000

    batch = max_concurrency
    if traffic.slo_tpot_ms is not None:
        # TPOT grows with the batch: the largest batch that meets the SLO, by bisection.
        low, high = 1, max_concurrency
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if tpot_ms(mid) <= traffic.slo_tpot_ms else (low, mid - 1)
        batch = low
    ttft_ms = None if flops is None else 2 * model.num_params * traffic.input_len_p99 / flops * 1000
    meets = (traffic.slo_tpot_ms is None or tpot_ms(batch) <= traffic.slo_tpot_ms) and (
        traffic.slo_ttft_ms is None or (ttft_ms is not None and ttft_ms <= traffic.slo_ttft_ms)
    )
    return ReplicaPerformance("roofline", batch / cycle_s(batch), batch, ttft_ms, tpot_ms(batch), meets)


def make_plan(
    model: ModelShape,
    dtype: str,
    kv_dtype: str,
    hardware: Hardware,
    traffic: Traffic,
    prices: Prices | None = None,
    bench_reports: Sequence[dict[str, Any]] = (),
    headroom: float = 0.3,
    block_size: int = 16,
) -> Plan:
    if not HEADROOM_RANGE[0] <= headroom <= HEADROOM_RANGE[1]:
        raise ValueError(f"headroom must be in [{HEADROOM_RANGE[0]}, {HEADROOM_RANGE[1]}], got {headroom}")
    if block_size < 1:
        raise ValueError("block size must be >= 1")
    prices = prices or Prices()
    notes: list[str] = []
    weights = weights_bytes(model, dtype)
    kv_per_token = kv_bytes_per_token(model, kv_dtype)
    budget = hardware.memory_bytes * hardware.gpus_per_replica * hardware.memory_utilization
    kv_cache = math.floor(budget - weights - hardware.overhead_bytes)
    if kv_cache <= 0:
        raise ValueError(
            f"weights ({weights / 1e9:.2f} GB) and overhead do not fit in {budget / 1e9:.2f} GB usable: "
            "use a smaller dtype or more GPUs per replica"
        )
    kv_blocks = kv_cache // (kv_per_token * block_size)
    blocks_per_sequence = math.ceil((traffic.input_len_p99 + traffic.output_len_p99) / block_size)
    max_concurrency = kv_blocks // blocks_per_sequence
    if max_concurrency < 1:
        raise ValueError("the KV cache cannot hold one sequence of p99 length")

    if bench_reports:
        performance = measured_performance(bench_reports, traffic)
        if performance.concurrency is not None and performance.concurrency > max_concurrency:
            notes.append(
                f"the bench ran {performance.concurrency} requests in flight; at p99 lengths the KV cache holds {max_concurrency}"
            )
    else:
        performance = roofline_performance(model, weights, kv_per_token, max_concurrency, hardware, traffic)
        notes.append("throughput is a roofline estimate (an upper bound); a bench report (--bench) is preferred")
    if not performance.meets_slo:
        notes.append("the SLO is not met even at the chosen operating point: more replicas do not fix latency")

    replicas = math.ceil(traffic.peak_qps / (performance.request_throughput * (1 - headroom)))
    monthly_input = traffic.monthly_qps * SECONDS_PER_MONTH * traffic.input_len_p50
    monthly_output = traffic.monthly_qps * SECONDS_PER_MONTH * traffic.output_len_p50
    self_hosted = None
    if prices.gpu_hour is not None:
        self_hosted = replicas * hardware.gpus_per_replica * prices.gpu_hour * HOURS_PER_MONTH
    api = break_even = None
    if prices.api_input_per_million is not None and prices.api_output_per_million is not None:
        api = (monthly_input * prices.api_input_per_million + monthly_output * prices.api_output_per_million) / 1e6
        blended_per_token = (
            traffic.input_len_p50 * prices.api_input_per_million + traffic.output_len_p50 * prices.api_output_per_million
        ) / (traffic.input_len_p50 + traffic.output_len_p50) / 1e6
        if self_hosted is not None and blended_per_token > 0:
            break_even = self_hosted / blended_per_token
    return Plan(
        model=model.name,
        num_params=model.num_params,
        weights_bytes=weights,
        kv_bytes_per_token=kv_per_token,
        kv_cache_bytes=kv_cache,
        kv_capacity_tokens=kv_blocks * block_size,
        max_concurrency=max_concurrency,
        performance=performance,
        headroom=headroom,
        replicas=replicas,
        monthly_input_tokens=monthly_input,
        monthly_output_tokens=monthly_output,
        monthly_cost_self_hosted=self_hosted,
        monthly_cost_api=api,
        break_even_tokens_per_month=break_even,
        notes=notes,
    )


def _lookup(table: dict[str, Any], key: str, what: str) -> Any:
    if key not in table:
        raise ValueError(f"{what} must be one of {', '.join(table)}, got {key!r}")
    return table[key]
