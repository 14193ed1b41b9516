"""One replica as the gateway sees it: where it is, what it holds, whether it may be used.

The gateway's own accounting (requests and estimated tokens in flight from this gateway,
per priority class) is exact and updated on every dispatch and release. What the replica
reports at /metrics (requests running and waiting, from every client) is refreshed by the
health checker and feeds least-load routing.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from tokenmill.gateway.backends.breaker import CircuitBreaker


@dataclass(eq=False)
class Backend:
    url: str
    name: str
    kind: str
    pool: str
    region: str
    max_inflight: int
    breaker: CircuitBreaker
    num_inflight: int = 0
    num_inflight_tokens: int = 0
    inflight_by_class: Counter[str] = field(default_factory=Counter)
    # From the replica's /metrics (tokenmill backends), all clients included.
    reported_running: float = 0.0
    reported_waiting: float = 0.0
    # False once removed through the admin API: in-flight requests finish, no new ones.
    active: bool = True

    @property
    def accepts_extensions(self) -> bool:
        """tokenmill servers take `priority` and `cache_salt` in the body."""
        return self.kind == "tokenmill"

    def has_room(self, cls: str, share: float) -> bool:
        class_limit = max(1, int(self.max_inflight * share))
        return self.num_inflight < self.max_inflight and self.inflight_by_class[cls] < class_limit

    def dispatch(self, cls: str, num_tokens: int, now: float) -> None:
        self.num_inflight += 1
        self.num_inflight_tokens += num_tokens
        self.inflight_by_class[cls] += 1
        self.breaker.on_dispatch(now)

    def release(self, cls: str, num_tokens: int) -> None:
        self.num_inflight -= 1
        self.num_inflight_tokens -= num_tokens
        self.inflight_by_class[cls] -= 1
        assert self.num_inflight >= 0 and self.inflight_by_class[cls] >= 0, self.name

    def describe(self, now: float) -> dict[str, object]:
        return {
            "name": self.name,
            "url": self.url,
            "kind": self.kind,
            "pool": self.pool,
            "region": self.region,
            "max_inflight": self.max_inflight,
            "inflight": self.num_inflight,
            "inflight_tokens": self.num_inflight_tokens,
            "state": self.breaker.state.value,
            "routable": self.active and self.breaker.can_route(now),
        }
