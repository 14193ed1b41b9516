from __future__ import annotations

import asyncio

from tokenmill.gateway.cache.redis_cache import RedisCache
from tokenmill.gateway.cache.response_cache import InMemoryCache, cache_key, is_deterministic


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_only_deterministic_unstreamed_requests_are_cacheable() -> None:
    assert is_deterministic({"temperature": 0})
    assert is_deterministic({"seed": 7, "temperature": 0.8})
    assert not is_deterministic({"temperature": 0.7})
    assert not is_deterministic({})
    assert not is_deterministic({"temperature": 0, "stream": True})


def test_key_normalizes_and_separates_tenants_and_models() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "user": "u1"}
    reordered = {"temperature": 0, "user": "u2", "messages": [{"content": "hi", "role": "user"}], "model": "m"}
    key = cache_key("acme", "m", "/v1/chat/completions", body)
    assert key == cache_key("acme", "m", "/v1/chat/completions", reordered)
    assert key != cache_key("globex", "m", "/v1/chat/completions", body)
    assert key != cache_key("acme", "other", "/v1/chat/completions", body)
    assert key != cache_key("acme", "m", "/v1/completions", body)
    assert key != cache_key("acme", "m", "/v1/chat/completions", {**body, "max_tokens": 5})


def test_memory_cache_ttl_lru_and_size_bounds() -> None:
    clock = Clock()
    cache = InMemoryCache(ttl_s=10, max_entries=2, max_entry_bytes=8, clock=clock)

    async def scenario() -> None:
        await cache.put("a", b"A")
        await cache.put("b", b"B")
        assert await cache.get("a") == b"A"  # a is now the most recent
        await cache.put("c", b"C")
        assert await cache.get("b") is None and len(cache) == 2
        await cache.put("big", b"123456789")
        assert await cache.get("big") is None
        clock.now = 10.0
        assert await cache.get("a") is None and await cache.get("c") is None

    asyncio.run(scenario())


def test_redis_cache_is_shared_and_expires(redis_url: str) -> None:
    import redis.asyncio

    async def scenario() -> None:
        one_client, two_client = redis.asyncio.Redis.from_url(redis_url), redis.asyncio.Redis.from_url(redis_url)
        try:
            one = RedisCache(one_client, ttl_s=0.2, max_entry_bytes=8)
            two = RedisCache(two_client, ttl_s=0.2, max_entry_bytes=8)
            await one.put("k-shared", b"body")
            assert await two.get("k-shared") == b"body"
            await one.put("k-big", b"123456789")
            assert await two.get("k-big") is None
            await asyncio.sleep(0.3)
            assert await two.get("k-shared") is None
        finally:
            await one_client.aclose()
            await two_client.aclose()

    asyncio.run(scenario())
