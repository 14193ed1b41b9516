from __future__ import annotations

import asyncio

import pytest

from tokenmill.gateway.tenants.rate_limit import InMemoryRateLimiter
from tokenmill.gateway.tenants.redis_rate_limit import RedisRateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_bucket_empties_refills_and_reports_the_wait() -> None:
    clock = Clock()
    limiter = InMemoryRateLimiter(clock)

    async def scenario() -> None:
        assert [await limiter.take("t", 1, 60) for _ in range(60)] == [0.0] * 60
        assert await limiter.take("t", 1, 60) == pytest.approx(1.0)  # 1 token/s
        clock.now += 0.5
        assert await limiter.take("t", 1, 60) == pytest.approx(0.5)
        clock.now += 0.5
        assert await limiter.take("t", 1, 60) == 0.0
        # A request larger than the bucket passes when the bucket is full.
        clock.now += 120
        assert await limiter.take("t", 500, 60) == 0.0
        assert await limiter.take("t", 1, 60) == pytest.approx(441.0)  # balance is -440

    asyncio.run(scenario())


def test_charge_refunds_and_overdraws() -> None:
    clock = Clock()
    limiter = InMemoryRateLimiter(clock)

    async def scenario() -> None:
        assert await limiter.take("t", 600, 600) == 0.0
        await limiter.charge("t", -100, 600)  # used 100 fewer than estimated
        assert await limiter.take("t", 100, 600) == 0.0
        assert await limiter.take("t", 1, 600) == pytest.approx(0.1)

    asyncio.run(scenario())


def test_redis_buckets_are_shared_between_limiters(redis_url: str) -> None:
    import redis.asyncio

    async def scenario() -> tuple[float, float, float]:
        first, second = redis.asyncio.Redis.from_url(redis_url), redis.asyncio.Redis.from_url(redis_url)
        try:
            one, two = RedisRateLimiter(first), RedisRateLimiter(second)
            assert await one.take("shared-test", 3, 6) == 0.0
            assert await two.take("shared-test", 3, 6) == 0.0
            wait = await one.take("shared-test", 1, 6)  # 0.1 token/s: ~10 s for one
            await two.charge("shared-test", -2, 6)
            after_refund = await one.take("shared-test", 1, 6)
            again = await two.take("shared-test", 2, 6)
            return wait, after_refund, again
        finally:
            await first.aclose()
            await second.aclose()

    wait, after_refund, again = asyncio.run(scenario())
    assert 9.5 < wait <= 10.0
    assert after_refund == 0.0
    assert 9.0 < again <= 10.0  # refund left 2, one was taken: 1 there, 2 asked
