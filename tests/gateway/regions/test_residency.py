from __future__ import annotations

import pytest

from tokenmill.gateway.config import RegionConfig
from tokenmill.gateway.errors import GatewayError
from tokenmill.gateway.regions.residency import Residency

REGIONS = {
    "us-east": RegionConfig(residency="us", neighbors=["eu-west"]),
    "eu-west": RegionConfig(residency="eu", neighbors=["eu-north", "us-east"]),
    "eu-north": RegionConfig(residency="eu", neighbors=["eu-west"]),
}


def test_allowed_regions_by_tenant_zone_and_header() -> None:
    r = Residency(REGIONS, home_region="eu-west")
    assert r.allowed([], None) == ["us-east", "eu-west", "eu-north"]
    assert r.allowed(["eu"], None) == ["eu-west", "eu-north"]
    assert r.allowed([], "eu") == ["eu-west", "eu-north"]
    assert r.allowed(["eu", "us"], "us") == ["us-east"]


def test_header_can_only_narrow() -> None:
    r = Residency(REGIONS, home_region=None)
    with pytest.raises(GatewayError) as forbidden:
        r.allowed(["eu"], "us")
    assert forbidden.value.status == 403
    with pytest.raises(GatewayError) as unknown:
        r.allowed([], "mars")
    assert unknown.value.status == 400 and "'mars'" in unknown.value.message


def test_nearest_first_from_client_region_else_home() -> None:
    r = Residency(REGIONS, home_region="eu-west")
    everywhere = ["us-east", "eu-west", "eu-north"]
    assert r.nearest_first(everywhere, None) == ["eu-west", "eu-north", "us-east"]
    assert r.nearest_first(everywhere, "us-east") == ["us-east", "eu-west", "eu-north"]
    assert r.nearest_first(["eu-west", "eu-north"], "us-east") == ["eu-west", "eu-north"]
    assert r.nearest_first(everywhere, "unknown") == ["eu-west", "eu-north", "us-east"]
    assert Residency(REGIONS, None).nearest_first(everywhere, None) == everywhere
