"""Gateway metrics at /metrics, Prometheus text, names under `tokenmill:gateway_`.

Requests by tenant, model, tier, region, backend and outcome; the latency the gateway adds
(its time on a request minus the upstream's); queue depth per class and replica state
(read at scrape time); sheds, degradation steps, retries, failovers and model downgrades;
cache hits and misses; per-tenant token usage. Each app owns its registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill.gateway.backends.backend import Backend

PREFIX = "tokenmill:gateway_"
CONTENT_TYPE = CONTENT_TYPE_LATEST
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_STATES = {"closed": 0.0, "half_open": 1.0, "open": 2.0}


class _StateCollector(Collector):
    def __init__(self, num_waiting: Callable[[], dict[str, int]], backends: Callable[[], list[Backend]]) -> None:
        self._num_waiting = num_waiting
        self._backends = backends

    def collect(self) -> Iterator[Metric]:
        queue = GaugeMetricFamily(PREFIX + "queue_depth", "Requests waiting for a slot, by class.", labels=["class"])
        for cls, n in self._num_waiting().items():
            queue.add_metric([cls], float(n))
        yield queue
        labels = ["pool", "backend"]
        inflight = GaugeMetricFamily(PREFIX + "backend_inflight", "Requests in flight from this gateway.", labels=labels)
        state = GaugeMetricFamily(PREFIX + "backend_circuit_state", "0 closed, 1 half-open, 2 open.", labels=labels)
        for b in self._backends():
            inflight.add_metric([b.pool, b.name], float(b.num_inflight))
            state.add_metric([b.pool, b.name], _STATES[b.breaker.state.value])
        yield inflight
        yield state


class GatewayMetrics:
    def __init__(self, num_waiting: Callable[[], dict[str, int]], backends: Callable[[], list[Backend]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_StateCollector(num_waiting, backends))
        r = self.registry
        self.requests = Counter(
            PREFIX + "requests", "Requests by tenant, model, tier, region, backend and outcome.",
            ["tenant", "model", "tier", "region", "backend", "outcome"], registry=r,
        )
        self.overhead = Histogram(
            PREFIX + "overhead_seconds", "Latency the gateway adds (its time minus the upstream's).",
            buckets=_OVERHEAD_BUCKETS, registry=r,
        )
        self.sheds = Counter(PREFIX + "sheds", "Requests shed with 429, by class and reason.", ["class", "reason"], registry=r)
        self.degradations = Counter(
            PREFIX + "degradations", "Degradation steps applied, by class and action.", ["class", "action"], registry=r
        )
        self.retries = Counter(PREFIX + "retries", "Requests retried on another replica before their first byte.", registry=r)
        self.failovers = Counter(PREFIX + "failovers", "Upstream attempts that failed, by backend.", ["backend"], registry=r)
        self.downgrades = Counter(PREFIX + "downgrades", "Requests sent to a fallback model.", ["model", "fallback"], registry=r)
        self.stream_errors = Counter(PREFIX + "stream_errors", "Streams that broke after their first byte.", registry=r)
        self.cache_hits = Counter(PREFIX + "cache_hits", "Response cache hits.", registry=r)
        self.cache_misses = Counter(PREFIX + "cache_misses", "Cacheable requests not in the cache.", registry=r)
        self.cascade = Counter(PREFIX + "cascade", "Cascade outcomes (accepted, or the escalation reason).", ["outcome"], registry=r)
        self.tenant_tokens = Counter(
            PREFIX + "tenant_tokens", "Tokens used per tenant, prompt or completion.", ["tenant", "kind"], registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
