from __future__ import annotations

from collections import Counter

import pytest
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
    # No slack: the factor alone decides (the paper's bound).
    policy = PrefixAware(prefix_chars=128, load_factor=1.25, load_slack=0)
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


def test_bound_is_the_slack_at_low_load_and_the_factor_at_high_load() -> None:
    ring = BoundedRing(load_factor=1.25, load_slack=2)
    # ceil(max(1.25 * (total + 1), total + 1 + 2 * 3) / 3) for 3 replicas:
    assert [ring.bound(total, 3) for total in (0, 1, 2, 3, 4, 8, 23, 24, 60)] == [3, 3, 3, 4, 4, 5, 10, 11, 26]
    # The factor alone: with 1 request in flight, 1 per replica.
    assert [BoundedRing(1.25).bound(total, 3) for total in (0, 1, 2, 3, 60)] == [1, 1, 2, 2, 26]
    assert [ring.bound(total, 1) for total in (0, 5)] == [3, 8]


def test_at_low_load_a_prefix_stays_on_its_replica_up_to_the_slack() -> None:
    fleet = backends("a", "b", "c")
    policy = PrefixAware(prefix_chars=128)  # load_factor 1.25, load_slack 2
    key = RouteKey(SYSTEM)
    names = {b.name: b for b in fleet}
    home, second, third = (names[n] for n in HashRing(["a", "b", "c"]).walk(SYSTEM[:128]))
    for _ in range(3):
        # total 0, 1, 2: bound 3, so home takes each.
        assert policy.choose(fleet, key) is home
        load(home, 1)
    # total 3: bound ceil(10 / 3) = 4; home at 3 takes a fourth.
    assert policy.choose(fleet, key) is home
    load(home, 1)
    # total 4: bound ceil(11 / 3) = 4; home is full, so the next replica on the key's walk,
    # every time, not whichever is idlest.
    assert [policy.choose(fleet, key) for _ in range(3)] == [second] * 3
    load(second, 3)
    # total 7: bound ceil(14 / 3) = 5; home (4) fits again.
    assert policy.choose(fleet, key) is home
    load(home, 3)
    load(second, 4)
    # total 14: bound ceil(max(18.75, 21) / 3) = 7; home and second full at 7: third.
    assert policy.choose(fleet, key) is third


def test_at_high_load_the_factor_bounds_a_hot_prefix() -> None:
    fleet = backends("a", "b", "c")
    policy = PrefixAware(prefix_chars=128)
    names = {b.name: b for b in fleet}
    home, second, third = (names[n] for n in HashRing(["a", "b", "c"]).walk(SYSTEM[:128]))
    load(home, 25)
    load(second, 20)
    load(third, 15)
    # total 60: bound ceil(max(76.25, 67) / 3) = 26; home at 25 takes one more.
    assert policy.choose(fleet, RouteKey(SYSTEM)) is home
    load(home, 1)
    # total 61: bound ceil(max(77.5, 68) / 3) = 26; home at 26 spills to second.
    assert policy.choose(fleet, RouteKey(SYSTEM)) is second


def test_negative_slack_is_refused() -> None:
    with pytest.raises(ValueError, match="load_slack must be >= 0, got -1"):
        BoundedRing(load_factor=1.25, load_slack=-1)


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


def test_routing_key_starts_with_the_cache_scope() -> None:
    policy = PrefixAware(prefix_chars=5)
    assert policy.routing_key(RouteKey("abcdefgh", cache_scope="tenant-1")) == "tenant-1\nabcde"
    # Two tenants' copies of one system prompt hash apart: 20 tenants land on all 3 replicas.
    fleet = backends("a", "b", "c")
    picks = {policy.choose(fleet, RouteKey(SYSTEM, cache_scope=f"tenant-{i}")).name for i in range(20)}  # type: ignore[union-attr]
    assert picks == {"a", "b", "c"}
