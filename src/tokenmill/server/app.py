"""The FastAPI app: routes, middleware, error handlers, over one EngineClient.

    request -> RequestContext (request id, access log, last-resort 500)
            -> BodySizeLimit (413) -> router (API key on protected routes) -> handler

`build_app` takes the engine, or None when it is still loading: the launcher attaches it
with `get_state(app).attach_engine(engine)` once warmed up, and until then the probes
answer (/health 200 "starting", /ready 503) and engine-backed routes are 503.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenmill.engine.protocol import EngineClient
from tokenmill.server.auth import require_api_key
from tokenmill.server.body_limit import BodySizeLimitMiddleware
from tokenmill.server.errors import install_error_handlers
from tokenmill.server.metrics import METRICS_CONTENT_TYPE
from tokenmill.server.request_context import RequestContextMiddleware
from tokenmill.server.responses import ModelCard, ModelList
from tokenmill.server.serving_chat import create_chat_completion
from tokenmill.server.serving_completions import create_completion
from tokenmill.server.serving_embeddings import create_embedding
from tokenmill.server.serving_tokenize import detokenize, tokenize
from tokenmill.server.settings import ServerSettings
from tokenmill.server.state import ServerState, get_state


def build_app(engine: EngineClient | None, settings: ServerSettings) -> FastAPI:
    state = ServerState(engine, settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.draining = False
        yield
        # Lifespan shutdown comes after uvicorn has drained the connections.
        state.draining = True

    app = FastAPI(title="tokenmill", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.tokenmill = state
    install_error_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=settings.max_body_bytes)
    # Added last, so it is the outermost of the two.
    app.add_middleware(RequestContextMiddleware)
    app.include_router(_api_router(time.time()))
    app.include_router(_probe_router())
    return app


def _api_router(created: float) -> APIRouter:
    router = APIRouter(dependencies=[Depends(require_api_key)])
    router.add_api_route("/v1/chat/completions", create_chat_completion, methods=["POST"])
    router.add_api_route("/v1/completions", create_completion, methods=["POST"])
    router.add_api_route("/v1/embeddings", create_embedding, methods=["POST"])
    router.add_api_route("/tokenize", tokenize, methods=["POST"])
    router.add_api_route("/detokenize", detokenize, methods=["POST"])

    def card(state: ServerState) -> ModelCard:
        return ModelCard(
            id=state.settings.served_model_name,
            created=int(created),
            root=state.settings.model or state.settings.served_model_name,
            max_model_len=None if state.engine is None else state.engine.max_model_len,
        )

    @router.get("/v1/models")
    async def list_models(request: Request) -> Response:
        models = ModelList(data=[card(get_state(request))])
        return JSONResponse(models.model_dump(mode="json"))

    @router.get("/v1/models/{model:path}")
    async def retrieve_model(model: str, request: Request) -> Response:
        state = get_state(request)
        state.check_model(model)
        return JSONResponse(card(state).model_dump(mode="json"))

    return router


def _probe_router() -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health(request: Request) -> Response:
        state = get_state(request)
        verdict = state.health.liveness(None if state.engine is None else state.engine.health())
        return JSONResponse(verdict.body(), status_code=200 if verdict.ok else 503)

    @router.get("/ready")
    async def ready(request: Request) -> Response:
        state = get_state(request)
        health = None if state.engine is None else state.engine.health()
        verdict = state.health.readiness(health, state.draining)
        return JSONResponse(verdict.body(), status_code=200 if verdict.ok else 503)

    @router.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(get_state(request).metrics.render(), media_type=METRICS_CONTENT_TYPE)

    return router

