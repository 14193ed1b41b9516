"""Admin API: list, add and remove replicas at run time (the control plane's door).

    GET    /admin/backends                      every replica, its pool, load and circuit
    POST   /admin/backends  {"pool", "url", ...} add one (fields of a config backend)
    DELETE /admin/backends?pool=P&name=N        remove one (name or url); in-flight ones finish

Guarded by `Authorization: Bearer KEY` whose sha256 is `gateway.admin_api_key_sha256`;
without that setting the admin API answers 404, so it is off unless configured.
"""

from __future__ import annotations

import hmac
import time
from typing import TYPE_CHECKING

from aiohttp import web
from pydantic import ValidationError

from tokenmill.gateway.config import BackendConfig
from tokenmill.gateway.errors import GatewayError
from tokenmill.gateway.tenants.tenants import hash_key

if TYPE_CHECKING:
    from tokenmill.gateway.app import Gateway


def add_admin_routes(app: web.Application, gateway: Gateway) -> None:
    expected = gateway.config.gateway.admin_api_key_sha256

    def check(request: web.Request) -> None:
        if expected is None:
            raise GatewayError(404, "the admin API is off (set gateway.admin_api_key_sha256)")
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(hash_key(key.strip()), expected):
            raise GatewayError(401, "admin API key required", code="invalid_api_key")

    async def list_backends(request: web.Request) -> web.Response:
        check(request)
        now = time.monotonic()
        return web.json_response({"backends": [b.describe(now) for p in gateway.pools for b in p.backends]})

    async def add_backend(request: web.Request) -> web.Response:
        check(request)
        try:
            body = await request.json()
        except ValueError:
            raise GatewayError(400, "the body must be JSON") from None
        if not isinstance(body, dict) or not isinstance(body.get("pool"), str):
            raise GatewayError(400, "the body must be an object with 'pool' and the backend's fields", param="pool")
        pool = gateway.pool(body.pop("pool"))
        try:
            config = BackendConfig.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(x) for x in first["loc"])
            raise GatewayError(400, f"{field}: {first['msg']}", param=field) from None
        try:
            backend = pool.add(config)
        except ValueError as exc:
            raise GatewayError(409, str(exc)) from None
        assert gateway.health is not None
        await gateway.health.check(backend)
        gateway.admission.wake()
        return web.json_response(backend.describe(time.monotonic()), status=201)

    async def remove_backend(request: web.Request) -> web.Response:
        check(request)
        pool = gateway.pool(request.query.get("pool", ""))
        name = request.query.get("name", "")
        try:
            backend = pool.remove(name)
        except KeyError:
            raise GatewayError(404, f"pool {pool.name!r} has no backend {name!r}") from None
        return web.json_response(backend.describe(time.monotonic()))

    app.router.add_get("/admin/backends", list_backends)
    app.router.add_post("/admin/backends", add_backend)
    app.router.add_delete("/admin/backends", remove_backend)
