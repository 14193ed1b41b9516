"""Prefix-aware: requests whose prompts start alike go to the same replica.

A replica that already holds a prompt's leading KV blocks in its prefix cache prefills
only the rest. The routing key is the first `prefix_chars` characters of the prompt as the
gateway renders it (role and content per message, no chat template, so no header that every
prompt shares): 256 characters are about 64 tokens, four KV blocks of 16, long enough to
reach what tells one system prompt from another, short enough that a long shared system
prompt keys all its users' requests alike (a short one keys by the conversation's first
turn instead, which keeps a conversation's turns together). Every request that shares the
key maps to one point on a consistent-hash ring; the bounded-load walk (see hash_ring.py)
keeps a hot prefix from melting its replica by overflowing it, once its replica is well
above the mean load, to the next replica on the ring, the same one every time. The key
starts with the request's cache scope (its tenant's cache_salt): two tenants' copies of one
system prompt are distinct cache entries, so they hash apart instead of piling onto one
replica.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.gateway.backends.backend import Backend
from tokenmill.gateway.routing.hash_ring import BoundedRing
from tokenmill.gateway.routing.policy import RouteKey


class PrefixAware:
    name = "prefix_aware"

    def __init__(
        self, prefix_chars: int = 256, load_factor: float = 1.25, load_slack: int = 2
    ) -> None:
        if prefix_chars < 1:
            raise ValueError(f"prefix_chars must be >= 1, got {prefix_chars}")
        self.prefix_chars = prefix_chars
        self._ring = BoundedRing(load_factor, load_slack)

    def routing_key(self, key: RouteKey) -> str:
        prefix = key.prompt_text[: self.prefix_chars]
        return f"{key.cache_scope}\n{prefix}" if key.cache_scope else prefix

    def choose(self, candidates: Sequence[Backend], key: RouteKey) -> Backend | None:
        return self._ring.choose(candidates, self.routing_key(key))
