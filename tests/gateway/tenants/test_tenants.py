from __future__ import annotations

import pytest

from tokenmill.gateway.config import TenantConfig
from tokenmill.gateway.errors import GatewayError
from tokenmill.gateway.tenants.tenants import TenantRegistry, hash_key


def registry(anonymous: str | None = None) -> TenantRegistry:
    return TenantRegistry([
        TenantConfig(name="acme", api_key_sha256=[hash_key("k-acme-1"), hash_key("k-acme-2")]),
        TenantConfig(name="globex", api_key_sha256=[hash_key("k-globex")], cache_salt="g-salt"),
        TenantConfig(name="public"),
    ], anonymous)


def test_keys_map_to_tenants_by_hash() -> None:
    r = registry()
    assert r.authenticate({"authorization": "Bearer k-acme-2"}).name == "acme"
    assert r.authenticate({"authorization": "bearer k-globex"}).name == "globex"
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic k-acme-1"}):
        with pytest.raises(GatewayError) as denied:
            r.authenticate(headers)
        assert denied.value.status == 401
    assert registry("public").authenticate({}).name == "public"


def test_cache_salts_differ_per_tenant() -> None:
    r = registry()
    assert r.by_name["globex"].cache_salt == "g-salt"
    assert r.by_name["acme"].cache_salt.startswith("tenant-")
    assert r.by_name["acme"].cache_salt != r.by_name["public"].cache_salt


def test_one_key_for_two_tenants_is_refused() -> None:
    digest = hash_key("shared")
    with pytest.raises(ValueError, match="two tenants"):
        TenantRegistry([TenantConfig(name="a", api_key_sha256=[digest]), TenantConfig(name="b", api_key_sha256=[digest])], None)
