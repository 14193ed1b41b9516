"""Expected errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Raised anywhere while a request is planned or forwarded, answered by the app with the
status, the caller-facing message and any headers (Retry-After on 429s). Anything else is
a bug: the app logs it with the request id and answers 500.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


class GatewayError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _ERROR_TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def body_bytes(self) -> bytes:
        return json.dumps(self.body()).encode()


def shed(message: str, retry_after_s: int, code: str) -> GatewayError:
    return GatewayError(429, message, code=code, headers={"Retry-After": str(retry_after_s)})
