"""The forwarder: one request to a replica, retried elsewhere if it fails before its first byte.

Nothing reaches the client until the upstream has answered: a non-streamed response is
read whole, a stream's first chunk is read before the client's response starts. Until then
a failure (refused or reset connection, timeout, a 5xx, or a 429/503 from a saturated
replica) is invisible to the client, so the request is sent once more to another replica
(`retries_before_first_byte`), the failed one excluded; this is idempotent by construction.
Connection failures, timeouts and 5xx count against the replica's circuit breaker.

Once a stream has started it is relayed chunk by chunk. If the upstream breaks (reset,
timeout, or the body ends without `data: [DONE]`) the client gets one error event
`data: {"error": {...}}` and `data: [DONE]`: never a silent truncation, never a replay that
would duplicate tokens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

from aiohttp import web

from tokenmill.gateway.admission.priorities import Priorities
from tokenmill.gateway.backends.backend import Backend
from tokenmill.gateway.errors import GatewayError
from tokenmill.gateway.metrics import GatewayMetrics
from tokenmill.gateway.router import Plan, Router
from tokenmill.gateway.upstream_client import UpstreamError, UpstreamPool, UpstreamResponse

logger = logging.getLogger(__name__)

# Statuses worth another replica: it failed or is saturated, the request itself is fine.
RETRYABLE_STATUSES = frozenset({429, 500, 502, 503, 504})
_DONE = b"data: [DONE]"
# What a failed upstream attempt raises (refused, reset, closed, bad framing, timed out).
_FAILURES = (UpstreamError, OSError, TimeoutError)


@dataclass
class Upstream:
    backend: Backend
    status: int
    body: bytes
    content_type: str
    # Seconds from sending to the whole body read.
    upstream_s: float
    num_retries: int


class _BrokenStream(Exception):
    pass


class Forwarder:
    def __init__(
        self,
        upstream: UpstreamPool,
        router: Router,
        priorities: Priorities,
        metrics: GatewayMetrics,
        retries: int,
        connect_timeout_s: float,
        request_timeout_s: float,
    ) -> None:
        self._upstream = upstream
        self._router = router
        self._priorities = priorities
        self._metrics = metrics
        self.retries = retries
        self.request_timeout_s = request_timeout_s

    async def _post(self, plan: Plan, backend: Backend) -> UpstreamResponse:
        body = plan.body_for(backend, self._priorities[plan.cls].engine_priority)
        return await self._upstream.post(backend.url, plan.path, body)

    def _failed(self, plan: Plan, backend: Backend, reason: str, counts_against: bool) -> None:
        logger.warning("backend %s failed before the first byte: %s", backend.name, reason)
        self._metrics.failovers.labels(backend.name).inc()
        if counts_against:
            backend.breaker.record_failure(time.monotonic())
        plan.excluded.add(id(backend))

    async def send(self, plan: Plan) -> Upstream:
        """A non-streamed request; its whole body is read before anything is returned."""
        num_retries = 0
        while True:
            backend = await self._router.acquire(plan)
            start = time.perf_counter()
            retry_reason: str | None = None
            counts_against = True
            resp: UpstreamResponse | None = None
            try:
                async with asyncio.timeout(self.request_timeout_s):
                    resp = await self._post(plan, backend)
                    body = await resp.read()
                status = resp.status
                if status in RETRYABLE_STATUSES:
                    retry_reason, counts_against = f"status {status}", status >= 500 and status != 503
                content_type = resp.headers.get("content-type", "application/json")
            except _FAILURES as exc:
                retry_reason = f"{type(exc).__name__}: {exc}"
                status, body, content_type = 502, b"", ""
            finally:
                if resp is not None:
                    resp.close()
                self._router.admission.release(backend, plan.cls, plan.num_tokens)
            plan.served_by = backend
            if retry_reason is None:
                backend.breaker.record_success(time.monotonic())
                return Upstream(backend, status, body, content_type, time.perf_counter() - start, num_retries)
            self._failed(plan, backend, retry_reason, counts_against)
            if num_retries >= self.retries:
                if body:
                    return Upstream(backend, status, body, content_type, time.perf_counter() - start, num_retries)
                raise GatewayError(502, f"upstream {backend.name} failed: {retry_reason}", code="upstream_failed")
            num_retries += 1
            self._metrics.retries.inc()

    async def stream(self, plan: Plan, request: web.Request, headers: dict[str, str]) -> web.StreamResponse:
        """A streamed request, relayed; `headers` are added to the client's response."""
        num_retries = 0
        while True:
            backend = await self._router.acquire(plan)
            resp: UpstreamResponse | None = None
            first = b""
            retry_reason: str | None = None
            counts_against = True
            deadline = asyncio.get_running_loop().time() + self.request_timeout_s
            try:
                async with asyncio.timeout_at(deadline):
                    resp = await self._post(plan, backend)
                    if resp.status != 200:
                        first = await resp.read()
                        if resp.status in RETRYABLE_STATUSES:
                            retry_reason = f"status {resp.status}"
                            counts_against = resp.status >= 500 and resp.status != 503
                    else:
                        first = await resp.readany()
                        if not first:
                            retry_reason = "stream ended before its first byte"
            except _FAILURES as exc:
                retry_reason = f"{type(exc).__name__}: {exc}"
            plan.served_by = backend
            if retry_reason is None and resp is not None and resp.status == 200:
                try:
                    where = {"x-tokenmill-backend": backend.name, "x-tokenmill-pool": backend.pool,
                             "x-tokenmill-region": backend.region, "x-tokenmill-retries": str(num_retries)}
                    return await self._relay(plan, backend, resp, first, request, {**headers, **where}, deadline)
                finally:
                    resp.close()
                    self._router.admission.release(backend, plan.cls, plan.num_tokens)
            if resp is not None:
                resp.close()
            self._router.admission.release(backend, plan.cls, plan.num_tokens)
            if retry_reason is None:
                assert resp is not None
                # A non-retryable error status (a 4xx): the client's problem, passed through.
                return web.Response(status=resp.status, body=first, content_type="application/json", headers=headers)
            self._failed(plan, backend, retry_reason, counts_against)
            if num_retries >= self.retries:
                if first and resp is not None:
                    return web.Response(status=resp.status, body=first, content_type="application/json", headers=headers)
                raise GatewayError(502, f"upstream {backend.name} failed: {retry_reason}", code="upstream_failed")
            num_retries += 1
            self._metrics.retries.inc()

    async def _relay(
        self,
        plan: Plan,
        backend: Backend,
        resp: UpstreamResponse,
        first: bytes,
        request: web.Request,
        headers: dict[str, str],
        deadline: float,
    ) -> web.StreamResponse:
        out = web.StreamResponse(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
        )
        await out.prepare(request)
        tail = b""
        pending = b""
        chunk = first
        try:
            async with asyncio.timeout_at(deadline):
                while chunk:
                    try:
                        await out.write(chunk)
                    except ConnectionResetError:
                        return out  # the client went away; closing the upstream aborts the request there
                    pending = self._scan_usage(plan, pending + chunk)
                    tail = (tail + chunk)[-64:]
                    chunk = await resp.readany()
            if _DONE not in tail:
                raise _BrokenStream("the upstream stream ended without [DONE]")
            backend.breaker.record_success(time.monotonic())
        except (*_FAILURES, _BrokenStream) as exc:
            logger.warning("stream from backend %s broke: %s", backend.name, exc)
            self._metrics.stream_errors.inc()
            backend.breaker.record_failure(time.monotonic())
            error = GatewayError(502, f"the upstream stream from {backend.name} broke mid-way: {exc}",
                                 code="upstream_stream_broken")
            try:
                await out.write(b"data: " + error.body_bytes() + b"\n\n" + _DONE + b"\n\n")
            except ConnectionResetError:
                return out
        await out.write_eof()
        return out

    @staticmethod
    def _scan_usage(plan: Plan, data: bytes) -> bytes:
        """Record the usage frame of a stream (include_usage); returns the unfinished frame."""
        *frames, rest = data.split(b"\n\n")
        for frame in frames:
            if frame.startswith(b"data: {") and b'"usage":{' in frame:
                try:
                    usage = json.loads(frame[6:]).get("usage")
                except ValueError:
                    continue
                if isinstance(usage, dict):
                    plan.usage = usage
        return rest[-65536:]
