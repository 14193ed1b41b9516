"""Token-bucket rate limits per tenant, on requests/min and tokens/min.

A bucket holds at most one minute's allowance and refills continuously at rate/60 per
second. A request takes 1 from its requests bucket and its estimated tokens (prompt +
max_tokens) from its tokens bucket, or is answered 429 with the seconds until it would fit.
When the request ends, the difference between its real usage and the estimate is charged
(refunded when negative) without a check, so the balance may go below zero and later
requests wait. A request larger than a whole bucket is let through when the bucket is full
rather than never.

`InMemoryRateLimiter` serves one gateway; `RedisRateLimiter` (redis_rate_limit.py) does the
same arithmetic in one Lua script so several gateways share the buckets.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol


class RateLimiter(Protocol):
    async def take(self, key: str, amount: float, per_min: float) -> float:
        """Take `amount` or take nothing; 0.0 if taken, else seconds until it would fit."""
        ...

    async def charge(self, key: str, amount: float, per_min: float) -> None:
        """Take (or give back, if negative) `amount` unconditionally."""
        ...


def refill(tokens: float, elapsed_s: float, per_min: float) -> float:
    return min(per_min, tokens + elapsed_s * per_min / 60.0)


class InMemoryRateLimiter:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # key -> (tokens, last update)
        self._buckets: dict[str, tuple[float, float]] = {}

    def _level(self, key: str, per_min: float) -> tuple[float, float]:
        now = self._clock()
        tokens, last = self._buckets.get(key, (per_min, now))
        return refill(tokens, now - last, per_min), now

    async def take(self, key: str, amount: float, per_min: float) -> float:
        tokens, now = self._level(key, per_min)
        need = min(amount, per_min)
        if tokens >= need:
            self._buckets[key] = (tokens - amount, now)
            return 0.0
        self._buckets[key] = (tokens, now)
        return (need - tokens) * 60.0 / per_min

    async def charge(self, key: str, amount: float, per_min: float) -> None:
        tokens, now = self._level(key, per_min)
        self._buckets[key] = (tokens - amount, now)
