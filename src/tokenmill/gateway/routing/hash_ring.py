"""Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018).

Each replica owns `VNODES` points on a 64-bit ring (blake2b of "name#i"). A key hashes to
a point and walks clockwise to the first replica whose load is under the bound
ceil(load_factor * (total_load + 1) / n): the request goes where its key lives unless that
replica already carries more than `load_factor` times the mean, in which case it overflows
to the next replica on the ring (always the same one for that key, so an overflowing hot
prefix warms one more replica rather than all). Adding or removing a replica moves only
the keys it owned. Loads are in-flight requests from this gateway.

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

    def __init__(self, load_factor: float) -> None:
        if load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1, got {load_factor}")
        self.load_factor = load_factor
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
        total = sum(b.num_inflight for b in candidates)
        bound = math.ceil(self.load_factor * (total + 1) / len(candidates))
        for backend in order:
            if backend.num_inflight + 1 <= bound:
                return backend
        raise AssertionError("some replica is always at or below the mean load")
