"""The router: from a parsed request to a `Plan`, and from a plan to a replica slot.

Planning, in order:
1. model: a configured model name, or the tier alias, which the classifier maps to a tier's
   model (`x-tokenmill-tier` tells the client which);
2. class: the tenant's pinned priority class, else the request header, else the default;
3. regions: only those the tenant's residency (narrowed by the request header) allows,
   nearest first from the client's region, or cheapest first by the price table for a
   class marked `cheapest_region`;
4. pools: the model's pools in those regions, region by region; within a region the pools
   whose `max_cost_tokens` fits the request's estimated cost, tightest first (a request
   that fits no pool is a 400);
5. degradation: from the load of those pools, cap max_tokens, step down a tier, or shed.

`acquire` then asks admission for a slot: pools are tried in plan order (spill-over) and
the pool's policy picks among its replicas with room. When no replica of the plan is
routable, a tenant that allows it is downgraded to the model's fallback; otherwise 503 —
never a replica outside the allowed regions.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from tokenmill.gateway.admission.admission import Admission, NoReplica, Selector
from tokenmill.gateway.admission.degradation import Degrader, cap_max_tokens
from tokenmill.gateway.admission.priorities import Priorities
from tokenmill.gateway.backends.backend import Backend
from tokenmill.gateway.backends.pool import Pool
from tokenmill.gateway.config import GatewayConfig, ModelConfig
from tokenmill.gateway.errors import GatewayError
from tokenmill.gateway.metrics import GatewayMetrics
from tokenmill.gateway.regions.prices import PriceTable
from tokenmill.gateway.regions.residency import CLIENT_REGION_HEADER, RESIDENCY_HEADER, Residency
from tokenmill.gateway.routing.policy import RouteKey
from tokenmill.gateway.tenants.tenants import Tenant
from tokenmill.gateway.tiers.classifier import (
    RequestFeatures,
    make_classifier,
    requested_max_tokens,
)

# max_tokens assumed for a request that sets none, when estimating its cost.
DEFAULT_MAX_TOKENS_ESTIMATE = 256
# Characters per token, for estimates before the backend has tokenized anything.
CHARS_PER_TOKEN = 4


def prompt_text(payload: Mapping[str, Any]) -> str:
    """The prompt as routing and classification see it (chat: role and content per message)."""
    messages = payload.get("messages")
    if isinstance(messages, list):
        parts = []
        for message in messages:
            if isinstance(message, dict):
                content = message.get("content")
                text = content if isinstance(content, str) else json.dumps(content)
                parts.append(f"{message.get('role')}\n{text}\n")
        return "".join(parts)
    value = payload.get("prompt", payload.get("input", ""))
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    return json.dumps(value)


def cache_salt(tenant: Tenant, payload: Mapping[str, Any]) -> str:
    """The tenant's salt, narrowed by the request's own `cache_salt`: what may share prefix cache."""
    salt = payload.get("cache_salt")
    return tenant.cache_salt + (f":{salt}" if isinstance(salt, str) and salt else "")


@dataclass
class Plan:
    tenant: Tenant
    path: str
    # The body as the client sent it (with degradation applied); model is rewritten per backend.
    payload: dict[str, Any]
    requested_model: str
    model: ModelConfig
    tier: str | None
    cls: str
    key: RouteKey
    num_tokens: int
    regions: list[str]
    pools: list[Pool]
    degraded: tuple[str, ...] = ()
    downgraded_from: str | None = None
    # Replicas (by id) already tried and failed for this request.
    excluded: set[int] = field(default_factory=set)
    # The usage a streamed answer reported (include_usage), for accounting.
    usage: dict[str, Any] | None = None
    # The replica whose answer the client got.
    served_by: Backend | None = None

    @property
    def stream(self) -> bool:
        return bool(self.payload.get("stream"))

    def body_for(self, backend: Backend, engine_priority: int) -> bytes:
        body = dict(self.payload)
        body["model"] = self.model.upstream
        if backend.accepts_extensions:
            body["priority"] = engine_priority
            body["cache_salt"] = cache_salt(self.tenant, self.payload)
        return json.dumps(body, separators=(",", ":")).encode()


class Router:
    def __init__(
        self,
        config: GatewayConfig,
        pools: list[Pool],
        admission: Admission,
        metrics: GatewayMetrics,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.pools = pools
        self.admission = admission
        self.priorities: Priorities = admission.priorities
        self.metrics = metrics
        self.models = {m.name: m for m in config.models}
        self.residency = Residency(config.regions, config.gateway.region)
        self.prices = PriceTable(config.regions)
        self.degrader = Degrader(config.degradation)
        self.tiers = config.tiers
        self.classifier = make_classifier(config.tiers) if config.tiers is not None else None
        self._wall_clock = wall_clock

    def model_names(self) -> list[str]:
        names = list(self.models)
        return names + ([self.tiers.alias] if self.tiers is not None else [])

    # -- planning -------------------------------------------------------------------------

    def plan(self, tenant: Tenant, path: str, payload: dict[str, Any], headers: Mapping[str, str]) -> Plan:
        requested = payload.get("model")
        if not isinstance(requested, str):
            raise GatewayError(400, "'model' is required and must be a string", param="model")
        text = prompt_text(payload)
        tier: str | None = None
        if self.tiers is not None and requested == self.tiers.alias:
            assert self.classifier is not None
            tier = self.classifier.classify(RequestFeatures.of(payload, text, tenant.name))
            model = self.models[self.tiers.models[tier]]
        elif requested in self.models:
            model = self.models[requested]
        else:
            raise GatewayError(404, f"model {requested!r} does not exist; models are {self.model_names()}",
                               param="model", code="model_not_found")
        cls = self.priorities.resolve(tenant.config.priority, headers)
        max_tokens = requested_max_tokens(payload)
        generates = not path.endswith("/embeddings")
        estimate = max_tokens if max_tokens is not None else DEFAULT_MAX_TOKENS_ESTIMATE
        num_tokens = len(text) // CHARS_PER_TOKEN + (estimate if generates else 0)
        allowed = self.residency.allowed(tenant.config.residency, headers.get(RESIDENCY_HEADER))
        regions = self.residency.nearest_first(allowed, headers.get(CLIENT_REGION_HEADER))
        if self.priorities[cls].cheapest_region:
            regions = self.prices.cheapest_first(regions, time.gmtime(self._wall_clock()).tm_hour)
        plan = Plan(
            tenant=tenant, path=path, payload=dict(payload), requested_model=requested, model=model, tier=tier,
            cls=cls, key=RouteKey(text, headers, num_tokens, cache_salt(tenant, payload)),
            num_tokens=num_tokens, regions=regions,
            pools=self.pools_for(model, regions, num_tokens),
        )
        self._degrade(plan)
        return plan

    def pools_for(self, model: ModelConfig, regions: list[str], num_tokens: int) -> list[Pool]:
        ordered: list[Pool] = []
        too_large = False
        for region in regions:
            here = [p for p in self.pools if p.model == model.name and p.region == region]
            fitting = [p for p in here if p.max_cost_tokens is None or num_tokens <= p.max_cost_tokens]
            too_large |= bool(here) and not fitting
            ordered += sorted(fitting, key=lambda p: p.max_cost_tokens or float("inf"))
        if not ordered and too_large:
            raise GatewayError(400, f"the request's estimated {num_tokens} tokens exceed every pool of {model.name!r}",
                               code="request_too_large")
        return ordered

    def _degrade(self, plan: Plan) -> None:
        if not self.degrader.steps:
            return
        now = time.monotonic()
        inflight = slots = 0
        for pool in plan.pools:
            used, total = pool.capacity(now)
            inflight, slots = inflight + used, slots + total
        load = inflight / slots if slots else 0.0
        decision = self.degrader.decide(plan.cls, load)
        for action in decision.actions:
            self.metrics.degradations.labels(plan.cls, action).inc()
        plan.degraded = decision.actions
        if decision.shed:
            retry = self.priorities[plan.cls].retry_after_s
            self.metrics.sheds.labels(plan.cls, "degraded").inc()
            raise GatewayError(429, f"the fleet is overloaded ({load:.0%}); {plan.cls!r} requests are shed",
                               code="shed_degraded", headers={"Retry-After": str(retry)})
        if decision.max_tokens_cap is not None:
            cap_max_tokens(plan.payload, decision.max_tokens_cap)
        if decision.smaller_tier and plan.tier is not None:
            smaller = self.neighbor_tier(plan.tier, -1)
            if smaller is not None:
                self.retier(plan, smaller)

    # -- tiers ------------------------------------------------------------------------------

    def neighbor_tier(self, tier: str, step: int) -> str | None:
        assert self.tiers is not None
        order = list(self.tiers.models)
        index = order.index(tier) + step
        return order[index] if 0 <= index < len(order) else None

    def retier(self, plan: Plan, tier: str) -> None:
        assert self.tiers is not None
        plan.tier = tier
        plan.model = self.models[self.tiers.models[tier]]
        plan.pools = self.pools_for(plan.model, plan.regions, plan.num_tokens)

    def escalated(self, plan: Plan, payload: dict[str, Any]) -> Plan | None:
        """The same request one tier up, or None at the top tier."""
        assert plan.tier is not None
        larger = self.neighbor_tier(plan.tier, +1)
        if larger is None:
            return None
        up = replace(plan, payload=payload, excluded=set())
        self.retier(up, larger)
        return up

    # -- slots ------------------------------------------------------------------------------

    def selector(self, plan: Plan) -> Selector:
        share = self.priorities[plan.cls].inflight_share

        def select() -> tuple[Backend | None, bool]:
            now = time.monotonic()
            any_routable = False
            for pool in plan.pools:
                routable = [b for b in pool.routable(now) if id(b) not in plan.excluded]
                any_routable |= bool(routable)
                candidates = [b for b in routable if b.has_room(plan.cls, share)]
                backend = pool.policy.choose(candidates, plan.key) if candidates else None
                if backend is not None:
                    return backend, True
            return None, any_routable

        return select

    async def acquire(self, plan: Plan) -> Backend:
        while True:
            try:
                return await self.admission.acquire(plan.cls, self.selector(plan), plan.num_tokens)
            except NoReplica:
                fallback = plan.model.fallback
                if fallback is None or not plan.tenant.config.allow_downgrade or plan.downgraded_from is not None:
                    raise self._unavailable(plan) from None
                self.metrics.downgrades.labels(plan.model.name, fallback).inc()
                plan.downgraded_from = plan.model.name
                plan.model = self.models[fallback]
                plan.pools = self.pools_for(plan.model, plan.regions, plan.num_tokens)
                plan.excluded.clear()

    def _unavailable(self, plan: Plan) -> GatewayError:
        where = ", ".join(plan.regions) or "no region"
        tried = " (after a failed attempt)" if plan.excluded else ""
        return GatewayError(
            503, f"no replica of {plan.model.name!r} is available in the allowed regions ({where}){tried}",
            code="no_replica_available", headers={"Retry-After": "1"},
        )
