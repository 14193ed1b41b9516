"""Round-robin: each request to the next candidate in turn. The baseline, not the default."""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.gateway.backends.backend import Backend
from tokenmill.gateway.routing.policy import RouteKey


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._num_chosen = 0

    def choose(self, candidates: Sequence[Backend], key: RouteKey) -> Backend | None:
        if not candidates:
            return None
        backend = candidates[self._num_chosen % len(candidates)]
        self._num_chosen += 1
        return backend
