"""Planning and slot choice without a network: residency, cost-aware pools, price table,
spill-over, degradation, fallback."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from tokenmill.gateway.admission.admission import Admission
from tokenmill.gateway.admission.priorities import Priorities
from tokenmill.gateway.backends.pool import Pool, all_backends
from tokenmill.gateway.config import GatewayConfig, parse_config
from tokenmill.gateway.errors import GatewayError
from tokenmill.gateway.metrics import GatewayMetrics
from tokenmill.gateway.router import Router
from tokenmill.gateway.tenants.tenants import TenantRegistry

NOON = 1_700_000_000 - 1_700_000_000 % 86400 + 12 * 3600  # a UTC noon


def fleet(**overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "gateway": {"region": "eu-west"},
        "regions": {
            "eu-west": {"residency": "eu", "neighbors": ["eu-north"], "price": 1.0},
            "eu-north": {"residency": "eu", "price": 0.5, "hours": {"0-6": 2.0}},
            "us-east": {"residency": "us", "price": 0.1},
        },
        "models": [{"name": "big", "fallback": "lite"}, {"name": "lite"}],
        "pools": [
            {"name": "eu-fast", "model": "big", "region": "eu-west", "max_cost_tokens": 300,
             "backends": [{"url": "http://f1:1", "name": "f1", "max_inflight": 2}]},
            {"name": "eu-deep", "model": "big", "region": "eu-west",
             "backends": [{"url": "http://d1:1", "name": "d1", "max_inflight": 2}]},
            {"name": "north", "model": "big", "region": "eu-north",
             "backends": [{"url": "http://n1:1", "name": "n1", "max_inflight": 2}]},
            {"name": "us", "model": "big", "region": "us-east",
             "backends": [{"url": "http://u1:1", "name": "u1", "max_inflight": 2}]},
            {"name": "lite-us", "model": "lite", "region": "us-east",
             "backends": [{"url": "http://l1:1", "name": "l1", "max_inflight": 2}]},
        ],
        "tenants": [
            {"name": "eu-co", "residency": ["eu"], "allow_downgrade": True},
            {"name": "anyone", "allow_downgrade": True},
            {"name": "nightly", "priority": "batch"},
        ],
    }
    config.update(overrides)
    return config


def build(config: GatewayConfig) -> tuple[Router, TenantRegistry, list[Pool]]:
    pools = [Pool(p, config.health) for p in config.pools]
    admission = Admission(Priorities(config.priorities))
    metrics = GatewayMetrics(lambda: admission.num_waiting, lambda: all_backends(pools))
    return Router(config, pools, admission, metrics, wall_clock=lambda: NOON), TenantRegistry(config.tenants, None), pools


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "big", "messages": [{"role": "user", "content": text}], **extra}


def test_cost_aware_then_nearest_region_order() -> None:
    router, tenants, _ = build(parse_config(fleet()))
    short = router.plan(tenants.by_name["anyone"], "/v1/chat/completions", chat("hi", max_tokens=10), {})
    assert [p.name for p in short.pools] == ["eu-fast", "eu-deep", "north", "us"]
    assert short.num_tokens == len("user\nhi\n") // 4 + 10
    long = router.plan(tenants.by_name["anyone"], "/v1/chat/completions", chat("x" * 2000), {})
    assert [p.name for p in long.pools] == ["eu-deep", "north", "us"]
    from_us = router.plan(tenants.by_name["anyone"], "/v1/chat/completions", chat("hi"), {"x-tokenmill-client-region": "us-east"})
    assert [p.name for p in from_us.pools] == ["us", "eu-fast", "eu-deep", "north"]


def test_residency_never_includes_other_zones() -> None:
    router, tenants, _ = build(parse_config(fleet()))
    plan = router.plan(tenants.by_name["eu-co"], "/v1/chat/completions", chat("hi"), {"x-tokenmill-client-region": "us-east"})
    assert plan.regions == ["eu-west", "eu-north"]
    assert {p.region for p in plan.pools} == {"eu-west", "eu-north"}


def test_batch_goes_cheapest_first_by_the_hour() -> None:
    router, tenants, _ = build(parse_config(fleet()))
    plan = router.plan(tenants.by_name["nightly"], "/v1/chat/completions", chat("hi"), {})
    assert plan.cls == "batch"
    assert plan.regions == ["us-east", "eu-north", "eu-west"]  # 0.1, 0.5, 1.0 at noon
    router._wall_clock = lambda: NOON - 9 * 3600  # 03:00: eu-north costs 2.0
    plan = router.plan(tenants.by_name["nightly"], "/v1/chat/completions", chat("hi"), {})
    assert plan.regions == ["us-east", "eu-west", "eu-north"]


def test_slots_spill_over_to_the_next_pool_then_the_body_carries_salt_and_priority() -> None:
    router, tenants, pools = build(parse_config(fleet()))
    tenant = tenants.by_name["eu-co"]

    async def scenario() -> list[str]:
        names = []
        for _ in range(6):
            plan = router.plan(tenant, "/v1/chat/completions", chat("hi", max_tokens=10), {})
            names.append((await router.acquire(plan)).name)
        return names

    assert asyncio.run(scenario()) == ["f1", "f1", "d1", "d1", "n1", "n1"]
    plan = router.plan(tenant, "/v1/chat/completions", chat("hi", priority=-5, cache_salt="mine"), {})
    body = json.loads(plan.body_for(pools[0].backends[0], 0))
    assert body["priority"] == 0 and body["cache_salt"] == f"{tenant.cache_salt}:mine"
    # The routing key is scoped the same way, so prefix-aware routing groups what may share cache.
    assert plan.key.cache_scope == f"{tenant.cache_salt}:mine"
    assert router.plan(tenant, "/v1/chat/completions", chat("hi"), {}).key.cache_scope == tenant.cache_salt


def test_all_allowed_down_is_503_or_a_downgrade_never_another_zone() -> None:
    config = parse_config(fleet(models=[{"name": "big", "fallback": "lite"}, {"name": "lite"}]))
    router, tenants, pools = build(config)
    for pool in pools:
        if pool.region != "us-east":
            for b in pool.backends:
                for _ in range(3):
                    b.breaker.record_failure(time.monotonic())

    async def acquire(tenant: str) -> tuple[str, str | None]:
        plan = router.plan(tenants.by_name[tenant], "/v1/chat/completions", chat("hi"), {})
        backend = await router.acquire(plan)
        return backend.name, plan.downgraded_from

    with pytest.raises(GatewayError) as down:
        asyncio.run(acquire("eu-co"))
    assert down.value.status == 503
    assert down.value.message == "no replica of 'lite' is available in the allowed regions (eu-west, eu-north)"
    assert asyncio.run(acquire("anyone")) == ("u1", None)
    for b in pools[3].backends:
        for _ in range(3):
            b.breaker.record_failure(time.monotonic())
    assert asyncio.run(acquire("anyone")) == ("l1", "big")


def test_degradation_caps_and_sheds_by_load() -> None:
    steps = [{"at_load": 0.5, "action": "cap_max_tokens", "classes": ["batch"], "max_tokens": 16},
             {"at_load": 1.0, "action": "shed", "classes": ["batch"]}]
    router, tenants, pools = build(parse_config(fleet(degradation=steps)))
    nightly = tenants.by_name["nightly"]
    calm = router.plan(nightly, "/v1/chat/completions", chat("hi", max_tokens=100), {})
    assert calm.degraded == () and calm.payload["max_tokens"] == 100
    for pool in pools[:4]:
        pool.backends[0].dispatch("interactive", 1, 0.0)
    busy = router.plan(nightly, "/v1/chat/completions", chat("hi", max_tokens=100), {})
    assert busy.degraded == ("cap_max_tokens",) and busy.payload["max_tokens"] == 16
    for pool in pools[:4]:
        pool.backends[0].dispatch("interactive", 1, 0.0)
    with pytest.raises(GatewayError) as shed:
        router.plan(nightly, "/v1/chat/completions", chat("hi"), {})
    assert (shed.value.status, shed.value.code, shed.value.headers) == (429, "shed_degraded", {"Retry-After": "5"})


def test_unknown_model_and_too_large_requests() -> None:
    router, tenants, _ = build(parse_config(fleet(pools=[
        {"name": "small-only", "model": "big", "region": "eu-west", "max_cost_tokens": 100, "backends": []}])))
    with pytest.raises(GatewayError) as unknown:
        router.plan(tenants.by_name["anyone"], "/v1/chat/completions", {"model": "gpt-9", "messages": []}, {})
    assert unknown.value.status == 404 and unknown.value.code == "model_not_found"
    with pytest.raises(GatewayError) as large:
        router.plan(tenants.by_name["anyone"], "/v1/chat/completions", chat("hi", max_tokens=500), {})
    assert large.value.status == 400 and large.value.code == "request_too_large"


def test_tier_alias_classifies_and_smaller_tier_degrades() -> None:
    tiers = {"models": {"small": "lite", "large": "big"}, "default": "small",
             "rules": [{"tier": "large", "keywords": ["prove"]}]}
    steps = [{"at_load": 0.5, "action": "smaller_tier", "classes": ["interactive"]}]
    router, tenants, pools = build(parse_config(fleet(tiers=tiers, degradation=steps)))
    anyone = tenants.by_name["anyone"]
    plan = router.plan(anyone, "/v1/chat/completions", {**chat("please prove it"), "model": "auto"}, {})
    assert (plan.tier, plan.model.name) == ("large", "big")
    assert router.model_names() == ["big", "lite", "auto"]
    for pool in pools[:4]:
        pool.backends[0].dispatch("interactive", 1, 0.0)
    plan = router.plan(anyone, "/v1/chat/completions", {**chat("please prove it"), "model": "auto"}, {})
    assert (plan.tier, plan.model.name, plan.degraded) == ("small", "lite", ("smaller_tier",))
