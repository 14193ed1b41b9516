"""The token buckets of rate_limit.py in Redis, shared by every gateway that points at it.

One Lua script per call does refill, check and take atomically, with Redis's own clock
(TIME), so gateways on different hosts agree without synchronized clocks. A bucket is a
hash {tokens, ts} that expires once it would be full again.
"""

from __future__ import annotations

from typing import Any

_SCRIPT = """
local per_min = tonumber(ARGV[1])
local amount = tonumber(ARGV[2])
local force = ARGV[3] == '1'
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local v = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(v[1]) or per_min
local ts = tonumber(v[2]) or now
tokens = math.min(per_min, tokens + (now - ts) * per_min / 60)
local need = math.min(amount, per_min)
local wait = 0
if force or tokens >= need then
  tokens = tokens - amount
else
  wait = (need - tokens) * 60 / per_min
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('EXPIRE', KEYS[1], 120)
return tostring(wait)
"""

KEY_PREFIX = "tokenmill:gateway:bucket:"


class RedisRateLimiter:
    def __init__(self, client: Any) -> None:
        """`client`: a redis.asyncio.Redis."""
        self._client = client
        self._script = client.register_script(_SCRIPT)

    async def take(self, key: str, amount: float, per_min: float) -> float:
        wait = await self._script(keys=[KEY_PREFIX + key], args=[per_min, amount, 0])
        return float(wait)

    async def charge(self, key: str, amount: float, per_min: float) -> None:
        await self._script(keys=[KEY_PREFIX + key], args=[per_min, amount, 1])
