"""Prefix-aware: requests whose prompts start alike go to the same replica.

A replica that already holds a prompt's leading KV blocks in its prefix cache prefills
only the rest. The routing key is the first `prefix_chars` characters of the rendered
prompt (a shared system prompt, a conversation's first turns), so every request that
shares them maps to one point on a consistent-hash ring; the bounded-load walk (see
hash_ring.py) keeps a hot prefix from melting its replica by overflowing it to the next
replica on the ring.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.gateway.backends.backend import Backend
from tokenmill.gateway.routing.hash_ring import BoundedRing
from tokenmill.gateway.routing.policy import RouteKey


class PrefixAware:
    name = "prefix_aware"

    def __init__(self, prefix_chars: int = 256, load_factor: float = 1.25) -> None:
        if prefix_chars < 1:
            raise ValueError(f"prefix_chars must be >= 1, got {prefix_chars}")
        self.prefix_chars = prefix_chars
        self._ring = BoundedRing(load_factor)

    def routing_key(self, key: RouteKey) -> str:
        return key.prompt_text[: self.prefix_chars]

    def choose(self, candidates: Sequence[Backend], key: RouteKey) -> Backend | None:
        return self._ring.choose(candidates, self.routing_key(key))
