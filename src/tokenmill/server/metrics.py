"""Prometheus metrics under vLLM's names with the prefix `tokenmill:`.

Dashboards and autoscalers written for vLLM work with a prefix change. Two sources:

- engine state, read from `engine.stats()` at scrape time by a collector (gauges for the
  running/waiting/KV-usage state, counters for the engine's running totals), so a scrape
  always shows the last completed step and nothing is double counted;
- per-request latencies, observed by the server when a request ends, from the engine's
  RequestMetrics timestamps (falling back to the server's own stream timing), plus the
  inter-token gaps the server sees between consecutive outputs of a request;
- speculative decoding: drafts verified and accepted, and the acceptance-length histogram,
  from the engine's counters at scrape time;
- structured outputs: constrained requests by kind and constrained outputs that ended
  "stop" yet fail the server's re-check (see constraints.py), counted by the server; and
  grammar compile times, drained from the engine at scrape time into a histogram (the
  engine keeps them until read, so each compile is observed once).

Everything is labelled `model_name`. Each app owns its registry (no module-global state).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from tokenmill.engine.outputs import RequestMetrics
from tokenmill.engine.stats import SchedulerStats

PREFIX = "tokenmill:"
METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's buckets, so histogram_quantile() queries behave the same.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# Labels of structured_output_requests_total: the engine's kinds plus forced tool calls.
STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "tool_call")
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass
class StreamTiming:
    """Monotonic times the server saw for one request: submit, first and last output."""

    submitted: float
    first_output: float | None = None
    last_output: float | None = None


class _EngineStatsCollector(Collector):
    """Gauges and counters read from the engine's SchedulerStats at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], SchedulerStats | None]) -> None:
        self._model_name = model_name
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats() or SchedulerStats()
        gauges = (
            ("num_requests_running", "Requests in model execution batches.", stats.num_running_reqs),
            ("num_requests_waiting", "Requests waiting to be processed.", stats.num_waiting_reqs),
            ("kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.", stats.kv_cache_usage),
        )
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            gauge.add_metric([self._model_name], float(value))
            yield gauge
        counters = (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", stats.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", stats.prefix_cache_hits),
            ("num_preemptions", "Cumulative number of preemptions.", stats.num_preemptions),
            ("prompt_tokens", "Prefill tokens processed.", stats.num_prompt_tokens),
            ("generation_tokens", "Generation tokens processed.", stats.num_generation_tokens),
            ("spec_decode_num_drafts", "Speculative verifications (requests x steps with drafts).",
             sum(stats.spec_decode_acceptance_lengths)),
            ("spec_decode_num_draft_tokens", "Draft tokens verified.", stats.spec_decode_num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", stats.spec_decode_num_accepted_tokens),
        )
        for name, doc, value in counters:
            counter = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            counter.add_metric([self._model_name], float(value))
            yield counter
        # Accepted drafts per verification, from the engine's counts of each length.
        lengths = stats.spec_decode_acceptance_lengths
        cumulative, buckets = 0, []
        for length, count in enumerate(lengths):
            cumulative += count
            buckets.append((str(float(length)), float(cumulative)))
        buckets.append(("+Inf", float(cumulative)))
        histogram = HistogramMetricFamily(
            PREFIX + "spec_decode_acceptance_length",
            "Draft tokens accepted per speculative verification.",
            labels=["model_name"],
        )
        histogram.add_metric([self._model_name], buckets, float(stats.spec_decode_num_accepted_tokens))
        yield histogram


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        stats: Callable[[], SchedulerStats | None],
        grammar_compile_times: Callable[[], list[float]] | None = None,
    ) -> None:
        """`grammar_compile_times`: reads and clears the engine's compile times (seconds)."""
        self.model_name = model_name
        self._grammar_compile_times = grammar_compile_times
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineStatsCollector(model_name, stats))
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

        self._success = Counter(
            PREFIX + "request_success",
            "Count of finished requests (per sample), by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._ttft = histogram("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self._itl = histogram("inter_token_latency_seconds", "Time between outputs of a request.", _ITL_BUCKETS)
        self._e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS)
        self._queue = histogram("request_queue_time_seconds", "Time spent waiting before scheduling.", _LATENCY_BUCKETS)
        self._prefill = histogram("request_prefill_time_seconds", "Time from first scheduling to first token.", _LATENCY_BUCKETS)
        self._decode = histogram("request_decode_time_seconds", "Time from first to last token.", _LATENCY_BUCKETS)
        self._structured = Counter(
            PREFIX + "structured_output_requests",
            "Requests with a structured-output constraint, by kind.",
            ["model_name", "kind"],
            registry=self.registry,
        )
        self._structured_invalid = Counter(
            PREFIX + "structured_output_invalid",
            "Constrained outputs that ended 'stop' but failed the server's re-check (should stay 0).",
            labels,
            registry=self.registry,
        )
        self._compile = histogram("grammar_compile_seconds", "Time to compile a grammar (cache misses).", _COMPILE_BUCKETS)
        # Series exist from the first scrape (zeros), not from the first request.
        for h in (self._ttft, self._itl, self._e2e, self._queue, self._prefill, self._decode, self._compile):
            h.labels(model_name)
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)
        for kind in STRUCTURED_OUTPUT_KINDS:
            self._structured.labels(model_name, kind)
        self._structured_invalid.labels(model_name)

    def observe_output(self, timing: StreamTiming, now: float) -> None:
        """An output of a request arrived at `now`: record the gap since the previous one."""
        if timing.first_output is None:
            timing.first_output = now
        elif timing.last_output is not None:
            self._itl.labels(self.model_name).observe(max(0.0, now - timing.last_output))
        timing.last_output = now

    def observe_finished(
        self, finish_reasons: list[str], metrics: RequestMetrics | None, timing: StreamTiming
    ) -> None:
        """A request ended normally; one finish reason per sample."""
        for reason in finish_reasons:
            self._success.labels(self.model_name, reason).inc()
        arrival = metrics.arrival_time if metrics else timing.submitted
        first_token = metrics.first_token_time if metrics and metrics.first_token_time else timing.first_output
        finished = metrics.finished_time if metrics and metrics.finished_time else timing.last_output
        if first_token is not None:
            self._ttft.labels(self.model_name).observe(max(0.0, first_token - arrival))
        if finished is not None:
            self._e2e.labels(self.model_name).observe(max(0.0, finished - arrival))
        if metrics is None:
            return
        scheduled = metrics.first_scheduled_time
        if scheduled is not None:
            self._queue.labels(self.model_name).observe(max(0.0, scheduled - metrics.arrival_time))
            if metrics.first_token_time is not None:
                self._prefill.labels(self.model_name).observe(max(0.0, metrics.first_token_time - scheduled))
        if metrics.first_token_time is not None and metrics.last_token_time is not None:
            self._decode.labels(self.model_name).observe(
                max(0.0, metrics.last_token_time - metrics.first_token_time)
            )

    def observe_aborted(self, num_samples: int) -> None:
        self._success.labels(self.model_name, "abort").inc(num_samples)

    def observe_structured_request(self, kind: str) -> None:
        self._structured.labels(self.model_name, kind).inc()

    def observe_structured_invalid(self) -> None:
        self._structured_invalid.labels(self.model_name).inc()

    def render(self) -> bytes:
        if self._grammar_compile_times is not None:
            for seconds in self._grammar_compile_times():
                self._compile.labels(self.model_name).observe(max(0.0, seconds))
        return generate_latest(self.registry)
