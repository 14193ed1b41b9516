"""Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018).

Each replica owns `VNODES` points on a 64-bit ring (blake2b of "name#i"). A key hashes to
a point and walks clockwise to the first replica whose load, with this request, stays
within the bound

    bound = ceil(max(load_factor * m, m + load_slack)),   m = (total_load + 1) / n

the mean load with this request counted. The request goes where its key lives unless that
replica is both `load_factor` times and `load_slack` requests above the mean, in which case
it overflows to the next replica on the ring (always the same one for that key, so an
overflowing hot prefix warms one more replica rather than all). Adding or removing a
replica moves only the keys it owned. Loads are in-flight requests from this gateway.

Why two terms. The factor is the paper's bound: it keeps a hot key from taking more than
`load_factor` times its share once the fleet is busy (1.25 costs a few extra probes per
request and leaves the busiest replica at most 25% above the mean). Alone it is far too
strict at the low loads an LLM fleet spends most of its time at: with 3 replicas and one
request in flight, ceil(1.25 * 2 / 3) = 1, so a second request for the same prefix spills
to a replica that has to prefill the whole prompt cold, while a batching replica would have
served it next to the first at almost no extra cost. The slack (2 by default) lets a
replica run a couple of requests above the mean before its keys spill; beyond a few in
flight the factor is the larger term and decides alone. (SGLang's and vLLM's cache-aware
routers likewise ignore imbalance until it is both absolute and relative.) The bound is at
least ceil(m), which the least-loaded replica always fits under, so the walk always ends.

     key --hash--> .        ring: ..A..B....A..C..B..C..A..
                   walk ->  first replica under the bound wins
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence

from tokenmill.gateway.backends.backend import Backend

VNODES = 64


def hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, names: Sequence[str]) -> None:
        points = sorted((hash64(f"{name}#{i}"), name) for name in names for i in range(VNODES))
        self._hashes = [h for h, _ in points]
        self._names = [n for _, n in points]

    def walk(self, key: str) -> list[str]:
        """Distinct replica names in ring order starting at the key's point."""
        start = bisect.bisect(self._hashes, hash64(key))
        seen: list[str] = []
        for i in range(len(self._names)):
            name = self._names[(start + i) % len(self._names)]
            if name not in seen:
                seen.append(name)
        return seen


class BoundedRing:
    """Caches one ring per candidate set (sets change only with health and admin)."""

    def __init__(self, load_factor: float, load_slack: int = 0) -> None:
        if load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1, got {load_factor}")
        if load_slack < 0:
            raise ValueError(f"load_slack must be >= 0, got {load_slack}")
        self.load_factor = load_factor
        self.load_slack = load_slack
        self._rings: dict[tuple[str, ...], HashRing] = {}

    def choose(self, candidates: Sequence[Backend], key: str, bounded: bool = True) -> Backend | None:
        if not candidates:
            return None
        names = tuple(sorted(b.name for b in candidates))
        ring = self._rings.get(names)
        if ring is None:
            if len(self._rings) > 64:
                self._rings.clear()
            ring = self._rings[names] = HashRing(names)
        by_name = {b.name: b for b in candidates}
        order = [by_name[n] for n in ring.walk(key)]
        if not bounded:
            return order[0]
        bound = self.bound(sum(b.num_inflight for b in candidates), len(candidates))
        for backend in order:
            if backend.num_inflight + 1 <= bound:
                return backend
        raise AssertionError("some replica is always at or below the mean load")

    def bound(self, total_inflight: int, num_candidates: int) -> int:
        """The most requests (this one included) a replica may carry: see the module doc."""
        # Both terms times n, so one division is the only rounding (12 * 1.25 / 3 is exactly 5).
        requests = total_inflight + 1
        scaled = max(self.load_factor * requests, requests + self.load_slack * num_candidates)
        return math.ceil(scaled / num_candidates)
