"""The response cache in Redis: SET with an expiry per entry, shared by several gateways.

Size is bounded per entry (`max_entry_bytes`) and in total by the expiry; bound Redis's own
memory with its `maxmemory` and an LRU policy.
"""

from __future__ import annotations

from typing import Any

KEY_PREFIX = "tokenmill:gateway:cache:"


class RedisCache:
    def __init__(self, client: Any, ttl_s: float, max_entry_bytes: int) -> None:
        """`client`: a redis.asyncio.Redis."""
        if ttl_s <= 0 or max_entry_bytes < 1:
            raise ValueError("ttl_s and max_entry_bytes must be positive")
        self._client = client
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.max_entry_bytes = max_entry_bytes

    async def get(self, key: str) -> bytes | None:
        value = await self._client.get(KEY_PREFIX + key)
        return bytes(value) if value is not None else None

    async def put(self, key: str, body: bytes) -> None:
        if len(body) > self.max_entry_bytes:
            return
        await self._client.set(KEY_PREFIX + key, body, px=self.ttl_ms)
