"""Exact-match response cache for deterministic requests.

Only requests whose answer is a function of the request are cached: temperature 0 or a
fixed seed, not streamed. The key is sha256 over tenant, model and the request body
normalized (keys sorted, the fields that do not change the answer dropped), so tenants
never see each other's entries. Entries live `ttl_s` and are at most `max_entry_bytes`.

`InMemoryCache` keeps at most `max_entries` in LRU order; `RedisCache` (redis_cache.py)
lets several gateways share one cache.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol

# Fields that do not change the answer.
_IGNORED_FIELDS = frozenset({"stream", "stream_options", "user", "metadata", "store", "priority", "cache_salt"})


class ResponseCache(Protocol):
    async def get(self, key: str) -> bytes | None: ...

    async def put(self, key: str, body: bytes) -> None: ...


def is_deterministic(payload: dict[str, Any]) -> bool:
    if payload.get("stream"):
        return False
    return payload.get("temperature") == 0 or payload.get("seed") is not None


def cache_key(tenant: str, model: str, path: str, payload: dict[str, Any]) -> str:
    normalized = {k: v for k, v in payload.items() if k not in _IGNORED_FIELDS}
    normalized["model"] = model
    text = json.dumps([tenant, path, normalized], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


class InMemoryCache:
    def __init__(
        self, ttl_s: float, max_entries: int, max_entry_bytes: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if ttl_s <= 0 or max_entries < 1 or max_entry_bytes < 1:
            raise ValueError("ttl_s, max_entries and max_entry_bytes must be positive")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.max_entry_bytes = max_entry_bytes
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, key: str) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        expires, body = entry
        if self._clock() >= expires:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return body

    async def put(self, key: str, body: bytes) -> None:
        if len(body) > self.max_entry_bytes:
            return
        self._entries[key] = (self._clock() + self.ttl_s, body)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
