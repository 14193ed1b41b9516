from __future__ import annotations

from routing_fixtures import backends, load

from tokenmill.gateway.routing.least_load import TOKENS_PER_REQUEST, LeastLoad, outstanding_tokens
from tokenmill.gateway.routing.policy import RouteKey


def test_outstanding_tokens_counts_own_and_reported_work() -> None:
    (a,) = backends("a")
    load(a, 2, tokens_each=100)
    assert outstanding_tokens(a) == 200 + 2 * TOKENS_PER_REQUEST
    # The replica reports 2 running (ours) and 3 waiting from other clients.
    a.reported_running, a.reported_waiting = 2.0, 3.0
    assert outstanding_tokens(a) == 200 + 5 * TOKENS_PER_REQUEST


def test_picks_fewest_outstanding_tokens_not_fewest_requests() -> None:
    a, b, c = backends("a", "b", "c")
    load(a, 1, tokens_each=2000)  # one long request
    load(b, 3, tokens_each=10)  # three short ones
    load(c, 2, tokens_each=400)
    key = RouteKey("x")
    assert LeastLoad().choose([a, b, c], key) is b  # 30 + 192 < 800 + 128 < 2000 + 64
    b.reported_waiting = 20.0  # b is busy with other clients' requests
    assert LeastLoad().choose([a, b, c], key) is c


def test_ties_go_to_the_first_candidate() -> None:
    a, b = backends("a", "b")
    assert LeastLoad().choose([b, a], RouteKey("x")) is b
    assert LeastLoad().choose([], RouteKey("x")) is None
