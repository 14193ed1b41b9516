"""What one server instance holds: the engine (once loaded), settings, metrics, admission.

The engine may arrive after the app starts serving (weights load and warm up while
/health and /ready already answer); until then every engine-backed route is a 503.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from tokenmill.engine.protocol import EngineClient
from tokenmill.engine.stats import SchedulerStats
from tokenmill.server.admission import AdmissionController
from tokenmill.server.errors import APIError
from tokenmill.server.health import HealthMonitor
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.settings import ServerSettings


class ServerState:
    def __init__(self, engine: EngineClient | None, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = ServerMetrics(settings.served_model_name, self._stats, self._grammar_compile_times)
        self.admission = AdmissionController(settings.max_queue_len, settings.retry_after_s)
        self.health = HealthMonitor(settings.health_stall_timeout_s)
        # Set on SIGTERM: readiness fails and new work is refused while in-flight drains.
        self.draining = False

    def attach_engine(self, engine: EngineClient) -> None:
        """Hand over a loaded (and warmed-up) engine."""
        self.engine = engine

    def ready_engine(self) -> EngineClient:
        """The engine, if it can take a request now; otherwise a 503."""
        verdict = self.health.readiness(
            None if self.engine is None else self.engine.health(), self.draining
        )
        if self.engine is None or not verdict.ok:
            raise APIError(
                503,
                f"Service unavailable: {verdict.detail}",
                code=verdict.status,
                headers={"Retry-After": str(max(1, self.settings.retry_after_s))},
            )
        return self.engine

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is the served name (a missing model means the served one)."""
        if model is not None and model != self.settings.served_model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist. Served: `{self.settings.served_model_name}`",
                param="model",
                code="model_not_found",
            )

    def _stats(self) -> SchedulerStats | None:
        return None if self.engine is None else self.engine.stats()

    def _grammar_compile_times(self) -> list[float]:
        return [] if self.engine is None else list(self.engine.drain_grammar_compile_times())


def get_state(source: Request | FastAPI) -> ServerState:
    app = source.app if isinstance(source, Request) else source
    state = app.state.tokenmill
    assert isinstance(state, ServerState)
    return state
