"""The fleet file: regions, models, pools of replicas, priorities, tenants, caches.

`load_config(path)` reads YAML (or JSON, which is YAML) into `GatewayConfig`, a tree of
frozen pydantic models with `extra="forbid"`, so a typo is an error rather than a silently
ignored key. Every problem is reported as one `ConfigError` naming the file and the path of
the bad field (`fleet.yaml: pools[0].policy: ...`). Cross-references (a pool's model and
region, a tier's model, a tenant's residency zone) are checked after the fields parse.
docs/gateway.md has the commented example.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

PolicyName = Literal["round_robin", "least_load", "prefix_aware", "session_affinity"]
BackendKind = Literal["tokenmill", "openai"]
PositiveFloat = Annotated[float, Field(gt=0)]
PositiveInt = Annotated[int, Field(ge=1)]
_HOURS = re.compile(r"^(\d{1,2})-(\d{1,2})$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class ConfigError(ValueError):
    """A fleet file that cannot be used; the message names the file and the field."""


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GatewaySection(_Frozen):
    # The gateway's own region: the nearest one when a request names no client region.
    region: str | None = None
    # Seconds to connect to a backend; a refused or slow connect is retried elsewhere.
    connect_timeout_s: PositiveFloat = 2.0
    # Seconds a whole upstream request may take.
    request_timeout_s: PositiveFloat = 600.0
    # sha256 (hex) of the key that unlocks /admin; without it the admin API is off.
    admin_api_key_sha256: str | None = None
    # Requests that fail before their first byte reaches the client get this many retries
    # on other replicas.
    retries_before_first_byte: Annotated[int, Field(ge=0, le=3)] = 1

    @field_validator("admin_api_key_sha256")
    @classmethod
    def _hex(cls, value: str | None) -> str | None:
        if value is not None and not _SHA256.match(value):
            raise ValueError("must be a lowercase hex sha256 digest (64 characters)")
        return value


class RegionConfig(_Frozen):
    # Residency zone (e.g. "eu"): tenants restricted to a zone only use its regions.
    residency: str
    # Other regions from nearest to farthest: spill-over order when this one is saturated.
    neighbors: list[str] = []
    # Price per 1M tokens; `hours` maps UTC hour ranges "start-end" (end exclusive) to prices.
    price: Annotated[float, Field(ge=0)] = 1.0
    hours: dict[str, Annotated[float, Field(ge=0)]] = {}

    @field_validator("hours")
    @classmethod
    def _ranges(cls, value: dict[str, float]) -> dict[str, float]:
        for key in value:
            match = _HOURS.match(key)
            if match is None or not (0 <= int(match[1]) < int(match[2]) <= 24):
                raise ValueError(f"hour range {key!r} must be 'start-end' with 0 <= start < end <= 24")
        return value


class ModelConfig(_Frozen):
    # Name clients use.
    name: str
    # Name sent to the backends (default: `name`).
    upstream_model: str | None = None
    # Model that requests go to when every pool of this one is down (if the tenant allows).
    fallback: str | None = None

    @property
    def upstream(self) -> str:
        return self.upstream_model or self.name


class BackendConfig(_Frozen):
    # http://host:port (plain HTTP: replicas sit on the private network behind the gateway).
    url: Annotated[str, Field(pattern=r"^http://[^/\s]+$")]
    name: str | None = None
    # tokenmill servers get `priority` and `cache_salt` and are read at /ready and /metrics.
    kind: BackendKind = "tokenmill"
    # Requests in flight at once from this gateway; beyond it requests queue here.
    max_inflight: PositiveInt = 64


class PoolConfig(_Frozen):
    name: str
    model: str
    region: str
    policy: PolicyName = "prefix_aware"
    # Cost-aware pools: this pool takes requests whose prompt + max_tokens estimate is at
    # most this (None: any). Within a region the tightest fitting pool is tried first.
    max_cost_tokens: PositiveInt | None = None
    # prefix_aware: characters of the prompt that form the routing key.
    prefix_chars: PositiveInt = 256
    # prefix_aware / session_affinity: a replica keeps its keys' requests until it carries
    # more than both load_factor times the mean in-flight load and load_slack requests above
    # it; then they overflow to the next replica on the ring (routing/hash_ring.py says why).
    load_factor: Annotated[float, Field(ge=1.0)] = 1.25
    load_slack: Annotated[int, Field(ge=0)] = 2
    # session_affinity: the header that names the session.
    session_header: str = "x-session-id"
    backends: list[BackendConfig] = []


class PriorityClass(_Frozen):
    # Sent to tokenmill backends as the request's `priority` (lower runs first).
    engine_priority: int = 0
    # Fraction of each backend's max_inflight this class may occupy.
    inflight_share: Annotated[float, Field(gt=0, le=1)] = 1.0
    # Requests of this class waiting for a slot; beyond it they are shed with 429.
    max_queue: Annotated[int, Field(ge=0)] = 256
    # Seconds one may wait for a slot before it is shed with 429.
    queue_timeout_s: Annotated[float, Field(ge=0)] = 10.0
    # Retry-After (seconds) on this class's 429s.
    retry_after_s: PositiveInt = 1
    # Go to the cheapest allowed region by the price table instead of the nearest.
    cheapest_region: bool = False


def _default_classes() -> dict[str, PriorityClass]:
    return {
        "interactive": PriorityClass(engine_priority=0, inflight_share=1.0, max_queue=256, queue_timeout_s=10.0),
        "batch": PriorityClass(
            engine_priority=10, inflight_share=0.5, max_queue=32, queue_timeout_s=2.0, retry_after_s=5, cheapest_region=True
        ),
    }


class PrioritiesConfig(_Frozen):
    classes: dict[str, PriorityClass] = Field(default_factory=_default_classes)
    default: str = "interactive"
    # Request header naming the class (a tenant may pin its class instead).
    header: str = "x-tokenmill-priority"

    @model_validator(mode="after")
    def _default_known(self) -> PrioritiesConfig:
        if not self.classes:
            raise ValueError("at least one priority class is needed")
        if self.default not in self.classes:
            raise ValueError(f"default class {self.default!r} is not one of {sorted(self.classes)}")
        return self


class DegradationStep(_Frozen):
    # Fleet load (in-flight / capacity of the model's healthy replicas) at which it applies.
    at_load: Annotated[float, Field(gt=0)]
    action: Literal["cap_max_tokens", "smaller_tier", "shed"]
    classes: list[str]
    # cap_max_tokens: the cap.
    max_tokens: PositiveInt | None = None

    @model_validator(mode="after")
    def _cap(self) -> DegradationStep:
        if self.action == "cap_max_tokens" and self.max_tokens is None:
            raise ValueError("cap_max_tokens needs max_tokens")
        return self


class TierRule(_Frozen):
    tier: str
    min_prompt_chars: PositiveInt | None = None
    min_reasoning_tokens: PositiveInt | None = None
    keywords: list[str] = []
    tenants: list[str] = []


class CascadeConfig(_Frozen):
    enabled: bool = False
    # Escalate when the small tier's mean token logprob is below this.
    min_mean_logprob: float = -1.0


class TiersConfig(_Frozen):
    # Model name that routes through the classifier.
    alias: str = "auto"
    # Tier name -> model, smallest first (smaller_tier degradation steps down this order).
    models: dict[str, str]
    # "rules", or "package.module:Class" (constructed with `options`).
    classifier: str = "rules"
    options: dict[str, Any] = {}
    rules: list[TierRule] = []
    default: str
    cascade: CascadeConfig = CascadeConfig()

    @model_validator(mode="after")
    def _tiers_known(self) -> TiersConfig:
        names = set(self.models)
        unknown = [t for t in [self.default, *(r.tier for r in self.rules)] if t not in names]
        if unknown:
            raise ValueError(f"unknown tier {unknown[0]!r}; tiers are {sorted(names)}")
        if self.cascade.enabled and len(self.models) < 2:
            raise ValueError("cascade needs at least two tiers")
        return self


class TenantConfig(_Frozen):
    name: str
    # sha256 (hex) of each API key; keys themselves are never stored.
    api_key_sha256: list[str] = []
    # Residency zones (e.g. ["eu"]) this tenant's requests may be served in; empty: any.
    residency: list[str] = []
    # Pinned priority class (None: the request header, then the default).
    priority: str | None = None
    requests_per_min: PositiveInt | None = None
    tokens_per_min: PositiveInt | None = None
    # Prefix-cache salt sent to tokenmill backends (default: derived from the name).
    cache_salt: str | None = None
    # May a request fall back to the model's fallback when its pools are all down.
    allow_downgrade: bool = False

    @field_validator("api_key_sha256")
    @classmethod
    def _hex(cls, value: list[str]) -> list[str]:
        for digest in value:
            if not _SHA256.match(digest):
                raise ValueError(f"{digest[:12]!r}... must be a lowercase hex sha256 digest (64 characters)")
        return value


class AuthConfig(_Frozen):
    # Tenant for requests without an API key (None: such requests get 401).
    anonymous_tenant: str | None = None


class CacheConfig(_Frozen):
    enabled: bool = True
    ttl_s: PositiveFloat = 300.0
    # Memory cache: most entries kept (least recently used go first).
    max_entries: PositiveInt = 10_000
    # Responses larger than this are not cached (memory and Redis).
    max_entry_bytes: PositiveInt = 1 << 20


class HealthConfig(_Frozen):
    interval_s: PositiveFloat = 1.0
    timeout_s: PositiveFloat = 1.0
    # Consecutive failures (active or passive) that open a replica's circuit.
    failure_threshold: PositiveInt = 3
    # Seconds an open circuit waits before it lets one trial request through.
    open_s: PositiveFloat = 5.0


class GatewayConfig(_Frozen):
    gateway: GatewaySection = GatewaySection()
    regions: dict[str, RegionConfig]
    models: list[ModelConfig]
    pools: list[PoolConfig]
    priorities: PrioritiesConfig = PrioritiesConfig()
    degradation: list[DegradationStep] = []
    tiers: TiersConfig | None = None
    tenants: list[TenantConfig] = []
    auth: AuthConfig = AuthConfig()
    cache: CacheConfig = CacheConfig()
    # redis://host:port/db: shared response cache and rate limits (None: in memory).
    redis_url: Annotated[str, Field(pattern=r"^rediss?://")] | None = None
    health: HealthConfig = HealthConfig()

    @model_validator(mode="after")
    def _references(self) -> GatewayConfig:
        _unique("models", [m.name for m in self.models])
        _unique("pools", [p.name for p in self.pools])
        _unique("tenants", [t.name for t in self.tenants])
        models = {m.name for m in self.models}
        zones = {r.residency for r in self.regions.values()}
        if self.gateway.region is not None and self.gateway.region not in self.regions:
            raise ValueError(f"gateway.region {self.gateway.region!r} is not a declared region")
        for name, region in self.regions.items():
            for other in region.neighbors:
                if other not in self.regions:
                    raise ValueError(f"regions.{name}.neighbors: unknown region {other!r}")
        for model in self.models:
            if model.fallback is not None and model.fallback not in models:
                raise ValueError(f"models: {model.name!r} falls back to unknown model {model.fallback!r}")
        for i, pool in enumerate(self.pools):
            if pool.model not in models:
                raise ValueError(f"pools[{i}].model: unknown model {pool.model!r}; models are {sorted(models)}")
            if pool.region not in self.regions:
                raise ValueError(f"pools[{i}].region: unknown region {pool.region!r}; regions are {sorted(self.regions)}")
        classes = set(self.priorities.classes)
        for i, step in enumerate(self.degradation):
            for cls in step.classes:
                if cls not in classes:
                    raise ValueError(f"degradation[{i}].classes: unknown class {cls!r}")
            if step.action == "smaller_tier" and self.tiers is None:
                raise ValueError(f"degradation[{i}]: smaller_tier needs a tiers section")
        if self.tiers is not None:
            if self.tiers.alias in models:
                raise ValueError(f"tiers.alias {self.tiers.alias!r} is also a model name")
            for tier, model_name in self.tiers.models.items():
                if model_name not in models:
                    raise ValueError(f"tiers.models.{tier}: unknown model {model_name!r}")
        for i, tenant in enumerate(self.tenants):
            for zone in tenant.residency:
                if zone not in zones:
                    raise ValueError(f"tenants[{i}].residency: unknown zone {zone!r}; zones are {sorted(zones)}")
            if tenant.priority is not None and tenant.priority not in classes:
                raise ValueError(f"tenants[{i}].priority: unknown class {tenant.priority!r}")
        tenants = {t.name for t in self.tenants}
        if self.auth.anonymous_tenant is not None and self.auth.anonymous_tenant not in tenants:
            raise ValueError(f"auth.anonymous_tenant {self.auth.anonymous_tenant!r} is not a tenant")
        return self


def _unique(section: str, names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"{section}: duplicate name {name!r}")
        seen.add(name)


def parse_config(data: Any, source: str = "<config>") -> GatewayConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: " + "; ".join(_describe(e) for e in exc.errors())) from None


def load_config(path: str | Path) -> GatewayConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML/JSON{where}: {getattr(exc, 'problem', exc)}") from None
    return parse_config(data, str(path))


def _describe(error: Any) -> str:
    """`pools[0].backends[1].url: String should match pattern ...`."""
    parts: list[str] = []
    for item in error["loc"]:
        if isinstance(item, int):
            parts[-1:] = [f"{parts[-1]}[{item}]" if parts else f"[{item}]"]
        else:
            parts.append(str(item))
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"{'.'.join(parts)}: {message}" if parts else message
