"""Least-load: the candidate with the least outstanding work.

A request's cost varies a hundredfold with its length, so outstanding work is counted in
tokens: the estimated tokens (prompt + max_tokens) of this gateway's requests in flight on
the replica, plus `TOKENS_PER_REQUEST` for every request in flight or reported waiting at
the replica's /metrics (which includes other clients' requests). Ties go to the earlier
candidate, so the choice is deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.gateway.backends.backend import Backend
from tokenmill.gateway.routing.policy import RouteKey

# Fixed per-request cost (scheduling, the first token) in token units.
TOKENS_PER_REQUEST = 64


def outstanding_tokens(backend: Backend) -> float:
    # Requests the replica reports waiting beyond this gateway's own in-flight ones.
    foreign_waiting = max(0.0, backend.reported_waiting + backend.reported_running - backend.num_inflight)
    return backend.num_inflight_tokens + TOKENS_PER_REQUEST * (backend.num_inflight + foreign_waiting)


class LeastLoad:
    name = "least_load"

    def choose(self, candidates: Sequence[Backend], key: RouteKey) -> Backend | None:
        best: Backend | None = None
        best_load = 0.0
        for backend in candidates:
            load = outstanding_tokens(backend)
            if best is None or load < best_load:
                best, best_load = backend, load
        return best
