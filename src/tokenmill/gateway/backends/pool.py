"""A pool: replicas of one model in one region behind one routing policy.

Pools are the unit that cost-aware routing, region preference and spill-over choose among;
inside a pool the policy chooses the replica. Replicas can be added and removed at run time
(admin API); a removed replica leaves routing at once and its in-flight requests finish.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenmill.gateway.backends.backend import Backend
from tokenmill.gateway.backends.breaker import CircuitBreaker
from tokenmill.gateway.config import BackendConfig, HealthConfig, PoolConfig
from tokenmill.gateway.routing.policy import RoutingPolicy, make_policy


class Pool:
    def __init__(self, config: PoolConfig, health: HealthConfig) -> None:
        self.config = config
        self.name = config.name
        self.model = config.model
        self.region = config.region
        self.max_cost_tokens = config.max_cost_tokens
        self.policy: RoutingPolicy = make_policy(config)
        self._health = health
        self.backends: list[Backend] = []
        for backend in config.backends:
            self.add(backend)

    def add(self, config: BackendConfig) -> Backend:
        name = config.name or config.url
        if any(b.name == name or b.url == config.url for b in self.backends):
            raise ValueError(f"pool {self.name!r} already has a backend {name!r}")
        backend = Backend(
            url=config.url,
            name=name,
            kind=config.kind,
            pool=self.name,
            region=self.region,
            max_inflight=config.max_inflight,
            breaker=CircuitBreaker(self._health.failure_threshold, self._health.open_s),
        )
        self.backends.append(backend)
        return backend

    def remove(self, name: str) -> Backend:
        for backend in self.backends:
            if backend.name == name or backend.url == name:
                self.backends.remove(backend)
                backend.active = False
                return backend
        raise KeyError(name)

    def routable(self, now: float) -> list[Backend]:
        return [b for b in self.backends if b.active and b.breaker.can_route(now)]

    def capacity(self, now: float) -> tuple[int, int]:
        """(in flight, slots) over the routable replicas."""
        live = self.routable(now)
        return sum(b.num_inflight for b in live), sum(b.max_inflight for b in live)


def all_backends(pools: Iterable[Pool]) -> list[Backend]:
    return [b for p in pools for b in p.backends]
