"""Admission control: a bounded waiting queue, beyond which requests get 429.

A request counts as queued from the moment it is admitted until its first output arrives
(waiting for a slot, or prefilling). The engine's own waiting count lags by a step, so the
queue length used is the larger of the two. A full queue is answered at once with 429 and
`Retry-After` instead of growing latency without bound.
"""

from __future__ import annotations

from tokenmill.server.errors import APIError


class AdmissionTicket:
    """One admitted request's place in the queue; `started()` leaves it, `release()` ends it."""

    def __init__(self, controller: AdmissionController) -> None:
        self._controller = controller
        self._queued = True

    def started(self) -> None:
        """The request produced its first output: it no longer waits."""
        if self._queued:
            self._queued = False
            self._controller._num_queued -= 1

    def release(self) -> None:
        """The request ended (finished, failed or aborted). Idempotent."""
        self.started()


class AdmissionController:
    def __init__(self, max_queue_len: int, retry_after_s: int) -> None:
        self.max_queue_len = max_queue_len
        self.retry_after_s = retry_after_s
        self._num_queued = 0

    @property
    def num_queued(self) -> int:
        return self._num_queued

    def admit(self, num_engine_waiting: int) -> AdmissionTicket:
        """Admit one request or raise a 429 when the queue is full."""
        if max(self._num_queued, num_engine_waiting) >= self.max_queue_len:
            raise APIError(
                429,
                f"The server's request queue is full ({self.max_queue_len} waiting); retry later",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        self._num_queued += 1
        return AdmissionTicket(self)
