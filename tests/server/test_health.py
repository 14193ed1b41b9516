"""HealthMonitor: a hung engine is not healthy; an idle one that just got work is."""

from __future__ import annotations

from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from tokenmill.engine.protocol import EngineHealth
from tokenmill.server.health import HealthMonitor


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def health(*, alive: bool = True, ready: bool = True, last: float | None = None, work: bool = False) -> EngineHealth:
    return EngineHealth(alive=alive, ready=ready, last_step_time=last, has_work=work, error=None if alive else "died")


def test_liveness_states() -> None:
    clock = Clock()
    monitor = HealthMonitor(stall_timeout_s=10.0, clock=clock)
    assert monitor.liveness(None).status == "starting"
    assert monitor.liveness(health(alive=False)).body() == {"status": "dead", "detail": "died"}
    # Idle for an hour: healthy.
    assert monitor.liveness(health(last=clock.now - 3600)).ok
    # Work arrives: the stall clock starts now, not at the last (old) step.
    assert monitor.liveness(health(last=clock.now - 3600, work=True)).ok
    clock.now += 9.0
    assert monitor.liveness(health(last=clock.now - 3609, work=True)).ok
    clock.now += 2.0
    verdict = monitor.liveness(health(last=clock.now - 3611, work=True))
    assert (verdict.ok, verdict.status) == (False, "stalled")
    # It steps again: healthy.
    assert monitor.liveness(health(last=clock.now - 1, work=True)).ok
    # Work and no step ever (None): judged from when work was first seen.
    monitor = HealthMonitor(stall_timeout_s=10.0, clock=clock)
    assert monitor.liveness(health(work=True)).ok
    clock.now += 11
    assert not monitor.liveness(health(work=True)).ok


def test_readiness_states() -> None:
    monitor = HealthMonitor(stall_timeout_s=10.0)
    assert monitor.readiness(None, draining=False).status == "starting"
    assert monitor.readiness(health(), draining=True).status == "draining"
    assert monitor.readiness(health(alive=False), draining=False).status == "dead"
    assert monitor.readiness(health(ready=False), draining=False).status == "not_ready"
    assert monitor.readiness(health(), draining=False).ok


def test_health_route_fails_for_a_dead_or_hung_engine(make_client: object, engine: FakeEngine) -> None:
    client: TestClient = make_client(engine, health_stall_timeout_s=0.05)  # type: ignore[operator]
    assert client.get("/health").status_code == 200
    engine.alive = False
    response = client.get("/health")
    assert (response.status_code, response.json()["status"]) == (503, "dead")
    assert client.get("/ready").status_code == 503
    engine.alive = True
    # A request sits in the engine, which never steps.
    engine.paused = True
    engine.pinned_last_step_time = 0.0
    import threading
    import time

    worker = threading.Thread(target=lambda: client.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}))
    worker.start()
    deadline = time.monotonic() + 5
    while not engine.health().has_work and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.get("/health").status_code == 200  # work just seen
    time.sleep(0.1)
    response = client.get("/health")
    assert (response.status_code, response.json()["status"]) == (503, "stalled")
    engine.paused = False
    worker.join(5)
    assert client.get("/health").status_code == 200
