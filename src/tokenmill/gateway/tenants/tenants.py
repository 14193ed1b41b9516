"""Tenants, found by the sha256 of their API key (keys are never stored).

`Authorization: Bearer KEY` is hashed and looked up; a request without a key gets the
anonymous tenant if one is configured, else 401. Each tenant has a prefix-cache salt that
the gateway injects into every request to tokenmill backends, so two tenants never share
prefix-cache entries, and usage counters (prompt and completion tokens).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tokenmill.gateway.config import TenantConfig
from tokenmill.gateway.errors import GatewayError


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass
class Tenant:
    config: TenantConfig
    cache_salt: str
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_requests: int = 0

    @property
    def name(self) -> str:
        return self.config.name


class TenantRegistry:
    def __init__(self, tenants: Sequence[TenantConfig], anonymous: str | None) -> None:
        self.by_name: dict[str, Tenant] = {}
        self._by_digest: dict[str, Tenant] = {}
        for config in tenants:
            salt = config.cache_salt or "tenant-" + hashlib.sha256(config.name.encode()).hexdigest()[:16]
            tenant = Tenant(config, salt)
            self.by_name[config.name] = tenant
            for digest in config.api_key_sha256:
                if digest in self._by_digest:
                    raise ValueError(f"an API key hash is listed for two tenants ({self._by_digest[digest].name}, {config.name})")
                self._by_digest[digest] = tenant
        self._anonymous = self.by_name[anonymous] if anonymous is not None else None

    def authenticate(self, headers: Mapping[str, str]) -> Tenant:
        auth = headers.get("authorization", "")
        scheme, _, key = auth.partition(" ")
        if not key or scheme.lower() != "bearer":
            if self._anonymous is not None:
                return self._anonymous
            raise GatewayError(401, "missing API key: send 'Authorization: Bearer KEY'", code="invalid_api_key")
        digest = hash_key(key.strip())
        tenant = self._by_digest.get(digest)
        if tenant is None or not hmac.compare_digest(digest, hash_key(key.strip())):
            raise GatewayError(401, "invalid API key", code="invalid_api_key")
        return tenant
