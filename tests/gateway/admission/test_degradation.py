from __future__ import annotations

from typing import Any

from tokenmill.gateway.admission.degradation import Degradation, Degrader, cap_max_tokens
from tokenmill.gateway.config import DegradationStep

STEPS = [
    DegradationStep(at_load=0.95, action="shed", classes=["batch"]),
    DegradationStep(at_load=0.7, action="cap_max_tokens", classes=["batch"], max_tokens=64),
    DegradationStep(at_load=0.8, action="smaller_tier", classes=["batch", "interactive"]),
    DegradationStep(at_load=0.9, action="cap_max_tokens", classes=["batch", "interactive"], max_tokens=256),
]


def test_steps_apply_by_load_and_class_in_order() -> None:
    d = Degrader(STEPS)
    assert d.decide("batch", 0.5) == Degradation()
    assert d.decide("batch", 0.7) == Degradation(("cap_max_tokens",), 64)
    assert d.decide("interactive", 0.85) == Degradation(("smaller_tier",), None, smaller_tier=True)
    assert d.decide("batch", 0.99) == Degradation(
        ("cap_max_tokens", "smaller_tier", "cap_max_tokens", "shed"), 64, smaller_tier=True, shed=True)
    assert d.decide("interactive", 0.99) == Degradation(("smaller_tier", "cap_max_tokens"), 256, smaller_tier=True)


def test_cap_max_tokens_lowers_never_raises() -> None:
    payload: dict[str, Any] = {"max_tokens": 500, "max_completion_tokens": 10}
    cap_max_tokens(payload, 64)
    assert payload == {"max_tokens": 64, "max_completion_tokens": 10}
    empty: dict[str, Any] = {}
    cap_max_tokens(empty, 64)
    assert empty == {"max_tokens": 64}
