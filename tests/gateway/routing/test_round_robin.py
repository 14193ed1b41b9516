from __future__ import annotations

from routing_fixtures import backends

from tokenmill.gateway.routing.policy import RouteKey
from tokenmill.gateway.routing.round_robin import RoundRobin


def test_cycles_through_candidates_in_order() -> None:
    a, b, c = backends("a", "b", "c")
    policy = RoundRobin()
    key = RouteKey("x")
    assert [policy.choose([a, b, c], key).name for _ in range(5)] == ["a", "b", "c", "a", "b"]  # type: ignore[union-attr]
    assert policy.choose([], key) is None
