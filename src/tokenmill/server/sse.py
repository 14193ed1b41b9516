"""Server-sent events: `data: <json>\n\n` frames, ending with `data: [DONE]`.

`SSEResponse` runs a cleanup callback however the response ends. Starlette cancels the
body iterator when the client disconnects, and an async generator that is cancelled
before its first step never runs its own `finally`; the callback closes that gap, so a
disconnect always aborts the engine request and releases its admission ticket.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenmill.server.errors import APIError
from tokenmill.server.request_context import current_request_id

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def sse_event(payload: BaseModel | dict[str, Any], *, exclude: set[str] | None = None) -> str:
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json(exclude=exclude)
    else:
        data = json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def error_event(exc: Exception) -> str:
    """An error after the stream has started: the status is sent, so it goes in an event.

    ValueError is the engine refusing the request (a 400); anything else is a 500 and
    is logged with the request id.
    """
    if isinstance(exc, APIError):
        error = exc
    elif isinstance(exc, ValueError):
        error = APIError(400, str(exc))
    else:
        logger.exception("stream failed (request id %s)", current_request_id())
        error = APIError(500, "Internal server error", code="internal_error")
    return sse_event(error.body())


class SSEResponse(StreamingResponse):
    def __init__(
        self,
        content: AsyncIterator[str],
        on_close: Callable[[], Awaitable[None]],
        headers: dict[str, str] | None = None,
    ) -> None:
        base = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=base | (headers or {}))
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()
