from __future__ import annotations

import pytest

from tokenmill.gateway.backends.health import read_load
from tokenmill.gateway.backends.pool import Pool
from tokenmill.gateway.config import BackendConfig, HealthConfig, PoolConfig


def make_pool() -> Pool:
    config = PoolConfig(name="p", model="m", region="eu", backends=[
        BackendConfig(url="http://a:1", name="a", max_inflight=2),
        BackendConfig(url="http://b:1", max_inflight=4),
    ])
    return Pool(config, HealthConfig(failure_threshold=1, open_s=5.0))


def test_backends_from_config_and_admin_changes() -> None:
    pool = make_pool()
    assert [(b.name, b.region, b.pool, b.max_inflight) for b in pool.backends] == [
        ("a", "eu", "p", 2), ("http://b:1", "eu", "p", 4)]
    added = pool.add(BackendConfig(url="http://c:1", name="c"))
    assert [b.name for b in pool.backends] == ["a", "http://b:1", "c"]
    with pytest.raises(ValueError, match="already has a backend 'c'"):
        pool.add(BackendConfig(url="http://c:2", name="c"))
    removed = pool.remove("http://b:1")
    assert not removed.active and [b.name for b in pool.backends] == ["a", "c"]
    assert added.active
    with pytest.raises(KeyError):
        pool.remove("zzz")


def test_routable_and_capacity_follow_the_breakers() -> None:
    pool = make_pool()
    a, b = pool.backends
    a.dispatch("interactive", 10, 0.0)
    assert pool.capacity(0.0) == (1, 6)
    b.breaker.record_failure(0.0)
    assert pool.routable(1.0) == [a]
    assert pool.capacity(1.0) == (1, 2)


def test_class_share_limits_room() -> None:
    pool = make_pool()
    b = pool.backends[1]  # max_inflight 4
    b.dispatch("batch", 1, 0.0)
    b.dispatch("batch", 1, 0.0)
    assert not b.has_room("batch", 0.5)
    assert b.has_room("interactive", 1.0)
    b.dispatch("interactive", 1, 0.0)
    b.dispatch("interactive", 1, 0.0)
    assert not b.has_room("interactive", 1.0)
    b.release("batch", 1)
    assert b.num_inflight == 3 and b.inflight_by_class["batch"] == 1 and b.num_inflight_tokens == 3


def test_read_load_sums_running_and_waiting() -> None:
    text = (
        "# HELP tokenmill:num_requests_running Requests in model execution batches.\n"
        'tokenmill:num_requests_running{model_name="m"} 3.0\n'
        'tokenmill:num_requests_waiting{model_name="m"} 7.0\n'
        'tokenmill:prompt_tokens_total{model_name="m"} 100.0\n'
    )
    assert read_load(text) == (3.0, 7.0)
