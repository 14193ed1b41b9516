"""Session affinity: every request of a session (named by a header) to one replica.

The session id hashes onto a consistent-hash ring, so a session sticks to its replica while
that replica is routable and has room, and moves (alone) when it does not. The bounded-load
walk still applies, so one very busy session cannot take a replica over. Requests without
the header are routed least-load.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.gateway.backends.backend import Backend
from tokenmill.gateway.routing.hash_ring import BoundedRing
from tokenmill.gateway.routing.least_load import LeastLoad
from tokenmill.gateway.routing.policy import RouteKey


class SessionAffinity:
    name = "session_affinity"

    def __init__(
        self, header: str = "x-session-id", load_factor: float = 1.25, load_slack: int = 2
    ) -> None:
        self.header = header.lower()
        self._ring = BoundedRing(load_factor, load_slack)
        self._fallback = LeastLoad()

    def choose(self, candidates: Sequence[Backend], key: RouteKey) -> Backend | None:
        session_id = key.headers.get(self.header)
        if not session_id:
            return self._fallback.choose(candidates, key)
        return self._ring.choose(candidates, session_id)
