"""Admission: a request gets a slot on a replica now, waits in its class's queue, or is shed.

Each replica has `max_inflight` slots, and a class may hold at most `inflight_share` of
them (batch 0.5 by default, so interactive always has half the fleet). `select` is asked
for a replica with room; if there is none but some replica of the allowed set is routable,
the fleet is saturated for this class and the request waits, at most `queue_timeout_s` and
behind at most `max_queue` others of its class, then is shed with 429 and Retry-After.
Whenever a slot is released every waiter is woken in class order, best class first, so
interactive waiters run, and take the freed slots, before batch ones: under saturation
batch queues fill and time out (shed) first, interactive last. If no replica of the allowed
set is routable at all the request fails at once with `NoReplica` (the router then falls
back or answers 503): waiting would not help.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from tokenmill.gateway.admission.priorities import Priorities
from tokenmill.gateway.backends.backend import Backend
from tokenmill.gateway.errors import shed


class NoReplica(Exception):
    """No replica of the allowed set is routable."""


# (replica with room or None, whether any replica of the set is routable)
Selector = Callable[[], tuple[Backend | None, bool]]


class Admission:
    def __init__(
        self,
        priorities: Priorities,
        on_shed: Callable[[str, str], None] = lambda cls, reason: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`on_shed(class, reason)` is told of every shed request (metrics)."""
        self.priorities = priorities
        self._on_shed = on_shed
        self._clock = clock
        self._wakeups = {cls: asyncio.Event() for cls in priorities.order}
        self.num_waiting = dict.fromkeys(priorities.order, 0)

    async def acquire(self, cls: str, select: Selector, num_tokens: int) -> Backend:
        spec = self.priorities[cls]
        deadline = self._clock() + spec.queue_timeout_s
        queued = False
        try:
            while True:
                backend, any_routable = select()
                if backend is not None:
                    backend.dispatch(cls, num_tokens, self._clock())
                    return backend
                if not any_routable:
                    raise NoReplica()
                if not queued:
                    if self.num_waiting[cls] >= spec.max_queue:
                        raise self._shed(cls, "queue_full")
                    self.num_waiting[cls] += 1
                    queued = True
                remaining = deadline - self._clock()
                if remaining <= 0:
                    raise self._shed(cls, "queue_timeout")
                try:
                    async with asyncio.timeout(remaining):
                        await self._wakeups[cls].wait()
                except TimeoutError:
                    raise self._shed(cls, "queue_timeout") from None
        finally:
            if queued:
                self.num_waiting[cls] -= 1

    def release(self, backend: Backend, cls: str, num_tokens: int) -> None:
        backend.release(cls, num_tokens)
        self.wake()

    def wake(self) -> None:
        """Wake every waiter, best class first (also after health or membership changes)."""
        for cls in self.priorities.order:
            if self.num_waiting[cls]:
                event = self._wakeups[cls]
                event.set()
                event.clear()

    def _shed(self, cls: str, reason: str) -> Exception:
        self._on_shed(cls, reason)
        spec = self.priorities[cls]
        return shed(f"the fleet is saturated for {cls!r} requests ({reason.replace('_', ' ')}); retry later",
                    spec.retry_after_s, f"shed_{reason}")
