"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Two layers (STYLE habit 14). Expected errors are raised as `APIError` anywhere in a handler
and become a clean response with the caller's message and the right status. Everything
else is caught by the request-context middleware, logged with the request id and answered
with a 500; the engine is never touched by either.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

# Status -> OpenAI error type.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An expected failure, answered with `status_code` and OpenAI's error body."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    @property
    def type(self) -> str:
        return _ERROR_TYPES.get(self.status_code, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=self.headers)


def invalid(message: str, param: str | None = None) -> APIError:
    """A 400 for a value the caller sent."""
    return APIError(400, message, param=param, code="invalid_value" if param else None)


def from_validation_errors(errors: Sequence[Any]) -> APIError:
    """Turn pydantic's error list into one 400 that names the offending field.

    A union field reports one error per member (`stop` -> `stop.str`, `stop.list[str]`);
    the deepest error is the most specific one, so it is the one reported.
    """
    if not errors:
        return invalid("Invalid request body")
    error = max(errors, key=lambda e: len(e.get("loc", ())))
    kind = error.get("type", "")
    loc = tuple(error.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    param = param_from_loc(loc)
    if kind == "json_invalid":
        return APIError(400, f"Malformed JSON body: {error.get('msg', '')}", code="invalid_json")
    if kind == "extra_forbidden":
        return APIError(
            400,
            f"Unrecognized request argument supplied: {param}",
            param=param,
            code="unknown_parameter",
        )
    if kind == "missing":
        return APIError(400, f"Missing required parameter: '{param}'", param=param, code="missing_required_parameter")
    message = str(error.get("msg", "Invalid value"))
    if not param:
        return invalid(f"Invalid request body: {message}")
    return invalid(f"Invalid value for '{param}': {message}", param)


def param_from_loc(loc: Sequence[str | int]) -> str | None:
    """`("messages", 0, "content", "list[TextContentPart]", 1, "type")` -> `messages[0].content[1].type`.

    Union member tags (`str`, `list[int]`, ...) are not fields and are dropped.
    """
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.isidentifier() and part not in _UNION_TAGS:
            out += f".{part}" if out else part
    return out or None


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "function-after"})


def install_error_handlers(app: FastAPI) -> None:
    """Map APIError, framework validation errors and unknown routes to OpenAI's shape."""

    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError | ValidationError)
        return from_validation_errors(list(exc.errors())).response()

    async def on_http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        error = APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers)
        return error.response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(ValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
