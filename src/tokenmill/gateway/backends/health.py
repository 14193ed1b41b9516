"""Active health checks, every `interval_s`, for every replica of every pool.

A tokenmill replica is probed at /ready (200 only once its engine serves) and read at
/metrics for the requests it is running and has waiting (least-load routing uses them);
any other OpenAI-compatible server is probed at /health. A probe that fails, times out or
answers non-200 is a failure for the replica's circuit breaker; a 200 is a success, which is
how an open circuit is probed back in once its `open_s` has passed. Passive failures
(requests that errored) are recorded by the forwarder into the same breaker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import aiohttp

from tokenmill.gateway.backends.backend import Backend
from tokenmill.gateway.backends.breaker import BreakerState

logger = logging.getLogger(__name__)

_RUNNING = "tokenmill:num_requests_running"
_WAITING = "tokenmill:num_requests_waiting"


def read_load(metrics_text: str) -> tuple[float, float]:
    """(running, waiting) summed over a tokenmill /metrics page's samples."""
    running = waiting = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(_RUNNING):
            running += float(line.rsplit(" ", 1)[1])
        elif line.startswith(_WAITING):
            waiting += float(line.rsplit(" ", 1)[1])
    return running, waiting


class HealthChecker:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        backends: Callable[[], list[Backend]],
        interval_s: float,
        timeout_s: float,
        on_change: Callable[[], None],
    ) -> None:
        self._session = session
        self._backends = backends
        self.interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._on_change = on_change
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval_s)

    async def check_all(self) -> None:
        backends = self._backends()
        await asyncio.gather(*(self.check(b) for b in backends))
        self._on_change()

    async def check(self, backend: Backend) -> bool:
        path = "/ready" if backend.kind == "tokenmill" else "/health"
        before = backend.breaker.state
        try:
            async with self._session.get(backend.url + path, timeout=self._timeout) as resp:
                await resp.read()
                ok = resp.status == 200
            if ok and backend.kind == "tokenmill":
                async with self._session.get(backend.url + "/metrics", timeout=self._timeout) as resp:
                    backend.reported_running, backend.reported_waiting = read_load(await resp.text())
        except (aiohttp.ClientError, TimeoutError, ValueError):
            ok = False
        now = time.monotonic()
        if ok:
            backend.breaker.record_success(now)
        else:
            backend.breaker.record_failure(now)
        if backend.breaker.state is not before:
            level = logging.INFO if backend.breaker.state is BreakerState.CLOSED else logging.WARNING
            logger.log(level, "backend %s: circuit %s -> %s", backend.name, before.value, backend.breaker.state.value)
        return ok
