"""The server's knobs (the engine's own live in the engine's config)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSettings:
    # The name clients put in `model`; any other name is a 404.
    served_model_name: str
    # The model as given on the command line (reported as `root` by /v1/models).
    model: str = ""
    # When set, every /v1 route and /tokenize, /detokenize need `Authorization: Bearer KEY`.
    api_key: str | None = None
    # Most requests admitted but not yet producing tokens; beyond it a request gets 429.
    max_queue_len: int = 512
    # Seconds a client is told to wait (Retry-After) after a 429.
    retry_after_s: int = 1
    # Largest request body accepted; beyond it 413.
    max_body_bytes: int = 8 * 1024 * 1024
    # /health fails when the engine has work but has not stepped for this long.
    health_stall_timeout_s: float = 60.0
    # On SIGTERM, in-flight requests get this long to finish before they are cancelled.
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        if self.max_queue_len < 0:
            raise ValueError("max_queue_len must be >= 0")
        if self.retry_after_s < 0:
            raise ValueError("retry_after_s must be >= 0")
        if self.max_body_bytes < 1:
            raise ValueError("max_body_bytes must be >= 1")
        if self.health_stall_timeout_s <= 0:
            raise ValueError("health_stall_timeout_s must be > 0")
        if self.drain_timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")
