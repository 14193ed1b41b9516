from __future__ import annotations

from routing_fixtures import backends, load

from tokenmill.gateway.routing.policy import RouteKey
from tokenmill.gateway.routing.session_affinity import SessionAffinity


def test_a_session_sticks_to_one_replica_whatever_its_prompts() -> None:
    fleet = backends("a", "b", "c")
    policy = SessionAffinity(header="X-Session-Id")
    picks = {policy.choose(fleet, RouteKey(f"prompt {i}", {"x-session-id": "s-42"})).name for i in range(10)}  # type: ignore[union-attr]
    assert len(picks) == 1
    sessions = {policy.choose(fleet, RouteKey("same", {"x-session-id": f"s-{i}"})).name for i in range(50)}  # type: ignore[union-attr]
    assert sessions == {"a", "b", "c"}


def test_without_the_header_it_routes_least_load() -> None:
    a, b = backends("a", "b")
    load(a, 3)
    assert SessionAffinity().choose([a, b], RouteKey("p", {})) is b
    assert SessionAffinity().choose([a, b], RouteKey("p", {"x-session-id": ""})) is b
