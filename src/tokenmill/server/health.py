"""Liveness and readiness, judged from the engine's EngineHealth.

Liveness must not be fooled by a hung engine: a loop that is alive but has not stepped
while it has work is as dead as a crashed one. "Has not stepped for a while" is measured
from the later of the last step and the moment work was first seen, so an engine that sat
idle for an hour and just got a request is not judged by its idle hour.

Readiness is stricter: the engine exists, is warmed up, and the server is not draining.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.engine.protocol import EngineHealth


@dataclass(frozen=True)
class HealthVerdict:
    ok: bool
    # "ok", "starting", "dead", "stalled", "not_ready", "draining".
    status: str
    detail: str | None = None

    def body(self) -> dict[str, str | None]:
        return {"status": self.status, "detail": self.detail}


class HealthMonitor:
    def __init__(self, stall_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_timeout_s = stall_timeout_s
        self._clock = clock
        # When has_work was first seen true since it was last seen false.
        self._busy_since: float | None = None

    def liveness(self, health: EngineHealth | None) -> HealthVerdict:
        """None means the engine is still loading: the process is alive."""
        if health is None:
            return HealthVerdict(True, "starting")
        if not health.alive:
            return HealthVerdict(False, "dead", health.error or "engine loop is not running")
        now = self._clock()
        if not health.has_work:
            self._busy_since = None
            return HealthVerdict(True, "ok")
        if self._busy_since is None:
            self._busy_since = now
        last_step = health.last_step_time
        progress = self._busy_since if last_step is None else max(last_step, self._busy_since)
        idle = now - progress
        if idle > self.stall_timeout_s:
            return HealthVerdict(
                False, "stalled", f"engine has work but has not stepped for {idle:.1f}s"
            )
        return HealthVerdict(True, "ok")

    def readiness(self, health: EngineHealth | None, draining: bool) -> HealthVerdict:
        if draining:
            return HealthVerdict(False, "draining", "server is shutting down")
        if health is None:
            return HealthVerdict(False, "starting", "engine is loading")
        if not health.alive:
            return HealthVerdict(False, "dead", health.error or "engine loop is not running")
        if not health.ready:
            return HealthVerdict(False, "not_ready", "engine is warming up")
        return HealthVerdict(True, "ok")
