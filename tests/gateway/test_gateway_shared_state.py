"""Two gateway processes on one Redis agree on rate limits and share the response cache."""

from __future__ import annotations

import uuid
from pathlib import Path

from gateway_harness import GatewayProc, Stub
from test_gateway_service import CHAT, body, config, pool

from tokenmill.gateway.tenants.tenants import hash_key


def test_rate_limits_and_cache_are_shared_through_redis(tmp_path: Path, redis_url: str) -> None:
    stub = Stub(tmp_path, "a")
    tenant = f"t-{uuid.uuid4().hex[:8]}"  # fresh buckets and cache keys in the session's Redis
    tenants = [{"name": tenant, "api_key_sha256": [hash_key("k")], "requests_per_min": 4}]
    fleet = config([pool("p", stub)], tenants=tenants, redis_url=redis_url)
    one = GatewayProc(tmp_path, fleet, name="one")
    two = GatewayProc(tmp_path, fleet, name="two")
    try:
        with one.client("k") as c1, two.client("k") as c2:
            first = c1.post(CHAT, json=body("shared?", temperature=0))
            second = c2.post(CHAT, json=body("shared?", temperature=0))
            assert (first.headers["x-tokenmill-cache"], second.headers["x-tokenmill-cache"]) == ("miss", "hit")
            assert second.json() == first.json()
            assert len(stub.requests()) == 1
            assert [c1.post(CHAT, json=body()).status_code, c2.post(CHAT, json=body()).status_code] == [200, 200]
            over = [c1.post(CHAT, json=body()), c2.post(CHAT, json=body())]
        assert [r.status_code for r in over] == [429, 429]
        assert {r.json()["error"]["code"] for r in over} == {"rate_limit_requests"}
        assert all(1 <= int(r.headers["Retry-After"]) <= 15 for r in over)  # 4/min: one every 15 s
        assert len(stub.requests()) == 3
    finally:
        one.stop()
        two.stop()
        stub.kill()
