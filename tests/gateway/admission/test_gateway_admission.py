from __future__ import annotations

import asyncio

import pytest

from tokenmill.gateway.admission.admission import Admission, NoReplica
from tokenmill.gateway.admission.priorities import Priorities
from tokenmill.gateway.backends.backend import Backend
from tokenmill.gateway.backends.breaker import CircuitBreaker
from tokenmill.gateway.config import PrioritiesConfig
from tokenmill.gateway.errors import GatewayError


def setup(batch_queue: int = 8, timeout: float = 5.0, shed: list[tuple[str, str]] | None = None) -> tuple[Admission, Backend]:
    config = PrioritiesConfig.model_validate({"classes": {
        "interactive": {"engine_priority": 0, "inflight_share": 1.0, "max_queue": 8, "queue_timeout_s": timeout},
        "batch": {"engine_priority": 10, "inflight_share": 1.0, "max_queue": batch_queue, "queue_timeout_s": timeout,
                  "retry_after_s": 7},
    }})
    backend = Backend("http://a:1", "a", "tokenmill", "p", "r", 1, CircuitBreaker(3, 5.0))
    sheds = shed if shed is not None else []
    return Admission(Priorities(config), on_shed=lambda cls, why: sheds.append((cls, why))), backend


def selector(backend: Backend, routable: bool = True):  # type: ignore[no-untyped-def]
    def select() -> tuple[Backend | None, bool]:
        return (backend if backend.has_room("interactive", 1.0) and backend.num_inflight == 0 else None), routable
    return select


def test_freed_slot_goes_to_interactive_before_batch_that_waited_longer() -> None:
    async def scenario() -> list[str]:
        admission, backend = setup()
        first = await admission.acquire("batch", selector(backend), 1)
        order: list[str] = []

        async def want(cls: str) -> None:
            got = await admission.acquire(cls, selector(backend), 1)
            order.append(cls)
            await asyncio.sleep(0)
            admission.release(got, cls, 1)

        batch = asyncio.create_task(want("batch"))
        await asyncio.sleep(0.01)
        interactive = asyncio.create_task(want("interactive"))
        await asyncio.sleep(0.01)
        assert admission.num_waiting == {"interactive": 1, "batch": 1}
        admission.release(first, "batch", 1)
        await asyncio.gather(batch, interactive)
        assert admission.num_waiting == {"interactive": 0, "batch": 0}
        return order

    assert asyncio.run(scenario()) == ["interactive", "batch"]


def test_full_queue_and_timeout_shed_with_retry_after() -> None:
    async def scenario() -> tuple[GatewayError, GatewayError]:
        sheds: list[tuple[str, str]] = []
        admission, backend = setup(batch_queue=1, timeout=0.05, shed=sheds)
        await admission.acquire("interactive", selector(backend), 1)
        waiting = asyncio.create_task(admission.acquire("batch", selector(backend), 1))
        await asyncio.sleep(0.01)
        with pytest.raises(GatewayError) as full:
            await admission.acquire("batch", selector(backend), 1)
        with pytest.raises(GatewayError) as timed_out:
            await waiting
        assert sheds == [("batch", "queue_full"), ("batch", "queue_timeout")]
        return full.value, timed_out.value

    full, timed_out = asyncio.run(scenario())
    assert (full.status, full.code, full.headers) == (429, "shed_queue_full", {"Retry-After": "7"})
    assert (timed_out.status, timed_out.code) == (429, "shed_queue_timeout")


def test_nothing_routable_fails_at_once() -> None:
    async def scenario() -> None:
        admission, _ = setup()
        with pytest.raises(NoReplica):
            await admission.acquire("interactive", lambda: (None, False), 1)

    asyncio.run(scenario())
