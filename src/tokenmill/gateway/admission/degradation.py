"""Graceful degradation under overload, in configured steps.

Fleet load is in-flight requests over slots of the routable replicas the request could go
to. Every configured step whose `at_load` the load has reached and whose classes include
the request's applies, in increasing `at_load`: `cap_max_tokens` lowers the request's
max_tokens to the cap, `smaller_tier` moves a tiered request one tier down, `shed` answers
429. The router applies the result; each applied step is counted in metrics and named in
the `x-tokenmill-degraded` response header.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.gateway.config import DegradationStep


@dataclass(frozen=True)
class Degradation:
    # Applied steps' actions, in order.
    actions: tuple[str, ...] = ()
    max_tokens_cap: int | None = None
    smaller_tier: bool = False
    shed: bool = False


class Degrader:
    def __init__(self, steps: Sequence[DegradationStep]) -> None:
        self.steps = sorted(steps, key=lambda s: s.at_load)

    def decide(self, cls: str, load: float) -> Degradation:
        actions: list[str] = []
        cap: int | None = None
        smaller = shed = False
        for step in self.steps:
            if load < step.at_load or cls not in step.classes:
                continue
            actions.append(step.action)
            if step.action == "cap_max_tokens":
                assert step.max_tokens is not None
                cap = step.max_tokens if cap is None else min(cap, step.max_tokens)
            elif step.action == "smaller_tier":
                smaller = True
            else:
                shed = True
        return Degradation(tuple(actions), cap, smaller, shed)


def cap_max_tokens(payload: dict[str, object], cap: int) -> None:
    """Lower (never raise) every max-tokens field; set one when the request had none."""
    present = [f for f in ("max_tokens", "max_completion_tokens") if payload.get(f) is not None]
    for field in present:
        value = payload[field]
        if isinstance(value, int) and value > cap:
            payload[field] = cap
    if not present:
        payload["max_tokens"] = cap
