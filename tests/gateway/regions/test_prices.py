from __future__ import annotations

import pytest

from tokenmill.gateway.config import RegionConfig
from tokenmill.gateway.regions.prices import PriceTable


def table() -> PriceTable:
    return PriceTable({
        "eu-west": RegionConfig(residency="eu", price=1.0, hours={"0-6": 0.4}),
        "eu-north": RegionConfig(residency="eu", price=0.7),
        "us-east": RegionConfig(residency="us", price=0.9, hours={"18-24": 0.5}),
    })


def test_price_by_hour() -> None:
    t = table()
    assert [t.price("eu-west", h) for h in (0, 5, 6, 23)] == [0.4, 0.4, 1.0, 1.0]
    assert [t.price("us-east", h) for h in (17, 18, 23)] == [0.9, 0.5, 0.5]
    with pytest.raises(ValueError):
        t.price("eu-west", 24)


def test_cheapest_first_varies_by_hour_and_keeps_order_on_ties() -> None:
    t = table()
    regions = ["eu-west", "eu-north", "us-east"]
    assert t.cheapest_first(regions, 3) == ["eu-west", "eu-north", "us-east"]
    assert t.cheapest_first(regions, 12) == ["eu-north", "us-east", "eu-west"]
    assert t.cheapest_first(regions, 20) == ["us-east", "eu-north", "eu-west"]
