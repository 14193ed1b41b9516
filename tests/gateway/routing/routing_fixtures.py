"""Replicas for policy tests, built without a pool."""

from __future__ import annotations

from tokenmill.gateway.backends.backend import Backend
from tokenmill.gateway.backends.breaker import CircuitBreaker


def backends(*names: str, max_inflight: int = 100) -> list[Backend]:
    return [
        Backend(url=f"http://{n}:1", name=n, kind="tokenmill", pool="p", region="r", max_inflight=max_inflight,
                breaker=CircuitBreaker(3, 5.0))
        for n in names
    ]


def load(backend: Backend, num_requests: int, tokens_each: int = 0) -> None:
    for _ in range(num_requests):
        backend.dispatch("interactive", tokens_each, 0.0)
