"""A real `tokenmill gateway` process in front of real stub backend processes.

Failover (retry before the first byte, broken streams), shedding under saturation,
residency with a dead region, the admin API, the cascade, the cache and metrics.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from gateway_harness import GatewayProc, Stub, free_port, metric_value

from tokenmill.gateway.tenants.tenants import hash_key

CHAT = "/v1/chat/completions"
ADMIN_KEY = "admin-secret"


def body(text: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], **extra}


def config(pools: list[dict[str, Any]], **overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "gateway": {"region": "eu-west", "admin_api_key_sha256": hash_key(ADMIN_KEY)},
        "regions": {"eu-west": {"residency": "eu"}, "us-east": {"residency": "us"}},
        "models": [{"name": "m", "upstream_model": "stub-model"}],
        "pools": pools,
        "tenants": [
            {"name": "eu-co", "api_key_sha256": [hash_key("k-eu")], "residency": ["eu"]},
            {"name": "anyone", "api_key_sha256": [hash_key("k-any")]},
        ],
        "health": {"interval_s": 0.2, "timeout_s": 0.5, "failure_threshold": 2, "open_s": 30},
    }
    base.update(overrides)
    return base


def pool(name: str, *stubs: Stub | str, region: str = "eu-west", policy: str = "round_robin", **extra: Any) -> dict[str, Any]:
    backends = [{"url": s if isinstance(s, str) else s.url, "name": s if isinstance(s, str) else s.name} for s in stubs]
    return {"name": name, "model": "m", "region": region, "policy": policy, "backends": backends, **extra}


@pytest.fixture
def tmp(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
def stubs(tmp_path: Path) -> Iterator[list[Stub]]:
    started = [Stub(tmp_path, name) for name in ("a", "b")]
    yield started
    for stub in started:
        stub.kill()


def test_proxies_with_rewritten_model_salt_priority_and_usage(tmp: Path, stubs: list[Stub]) -> None:
    a, _ = stubs
    gw = GatewayProc(tmp, config([pool("p", a)]))
    try:
        with gw.client("k-any") as client:
            r = client.post(CHAT, json=body(priority=-100, max_tokens=5))
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == "hello from a"
            assert (r.headers["x-tokenmill-backend"], r.headers["x-tokenmill-pool"], r.headers["x-tokenmill-region"],
                    r.headers["x-tokenmill-retries"]) == ("a", "p", "eu-west", "0")
            sent = a.requests()[-1]
            assert sent["model"] == "stub-model" and sent["priority"] == 0 and sent["max_tokens"] == 5
            assert sent["cache_salt"].startswith("tenant-")
            assert client.get("/v1/models").json()["data"] == [{"id": "m", "object": "model", "owned_by": "tokenmill"}]
            unknown = client.post(CHAT, json={**body(), "model": "nope"})
            assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
            bad = client.post(CHAT, content=b"{not json")
            assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
        assert httpx.post(gw.url + CHAT, json=body()).status_code == 401
        metrics = httpx.get(gw.url + "/metrics").text
        assert metric_value(metrics, "tokenmill:gateway_requests_total", tenant="anyone", backend="a", outcome="ok") == 1
        assert metric_value(metrics, "tokenmill:gateway_tenant_tokens_total", tenant="anyone", kind="prompt") == 5
        assert metric_value(metrics, "tokenmill:gateway_overhead_seconds_count") == 1
        assert httpx.get(gw.url + "/ready").json() == {"status": "ready", "routable": 1}
    finally:
        assert gw.stop() == 0


def test_failures_before_the_first_byte_are_retried_on_another_replica(tmp: Path, stubs: list[Stub]) -> None:
    a, b = stubs
    dead = f"http://127.0.0.1:{free_port()}"
    a.configure(status=500)
    # Two of three replicas fail (a 500, one refuses connections): two retries may be needed.
    gw = GatewayProc(tmp, config(
        [pool("p", a, b, dead, policy="round_robin")],
        gateway={"retries_before_first_byte": 2},
        health={"interval_s": 30, "timeout_s": 0.5, "failure_threshold": 100, "open_s": 30},
    ))
    try:
        with gw.client("k-any") as client:
            replies = [client.post(CHAT, json=body()) for _ in range(6)]
            streams = [client.post(CHAT, json=body(stream=True)) for _ in range(3)]
        assert [r.status_code for r in replies + streams] == [200] * 9
        assert {r.headers["x-tokenmill-backend"] for r in replies} == {"b"}
        assert {r.headers["x-tokenmill-retries"] for r in replies} <= {"0", "1", "2"}
        assert {r.headers["x-tokenmill-retries"] for r in replies} != {"0"}
        assert all(s.text.endswith("data: [DONE]\n\n") and '"b-2 "' in s.text for s in streams)
        metrics = httpx.get(gw.url + "/metrics").text
        retries = metric_value(metrics, "tokenmill:gateway_retries_total")
        stream_retries = sum(int(s.headers["x-tokenmill-retries"]) for s in streams)
        assert retries == sum(int(r.headers["x-tokenmill-retries"]) for r in replies) + stream_retries
        assert stream_retries >= 1
        assert metric_value(metrics, "tokenmill:gateway_failovers_total", backend="a") >= 1
        assert metric_value(metrics, "tokenmill:gateway_failovers_total", backend=dead) >= 1
    finally:
        gw.stop()


def test_a_single_retry_then_a_clear_502(tmp: Path, stubs: list[Stub]) -> None:
    a, b = stubs
    a.configure(status=500)
    b.configure(status=502)
    gw = GatewayProc(tmp, config([pool("p", a, b)]))
    try:
        r = httpx.post(gw.url + CHAT, json=body(), headers={"Authorization": "Bearer k-any"})
        assert r.status_code == 502
        assert len(a.requests()) + len(b.requests()) == 2
    finally:
        gw.stop()


def test_a_stream_broken_mid_way_ends_with_an_error_event(tmp: Path, stubs: list[Stub]) -> None:
    a, _ = stubs
    a.configure(break_after_chunks=2, stream_chunks=5)
    gw = GatewayProc(tmp, config([pool("p", a)], health={"interval_s": 30, "failure_threshold": 5, "open_s": 30}))
    try:
        r = httpx.post(gw.url + CHAT, json=body(stream=True), headers={"Authorization": "Bearer k-any"})
        assert r.status_code == 200
        frames = [f[len("data: "):] for f in r.text.split("\n\n") if f]
        assert [json.loads(f)["choices"][0]["delta"]["content"] for f in frames[:2]] == ["a-0 ", "a-1 "]
        error = json.loads(frames[2])["error"]
        assert error["code"] == "upstream_stream_broken" and "broke mid-way" in error["message"]
        assert frames[3:] == ["[DONE]"]
        assert len(a.requests()) == 1  # never replayed: no duplicated tokens
        assert metric_value(httpx.get(gw.url + "/metrics").text, "tokenmill:gateway_stream_errors_total") == 1
    finally:
        gw.stop()


def test_batch_is_shed_before_interactive_under_saturation(tmp: Path) -> None:
    slow = Stub(tmp, "slow", delay_s=1.0)
    classes = {
        "interactive": {"engine_priority": 0, "inflight_share": 1.0, "max_queue": 8, "queue_timeout_s": 10},
        "batch": {"engine_priority": 10, "inflight_share": 0.5, "max_queue": 1, "queue_timeout_s": 0.5, "retry_after_s": 3},
    }
    pools = [{**pool("p", slow), "backends": [{"url": slow.url, "name": "slow", "max_inflight": 2}]}]
    # Interactive requests arriving at half load get max_tokens capped (and are told so).
    steps = [{"at_load": 0.5, "action": "cap_max_tokens", "classes": ["interactive"], "max_tokens": 7}]
    gw = GatewayProc(tmp, config(pools, priorities={"classes": classes}, degradation=steps))

    async def load() -> tuple[list[httpx.Response], list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=gw.url, timeout=30, headers={"Authorization": "Bearer k-any"}) as client:
            def send(cls: str) -> Any:
                return asyncio.create_task(client.post(CHAT, json=body(), headers={"x-tokenmill-priority": cls}))

            batch = [send("batch") for _ in range(6)]
            await asyncio.sleep(0.2)
            interactive = [send("interactive") for _ in range(4)]
            return list(await asyncio.gather(*batch)), list(await asyncio.gather(*interactive))

    try:
        batch, interactive = asyncio.run(load())
        assert [r.status_code for r in interactive] == [200] * 4
        assert sorted(r.status_code for r in batch) == [200] + [429] * 5
        shed = [r for r in batch if r.status_code == 429]
        assert {r.headers["Retry-After"] for r in shed} == {"3"}
        assert sorted(r.json()["error"]["code"] for r in shed) == ["shed_queue_full"] * 4 + ["shed_queue_timeout"]
        engine_priorities = sorted(req["priority"] for req in slow.requests())
        assert engine_priorities == [0, 0, 0, 0, 10]
        assert {r.headers["x-tokenmill-degraded"] for r in interactive} == {"cap_max_tokens"}
        assert [req["max_tokens"] for req in slow.requests() if req["priority"] == 0] == [7] * 4
        assert [req.get("max_tokens") for req in slow.requests() if req["priority"] == 10] == [None]
        metrics = httpx.get(gw.url + "/metrics").text
        assert metric_value(metrics, "tokenmill:gateway_sheds_total", **{"class": "batch"}) == 5
        assert metric_value(metrics, "tokenmill:gateway_sheds_total", **{"class": "interactive"}) == 0
        assert metric_value(metrics, "tokenmill:gateway_degradations_total", action="cap_max_tokens") == 4
        assert metric_value(metrics, "tokenmill:gateway_requests_total", outcome="error_429") == 5
    finally:
        gw.stop()
        slow.kill()


def test_eu_tenant_is_never_served_outside_the_eu(tmp: Path, stubs: list[Stub]) -> None:
    eu, us = stubs
    gw = GatewayProc(tmp, config([pool("eu", eu), pool("us", us, region="us-east")]))
    try:
        with gw.client("k-eu") as client:
            assert client.post(CHAT, json=body()).headers["x-tokenmill-region"] == "eu-west"
            asked_us = client.post(CHAT, json=body(), headers={"x-tokenmill-residency": "us"})
            assert asked_us.status_code == 403
            eu.kill()
            replies = [client.post(CHAT, json=body(stream=stream)) for stream in (False, True, False)]
        assert [r.status_code for r in replies] == [503] * 3
        assert replies[0].json()["error"]["code"] in ("no_replica_available", "upstream_failed")
        assert replies[-1].json()["error"] == {
            "message": "no replica of 'm' is available in the allowed regions (eu-west)",
            "type": "server_error", "param": None, "code": "no_replica_available"}
        assert us.requests() == []
        with gw.client("k-any") as client:  # other tenants still get served, from the US
            assert client.post(CHAT, json=body()).headers["x-tokenmill-region"] == "us-east"
    finally:
        gw.stop()


def test_admin_api_adds_and_removes_backends(tmp: Path, stubs: list[Stub]) -> None:
    a, b = stubs
    gw = GatewayProc(tmp, config([pool("p", a)]))
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    try:
        assert httpx.get(gw.url + "/admin/backends").status_code == 401
        added = httpx.post(gw.url + "/admin/backends", json={"pool": "p", "url": b.url, "name": "b"}, headers=admin)
        assert added.status_code == 201 and added.json()["routable"] is True
        bad = httpx.post(gw.url + "/admin/backends", json={"pool": "p", "url": "nope"}, headers=admin)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "url"
        assert httpx.post(gw.url + "/admin/backends", json={"pool": "zz", "url": b.url}, headers=admin).status_code == 404
        with gw.client("k-any") as client:
            assert {client.post(CHAT, json=body()).headers["x-tokenmill-backend"] for _ in range(4)} == {"a", "b"}
            removed = httpx.delete(gw.url + "/admin/backends", params={"pool": "p", "name": "a"}, headers=admin)
            assert removed.status_code == 200
            assert {client.post(CHAT, json=body()).headers["x-tokenmill-backend"] for _ in range(4)} == {"b"}
        listed = httpx.get(gw.url + "/admin/backends", headers=admin).json()["backends"]
        assert [(x["name"], x["pool"], x["state"]) for x in listed] == [("b", "p", "closed")]
    finally:
        gw.stop()


def test_cascade_escalates_unsure_answers_and_cache_serves_repeats(tmp: Path, stubs: list[Stub]) -> None:
    small, large = stubs
    small.configure(logprob=-3.0)
    tiers = {"models": {"small": "m", "large": "m-large"}, "default": "small",
             "cascade": {"enabled": True, "min_mean_logprob": -1.0}}
    pools = [pool("small", small), {**pool("large", large), "model": "m-large"}]
    models = [{"name": "m"}, {"name": "m-large"}]
    gw = GatewayProc(tmp, config(pools, tiers=tiers, models=models))
    try:
        with gw.client("k-any") as client:
            unsure = client.post(CHAT, json={**body("q1"), "model": "auto"})
            assert unsure.json()["choices"][0]["message"]["content"] == "hello from b"
            assert (unsure.headers["x-tokenmill-tier"], unsure.headers["x-tokenmill-cascade"]) == (
                "large", "escalated:low_confidence")
            assert small.requests()[-1]["logprobs"] is True and "logprobs" not in large.requests()[-1]
            small.configure(logprob=-0.2)
            sure = client.post(CHAT, json={**body("q2"), "model": "auto"})
            assert (sure.headers["x-tokenmill-tier"], sure.headers["x-tokenmill-cascade"]) == ("small", "accepted")
            assert sure.json()["choices"][0]["logprobs"] is None
            first = client.post(CHAT, json=body("cached?", temperature=0))
            second = client.post(CHAT, json=body("cached?", temperature=0))
            assert (first.headers["x-tokenmill-cache"], second.headers["x-tokenmill-cache"]) == ("miss", "hit")
            assert first.json() == second.json()
            assert sum(1 for r in small.requests() if r["messages"][0]["content"] == "cached?") == 1
    finally:
        gw.stop()
