from __future__ import annotations

from collections import Counter

from routing_fixtures import backends, load

from tokenmill.gateway.routing.hash_ring import BoundedRing, HashRing
from tokenmill.gateway.routing.policy import RouteKey
from tokenmill.gateway.routing.prefix_aware import PrefixAware

SYSTEM = "system\nYou are a meticulous assistant for the ACME support desk. " * 4


def test_shared_prefix_goes_to_one_replica() -> None:
    fleet = backends("a", "b", "c")
    policy = PrefixAware(prefix_chars=128)
    chosen = {policy.choose(fleet, RouteKey(SYSTEM + f"user\nquestion {i}")).name for i in range(20)}  # type: ignore[union-attr]
    assert len(chosen) == 1


def test_distinct_prefixes_spread_over_the_fleet() -> None:
    fleet = backends("a", "b", "c")
    policy = PrefixAware(prefix_chars=64)
    counts = Counter(policy.choose(fleet, RouteKey(f"tenant {i} " * 10)).name for i in range(300))  # type: ignore[union-attr]
    assert set(counts) == {"a", "b", "c"}
    assert min(counts.values()) >= 60  # 64 vnodes each: no replica gets under a fifth


def test_hot_prefix_overflows_to_the_next_replica_on_its_ring_walk() -> None:
    fleet = backends("a", "b", "c")
    policy = PrefixAware(prefix_chars=128, load_factor=1.25)
    key = RouteKey(SYSTEM)
    names = {b.name: b for b in fleet}
    walk = HashRing(["a", "b", "c"]).walk(SYSTEM[:128])
    home, second, third = (names[n] for n in walk)
    assert policy.choose(fleet, key) is home
    # bound = ceil(1.25 * (total + 1) / 3); with home at 2 and the others idle: ceil(1.25) = 2.
    load(home, 2)
    assert policy.choose(fleet, key) is second
    load(second, 2)
    # total 4: bound = ceil(6.25 / 3) = 3; home (2) fits again.
    assert policy.choose(fleet, key) is home
    load(home, 1)
    # total 5: bound = ceil(7.5 / 3) = 3; home is at 3 and second at 2.
    assert policy.choose(fleet, key) is second
    load(second, 1)
    # total 6: bound = ceil(8.75 / 3) = 3; home and second full at 3: third.
    assert policy.choose(fleet, key) is third


def test_removing_a_replica_moves_only_its_keys() -> None:
    ring = BoundedRing(load_factor=100.0)
    a, b, c = backends("a", "b", "c")
    keys = [f"prefix {i}" for i in range(200)]
    before = {k: ring.choose([a, b, c], k).name for k in keys}  # type: ignore[union-attr]
    after = {k: ring.choose([a, c], k).name for k in keys}  # type: ignore[union-attr]
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "b" for k in moved)
    assert all(after[k] == before[k] for k in keys if before[k] != "b")


def test_routing_key_is_the_leading_characters() -> None:
    policy = PrefixAware(prefix_chars=5)
    assert policy.routing_key(RouteKey("abcdefgh")) == "abcde"
