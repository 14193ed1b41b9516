"""Residency: the regions a request may ever be served in, and in which order to try them.

A tenant's residency zones (e.g. ["eu"]) and the request's `x-tokenmill-residency` header
each restrict the allowed regions to those whose zone they name; the header can only narrow
what the tenant allows, and an empty intersection is a 403, not a silent widening. Nothing
outside the allowed set is ever tried, even when all of it is down (then 503).

Within the allowed set, regions are ordered nearest first from the client's region (the
`x-tokenmill-client-region` header, else the gateway's own region): that region, then its
configured neighbors in order, then the rest in file order. Spill-over follows this order
when the nearest region is saturated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tokenmill.gateway.config import RegionConfig
from tokenmill.gateway.errors import GatewayError

RESIDENCY_HEADER = "x-tokenmill-residency"
CLIENT_REGION_HEADER = "x-tokenmill-client-region"


class Residency:
    def __init__(self, regions: Mapping[str, RegionConfig], home_region: str | None) -> None:
        self._regions = dict(regions)
        self.home_region = home_region
        self.zones = {r.residency for r in regions.values()}

    def allowed(self, tenant_zones: Sequence[str], header: str | None) -> list[str]:
        zones = set(tenant_zones) if tenant_zones else set(self.zones)
        if header:
            asked = {z.strip() for z in header.split(",") if z.strip()}
            unknown = asked - self.zones
            if unknown:
                raise GatewayError(400, f"unknown residency zone {sorted(unknown)[0]!r}; zones are {sorted(self.zones)}",
                                   param=RESIDENCY_HEADER)
            zones &= asked
            if not zones:
                raise GatewayError(403, f"residency {header!r} is outside what this tenant allows",
                                   code="residency_forbidden")
        return [name for name, region in self._regions.items() if region.residency in zones]

    def nearest_first(self, allowed: Sequence[str], client_region: str | None) -> list[str]:
        origin = client_region if client_region in self._regions else self.home_region
        order: list[str] = []
        if origin is not None:
            order = [origin, *self._regions[origin].neighbors]
        order += [r for r in self._regions if r not in order]
        allowed_set = set(allowed)
        return [r for r in order if r in allowed_set]
