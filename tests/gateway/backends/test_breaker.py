from __future__ import annotations

import pytest

from tokenmill.gateway.backends.breaker import BreakerState, CircuitBreaker


def test_opens_after_threshold_consecutive_failures() -> None:
    b = CircuitBreaker(failure_threshold=3, open_s=5.0)
    b.record_failure(0.0)
    b.record_failure(0.1)
    assert b.state is BreakerState.CLOSED and b.num_consecutive_failures == 2
    b.record_success(0.2)
    assert b.num_consecutive_failures == 0
    for t in (1.0, 1.1, 1.2):
        b.record_failure(t)
    assert b.state is BreakerState.OPEN
    assert not b.can_route(1.3)
    assert not b.can_route(6.1)  # 4.9 s after opening
    assert b.can_route(6.2)
    assert b.state is BreakerState.HALF_OPEN


def test_half_open_lets_one_trial_through_then_closes_on_success() -> None:
    b = CircuitBreaker(1, 2.0)
    b.record_failure(0.0)
    assert b.state is BreakerState.OPEN
    assert b.can_route(2.0)
    b.on_dispatch(2.0)
    assert not b.can_route(2.1)  # the trial is in flight
    b.record_success(2.5)
    assert b.state is BreakerState.CLOSED and b.can_route(2.5)


def test_half_open_failure_reopens_for_another_period() -> None:
    b = CircuitBreaker(1, 2.0)
    b.record_failure(0.0)
    b.on_dispatch(2.0)
    b.record_failure(2.5)
    assert b.state is BreakerState.OPEN
    assert not b.can_route(4.4)
    assert b.can_route(4.5)


def test_success_while_open_does_not_close_before_the_cooldown() -> None:
    b = CircuitBreaker(1, 2.0)
    b.record_failure(0.0)
    b.record_success(1.0)
    assert b.state is BreakerState.OPEN
    b.record_success(2.0)  # the probe after the cooldown
    assert b.state is BreakerState.CLOSED


def test_bad_parameters() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(0, 1.0)
    with pytest.raises(ValueError):
        CircuitBreaker(1, 0.0)
