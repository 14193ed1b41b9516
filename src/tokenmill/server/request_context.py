"""Per-request context: the request id, the access log line, the last-resort 500.

A pure ASGI middleware (it must not buffer streaming bodies). For every HTTP request it:

1. takes the caller's `x-request-id` when it is sane (<= 128 printable characters),
   else makes one, exposes it through `current_request_id()` and returns it in the
   `x-request-id` response header;
2. catches anything the app lets escape: before the response has started it answers an
   OpenAI-shaped 500; either way it logs the traceback with the request id. A client that
   disconnected before its answer was ready is logged as status 499, and nothing is sent;
3. writes one JSON access-log line: request id, method, path, status, duration, client.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from contextvars import ContextVar

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.server.disconnect import ClientDisconnected
from tokenmill.server.errors import APIError

REQUEST_ID_HEADER = "x-request-id"
access_logger = logging.getLogger("tokenmill.server.access")
logger = logging.getLogger(__name__)

_request_id: ContextVar[str | None] = ContextVar("tokenmill_request_id", default=None)


def current_request_id() -> str | None:
    return _request_id.get()


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _incoming_request_id(scope) or uuid.uuid4().hex
        token = _request_id.set(request_id)
        start = time.monotonic()
        status = 0
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                headers = list(message.get("headers", []))
                headers.append((REQUEST_ID_HEADER.encode(), request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except ClientDisconnected:
            status = 499
        except Exception:
            logger.exception("unhandled error (request id %s)", request_id)
            if not started:
                error = APIError(500, "Internal server error", code="internal_error")
                await error.response()(scope, receive, send_with_id)
            else:
                status = 500
        finally:
            _request_id.reset(token)
            client = scope.get("client")
            access_logger.info(
                json.dumps(
                    {
                        "event": "access",
                        "request_id": request_id,
                        "method": scope.get("method"),
                        "path": scope.get("path"),
                        "status": status,
                        "duration_ms": round((time.monotonic() - start) * 1000, 2),
                        "client": f"{client[0]}:{client[1]}" if client else None,
                    }
                )
            )


def _incoming_request_id(scope: Scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == REQUEST_ID_HEADER.encode():
            text = value.decode("latin-1")
            if 0 < len(text) <= 128 and text.isprintable():
                return text
    return None
