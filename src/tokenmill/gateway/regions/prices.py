"""Price table: what a region charges per 1M tokens, by UTC hour.

Each region has a base price and optional hour ranges ("0-6": 0.4, end exclusive) that
override it; the first matching range wins. Batch traffic goes to the cheapest allowed
region at the hour it arrives.
"""

from __future__ import annotations

from collections.abc import Mapping

from tokenmill.gateway.config import RegionConfig


class PriceTable:
    def __init__(self, regions: Mapping[str, RegionConfig]) -> None:
        self._prices: dict[str, tuple[float, list[tuple[int, int, float]]]] = {}
        for name, region in regions.items():
            ranges = []
            for span, price in region.hours.items():
                start, end = (int(x) for x in span.split("-"))
                ranges.append((start, end, price))
            self._prices[name] = (region.price, ranges)

    def price(self, region: str, hour: int) -> float:
        if not 0 <= hour < 24:
            raise ValueError(f"hour must be in [0, 24), got {hour}")
        base, ranges = self._prices[region]
        for start, end, price in ranges:
            if start <= hour < end:
                return price
        return base

    def cheapest_first(self, regions: list[str], hour: int) -> list[str]:
        """Regions by price at `hour`; ties keep the given (nearest-first) order."""
        return sorted(regions, key=lambda r: self.price(r, hour))
