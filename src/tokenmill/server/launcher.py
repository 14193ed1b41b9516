"""Run the app under uvicorn, load the engine alongside, drain on SIGTERM, exit 0.

Start-up: uvicorn starts serving at once (probes answer while weights load), and the
engine is brought up concurrently by `load_engine` (load in a thread, warm up), then
attached. A load failure stops the server with exit code 1.

Shutdown on SIGTERM/SIGINT, in order:
1. readiness fails at once (the state is marked draining; new work gets 503);
2. uvicorn stops accepting connections and waits for in-flight responses, streams
   included, up to `drain_timeout_s`; what is left is then cancelled, which aborts its
   engine requests;
3. the engine is shut down and the process returns 0. (uvicorn's stock signal capture
   re-raises the signal after shutting down, which would end the process with -15; this
   server does not.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import threading
from collections.abc import Awaitable, Callable, Generator
from types import FrameType

import uvicorn
from fastapi import FastAPI

from tokenmill.engine.protocol import EngineClient
from tokenmill.server.request_context import access_logger
from tokenmill.server.state import ServerState, get_state

logger = logging.getLogger(__name__)

EngineLoader = Callable[[], Awaitable[EngineClient]]


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self._state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._state.draining = True
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


async def serve(
    app: FastAPI,
    host: str,
    port: int,
    *,
    load_engine: EngineLoader | None = None,
    drain_timeout_s: float = 30.0,
    log_level: str = "info",
) -> int:
    """Serve until a signal; returns the process exit code."""
    state = get_state(app)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        access_log=False,
        log_level=log_level,
        timeout_graceful_shutdown=math.ceil(drain_timeout_s),
        lifespan="on",
    )
    server = _DrainingServer(config, state)
    exit_code = 0

    async def bring_up(loader: EngineLoader) -> None:
        nonlocal exit_code
        try:
            engine = await loader()
        except Exception:
            logger.exception("engine failed to load; stopping the server")
            exit_code = 1
            server.should_exit = True
            return
        state.attach_engine(engine)
        logger.info("engine attached; ready to serve %s", state.settings.served_model_name)

    loading = None if load_engine is None else asyncio.create_task(bring_up(load_engine))
    try:
        await server.serve()
    finally:
        if loading is not None and not loading.done():
            loading.cancel()
            await asyncio.gather(loading, return_exceptions=True)
        if state.engine is not None:
            await state.engine.shutdown()
    if not server.started and exit_code == 0:
        exit_code = 1  # could not bind the port, or the lifespan failed
    return exit_code


def configure_logging(level: str = "info") -> None:
    """Plain lines for the app's logs, bare JSON lines for the access log."""
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not access_logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        access_logger.addHandler(handler)
        access_logger.propagate = False
    access_logger.setLevel(logging.INFO)


def run(
    app: FastAPI,
    host: str,
    port: int,
    *,
    load_engine: EngineLoader | None = None,
    drain_timeout_s: float = 30.0,
    log_level: str = "info",
) -> int:
    configure_logging(log_level)
    return asyncio.run(
        serve(app, host, port, load_engine=load_engine, drain_timeout_s=drain_timeout_s, log_level=log_level)
    )
