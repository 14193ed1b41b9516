"""The gateway's HTTP service (aiohttp on uvloop): OpenAI routes, probes, metrics, admin.

aiohttp serves; upstream calls go through upstream_client.py's lean keep-alive pool (an
aiohttp ClientSession only runs the health checks). That is what lets one Python process
on two cores forward about 1,500 requests/s (benchmarks/gateway.py). A generation request goes:

    authenticate -> parse -> plan (router.py) -> rate limits -> response cache
      -> [cascade] -> forward (forwarder.py: slot, upstream, retry before first byte)
      -> account usage -> response with x-tokenmill-* headers

Every expected failure is a `GatewayError` answered in OpenAI's error shape; anything else
is logged with the request id and answered 500.

Response headers: `x-tokenmill-backend`, `x-tokenmill-pool`, `x-tokenmill-region`,
`x-tokenmill-tier` (tiered requests), `x-tokenmill-cascade`, `x-tokenmill-degraded` (the
degradation steps applied), `x-tokenmill-downgraded-from`, `x-tokenmill-cache` (hit/miss),
`x-tokenmill-retries`, `x-request-id`.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from tokenmill.gateway.admission.admission import Admission
from tokenmill.gateway.admission.priorities import Priorities
from tokenmill.gateway.backends.health import HealthChecker
from tokenmill.gateway.backends.pool import Pool, all_backends
from tokenmill.gateway.cache.redis_cache import RedisCache
from tokenmill.gateway.cache.response_cache import (
    InMemoryCache,
    ResponseCache,
    cache_key,
    is_deterministic,
)
from tokenmill.gateway.config import GatewayConfig
from tokenmill.gateway.errors import GatewayError, shed
from tokenmill.gateway.forwarder import Forwarder, Upstream
from tokenmill.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from tokenmill.gateway.router import Plan, Router
from tokenmill.gateway.tenants.rate_limit import InMemoryRateLimiter, RateLimiter
from tokenmill.gateway.tenants.redis_rate_limit import RedisRateLimiter
from tokenmill.gateway.tenants.tenants import Tenant, TenantRegistry
from tokenmill.gateway.tiers import cascade
from tokenmill.gateway.upstream_client import UpstreamPool

logger = logging.getLogger(__name__)

CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
MAX_BODY_BYTES = 8 << 20
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Gateway:
    """Everything one gateway process holds; `start()` opens connections, `close()` ends them."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.priorities = Priorities(config.priorities)
        # The shed hook runs only once requests flow, after the metrics exist.
        self.admission = Admission(self.priorities, on_shed=lambda cls, why: self.metrics.sheds.labels(cls, why).inc())
        self.pools = [Pool(p, config.health) for p in config.pools]
        self.metrics = GatewayMetrics(lambda: dict(self.admission.num_waiting), lambda: all_backends(self.pools))
        self.router = Router(config, self.pools, self.admission, self.metrics)
        self.tenants = TenantRegistry(config.tenants, config.auth.anonymous_tenant)
        self.cache: ResponseCache | None = None
        self.limiter: RateLimiter = InMemoryRateLimiter()
        self._redis: Any = None
        self.session: aiohttp.ClientSession | None = None
        self.upstream: UpstreamPool | None = None
        self.forwarder: Forwarder | None = None
        self.health: HealthChecker | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=60)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        cache = self.config.cache
        if self.config.redis_url is not None:
            import redis.asyncio

            self._redis = redis.asyncio.Redis.from_url(self.config.redis_url)
            await self._redis.ping()
            self.limiter = RedisRateLimiter(self._redis)
            if cache.enabled:
                self.cache = RedisCache(self._redis, cache.ttl_s, cache.max_entry_bytes)
        elif cache.enabled:
            self.cache = InMemoryCache(cache.ttl_s, cache.max_entries, cache.max_entry_bytes)
        section = self.config.gateway
        self.upstream = UpstreamPool(section.connect_timeout_s)
        self.forwarder = Forwarder(
            self.upstream, self.router, self.priorities, self.metrics,
            section.retries_before_first_byte, section.connect_timeout_s, section.request_timeout_s,
        )
        health = self.config.health
        self.health = HealthChecker(
            self.session, lambda: all_backends(self.pools), health.interval_s, health.timeout_s, self.admission.wake
        )
        await self.health.check_all()
        self.health.start()

    async def close(self) -> None:
        if self.health is not None:
            await self.health.stop()
        if self.upstream is not None:
            self.upstream.close()
        if self.session is not None:
            await self.session.close()
        if self._redis is not None:
            await self._redis.aclose()

    def pool(self, name: str) -> Pool:
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise GatewayError(404, f"no pool {name!r}; pools are {[p.name for p in self.pools]}")

    # -- generation -------------------------------------------------------------------------

    async def generate(self, request: web.Request, path: str) -> web.StreamResponse:
        start = time.perf_counter()
        tenant = self.tenants.authenticate(request.headers)
        payload = await read_json(request)
        plan = self.router.plan(tenant, path, payload, request.headers)
        try:
            return await self._serve(request, plan, payload, start)
        except GatewayError as exc:
            self._account(plan, None, f"error_{exc.status}")
            raise

    async def _serve(
        self, request: web.Request, plan: Plan, payload: dict[str, Any], start: float
    ) -> web.StreamResponse:
        """`payload`: the body as the client sent it (the plan's may be degraded)."""
        tenant, path = plan.tenant, plan.path
        await self._rate_limit(tenant, plan.num_tokens)
        tenant.num_requests += 1
        headers = {"x-request-id": request["request_id"]}
        if plan.tier is not None:
            headers["x-tokenmill-tier"] = plan.tier
        if plan.degraded:
            headers["x-tokenmill-degraded"] = ",".join(plan.degraded)
        key = None
        if self.cache is not None and is_deterministic(payload) and path != EMBEDDINGS:
            key = cache_key(tenant.name, plan.requested_model, path, payload)
            hit = await self.cache.get(key)
            if hit is not None:
                self.metrics.cache_hits.inc()
                self.metrics.requests.labels(tenant.name, plan.model.name, plan.tier or "", "", "", "cache_hit").inc()
                await self._charge(tenant, -plan.num_tokens)
                return web.Response(body=hit, content_type="application/json", headers={**headers, "x-tokenmill-cache": "hit"})
            self.metrics.cache_misses.inc()
            headers["x-tokenmill-cache"] = "miss"
        assert self.forwarder is not None
        if plan.stream:
            out = await self.forwarder.stream(plan, request, {**headers, **self._where(plan)})
            self._account(plan, plan.usage, "ok" if out.status == 200 else f"error_{out.status}")
            if plan.usage is not None:
                await self._charge(tenant, plan.usage.get("total_tokens", 0) - plan.num_tokens)
            return out
        cascading = plan.tier is not None and path != EMBEDDINGS and self.config.tiers is not None
        if cascading and self.config.tiers is not None and self.config.tiers.cascade.enabled:
            upstream, plan, body = await self._cascade(plan, headers)
        else:
            upstream = await self.forwarder.send(plan)
            body = upstream.body
        usage = _usage(upstream)
        outcome = "ok" if upstream.status == 200 else f"error_{upstream.status}"
        self._account(plan, usage, outcome)
        if usage is not None:
            await self._charge(tenant, usage.get("total_tokens", 0) - plan.num_tokens)
        if key is not None and upstream.status == 200 and not plan.degraded and plan.downgraded_from is None:
            assert self.cache is not None
            await self.cache.put(key, body)
        headers.update(self._where(plan, upstream))
        headers["x-tokenmill-retries"] = str(upstream.num_retries)
        self.metrics.overhead.observe(max(0.0, time.perf_counter() - start - upstream.upstream_s))
        return web.Response(status=upstream.status, body=body, content_type="application/json", headers=headers)

    async def _cascade(self, plan: Plan, headers: dict[str, str]) -> tuple[Upstream, Plan, bytes]:
        assert self.forwarder is not None and self.config.tiers is not None
        original = plan.payload
        plan.payload = cascade.with_logprobs(original, plan.path)
        small = await self.forwarder.send(plan)
        if small.status != 200:
            return small, plan, small.body
        answer = json.loads(small.body)
        reason = cascade.escalation_reason(answer, original, self.config.tiers.cascade.min_mean_logprob)
        bigger = self.router.escalated(plan, original) if reason is not None else None
        if reason is None or bigger is None:
            self.metrics.cascade.labels("accepted" if reason is None else "top_tier").inc()
            headers["x-tokenmill-cascade"] = "accepted" if reason is None else f"kept:{reason}"
            if not original.get("logprobs"):
                answer = cascade.strip_logprobs(answer)
            return small, plan, json.dumps(answer).encode()
        self.metrics.cascade.labels(reason).inc()
        self._account(plan, _usage(small), "escalated")
        large = await self.forwarder.send(bigger)
        headers["x-tokenmill-cascade"] = f"escalated:{reason}"
        assert bigger.tier is not None
        headers["x-tokenmill-tier"] = bigger.tier
        return large, bigger, large.body

    def _where(self, plan: Plan, upstream: Upstream | None = None) -> dict[str, str]:
        out: dict[str, str] = {}
        if upstream is not None:
            b = upstream.backend
            out = {"x-tokenmill-backend": b.name, "x-tokenmill-pool": b.pool, "x-tokenmill-region": b.region}
        if plan.downgraded_from is not None:
            out["x-tokenmill-downgraded-from"] = plan.downgraded_from
        return out

    def _account(self, plan: Plan, usage: dict[str, Any] | None, outcome: str) -> None:
        served = plan.served_by
        region, backend = (served.region, served.name) if served is not None else ("", "")
        self.metrics.requests.labels(plan.tenant.name, plan.model.name, plan.tier or "", region, backend, outcome).inc()
        if usage is None:
            return
        prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
        plan.tenant.num_prompt_tokens += prompt
        plan.tenant.num_completion_tokens += completion
        self.metrics.tenant_tokens.labels(plan.tenant.name, "prompt").inc(prompt)
        self.metrics.tenant_tokens.labels(plan.tenant.name, "completion").inc(completion)

    async def _rate_limit(self, tenant: Tenant, num_tokens: int) -> None:
        limits = tenant.config
        if limits.requests_per_min is not None:
            wait = await self.limiter.take(f"{tenant.name}:requests", 1, limits.requests_per_min)
            if wait > 0:
                self.metrics.sheds.labels("", "rate_limit_requests").inc()
                raise shed(f"tenant {tenant.name!r} is over {limits.requests_per_min} requests/min",
                           math.ceil(wait), "rate_limit_requests")
        if limits.tokens_per_min is not None:
            wait = await self.limiter.take(f"{tenant.name}:tokens", num_tokens, limits.tokens_per_min)
            if wait > 0:
                if limits.requests_per_min is not None:
                    await self.limiter.charge(f"{tenant.name}:requests", -1, limits.requests_per_min)
                self.metrics.sheds.labels("", "rate_limit_tokens").inc()
                raise shed(f"tenant {tenant.name!r} is over {limits.tokens_per_min} tokens/min",
                           math.ceil(wait), "rate_limit_tokens")

    async def _charge(self, tenant: Tenant, num_tokens: int) -> None:
        if tenant.config.tokens_per_min is not None and num_tokens:
            await self.limiter.charge(f"{tenant.name}:tokens", num_tokens, tenant.config.tokens_per_min)


def _usage(upstream: Upstream) -> dict[str, Any] | None:
    if upstream.status != 200 or b'"usage"' not in upstream.body:
        return None
    try:
        usage = json.loads(upstream.body).get("usage")
    except ValueError:
        return None
    return usage if isinstance(usage, dict) else None


async def read_json(request: web.Request) -> dict[str, Any]:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise GatewayError(413, f"request body over {MAX_BODY_BYTES} bytes") from None
    try:
        payload = json.loads(raw)
    except ValueError as exc:
        raise GatewayError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise GatewayError(400, "the body must be a JSON object")
    return payload


def error_response(exc: GatewayError) -> web.Response:
    return web.Response(status=exc.status, body=exc.body_bytes(), content_type="application/json", headers=exc.headers)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    request["request_id"] = request_id
    try:
        return await handler(request)
    except GatewayError as exc:
        return error_response(exc)
    except web.HTTPException:
        raise
    except Exception:
        logger.exception("request %s failed", request_id)
        return error_response(GatewayError(500, "internal gateway error", code="internal_error"))


def build_app(config: GatewayConfig) -> web.Application:
    from tokenmill.gateway.admin import add_admin_routes

    gateway = Gateway(config)
    app = web.Application(middlewares=[errors_middleware], client_max_size=MAX_BODY_BYTES)
    app["gateway"] = gateway

    async def on_startup(app: web.Application) -> None:
        await gateway.start()

    async def on_cleanup(app: web.Application) -> None:
        await gateway.close()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)

    def route(path: str) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await gateway.generate(request, path)

        return handler

    async def models(request: web.Request) -> web.Response:
        gateway.tenants.authenticate(request.headers)
        data = [{"id": name, "object": "model", "owned_by": "tokenmill"} for name in gateway.router.model_names()]
        return web.json_response({"object": "list", "data": data})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(request: web.Request) -> web.Response:
        now = time.monotonic()
        num_routable = sum(len(p.routable(now)) for p in gateway.pools)
        status = 200 if num_routable else 503
        return web.json_response({"status": "ready" if num_routable else "no_backend", "routable": num_routable},
                                 status=status)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=gateway.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    app.router.add_post(CHAT, route(CHAT))
    app.router.add_post(COMPLETIONS, route(COMPLETIONS))
    app.router.add_post(EMBEDDINGS, route(EMBEDDINGS))
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    add_admin_routes(app, gateway)
    return app
