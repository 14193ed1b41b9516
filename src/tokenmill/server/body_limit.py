"""Reject request bodies over a size bound with 413, before they are buffered.

A declared Content-Length over the bound is answered at once. A chunked body is counted
as it arrives; the chunk that crosses the bound raises BodyTooLarge out of `receive`,
which the handler's `request.body()` propagates and the error handler turns into a 413.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.server.errors import APIError


class BodyTooLarge(APIError):
    def __init__(self, limit: int) -> None:
        super().__init__(
            413, f"Request body exceeds the limit of {limit} bytes", code="request_too_large"
        )


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_body_bytes:
                await BodyTooLarge(self.max_body_bytes).response()(scope, receive, send)
                return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        await self.app(scope, counting_receive, send)
