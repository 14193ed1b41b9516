from __future__ import annotations

import pytest

from tokenmill.gateway.admission.priorities import Priorities
from tokenmill.gateway.config import PrioritiesConfig
from tokenmill.gateway.errors import GatewayError


def test_pinned_then_header_then_default() -> None:
    p = Priorities(PrioritiesConfig())
    assert p.order == ["interactive", "batch"]
    assert p.resolve("batch", {"x-tokenmill-priority": "interactive"}) == "batch"
    assert p.resolve(None, {"x-tokenmill-priority": "batch"}) == "batch"
    assert p.resolve(None, {}) == "interactive"
    assert (p["batch"].engine_priority, p["batch"].inflight_share, p["batch"].cheapest_region) == (10, 0.5, True)
    with pytest.raises(GatewayError) as bad:
        p.resolve(None, {"x-tokenmill-priority": "urgent"})
    assert bad.value.status == 400
