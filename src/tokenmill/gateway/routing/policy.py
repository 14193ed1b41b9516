"""The routing seam: a policy picks one replica among the candidates of a pool.

Candidates arrive already filtered (routable, with room for the request's class) and in
the pool's order; a policy returns one of them, or None to say none fits. `RouteKey` is
everything a policy may look at: the prompt's leading text, the headers (session id), the request's
estimated tokens, and the cache scope (requests of different scopes never share prefix-cache
entries, so sharing a prompt does not make them worth co-locating).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tokenmill.gateway.backends.backend import Backend
from tokenmill.gateway.config import PoolConfig


@dataclass(frozen=True)
class RouteKey:
    # The prompt rendered as text (chat: role and content of each message).
    prompt_text: str
    # Request headers, names lower-cased (session affinity reads its header).
    headers: Mapping[str, str] = field(default_factory=dict)
    num_tokens: int = 0
    # The cache_salt the replica will get (the tenant's, plus the request's own).
    cache_scope: str = ""


class RoutingPolicy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Backend], key: RouteKey) -> Backend | None: ...


def make_policy(config: PoolConfig) -> RoutingPolicy:
    from tokenmill.gateway.routing.least_load import LeastLoad
    from tokenmill.gateway.routing.prefix_aware import PrefixAware
    from tokenmill.gateway.routing.round_robin import RoundRobin
    from tokenmill.gateway.routing.session_affinity import SessionAffinity

    if config.policy == "round_robin":
        return RoundRobin()
    if config.policy == "least_load":
        return LeastLoad()
    if config.policy == "prefix_aware":
        return PrefixAware(prefix_chars=config.prefix_chars, load_factor=config.load_factor,
                           load_slack=config.load_slack)
    assert config.policy == "session_affinity", config.policy
    return SessionAffinity(header=config.session_header, load_factor=config.load_factor,
                           load_slack=config.load_slack)
