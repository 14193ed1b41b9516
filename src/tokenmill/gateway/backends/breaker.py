"""Circuit breaker per replica: closed -> open -> half-open -> closed.

Failures come from two places: passive (a request to the replica errored or timed out)
and active (a health probe failed). `failure_threshold` consecutive failures open the
circuit and take the replica out of routing. After `open_s` the circuit is half-open: one
trial request at a time may go through (or the next health probe), and its success closes
the circuit while its failure opens it again for another `open_s`. Any success in the closed
state resets the failure count. Time is passed in, so tests drive it exactly.
"""

from __future__ import annotations

import enum


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(self, failure_threshold: int, open_s: float) -> None:
        if failure_threshold < 1 or open_s <= 0:
            raise ValueError("failure_threshold must be >= 1 and open_s > 0")
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self.state = BreakerState.CLOSED
        self.num_consecutive_failures = 0
        self._opened_at = 0.0
        self._trial_in_flight = False

    def can_route(self, now: float) -> bool:
        """May a request go to this replica now (without taking the half-open trial)?"""
        self._advance(now)
        if self.state is BreakerState.CLOSED:
            return True
        return self.state is BreakerState.HALF_OPEN and not self._trial_in_flight

    def on_dispatch(self, now: float) -> None:
        """A request was sent; in half-open it is the one trial."""
        self._advance(now)
        if self.state is BreakerState.HALF_OPEN:
            self._trial_in_flight = True

    def record_success(self, now: float) -> None:
        self._advance(now)
        if self.state is BreakerState.OPEN:
            return  # still cooling down: a late success of an old request does not reopen it
        self.state = BreakerState.CLOSED
        self.num_consecutive_failures = 0
        self._trial_in_flight = False

    def record_failure(self, now: float) -> None:
        self._advance(now)
        self._trial_in_flight = False
        if self.state is BreakerState.HALF_OPEN:
            self._open(now)
            return
        self.num_consecutive_failures += 1
        if self.state is BreakerState.CLOSED and self.num_consecutive_failures >= self.failure_threshold:
            self._open(now)

    def _open(self, now: float) -> None:
        self.state = BreakerState.OPEN
        self._opened_at = now

    def _advance(self, now: float) -> None:
        if self.state is BreakerState.OPEN and now - self._opened_at >= self.open_s:
            self.state = BreakerState.HALF_OPEN
            self._trial_in_flight = False
