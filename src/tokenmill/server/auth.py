"""API-key check: `Authorization: Bearer KEY`, compared in constant time.

A FastAPI dependency on the protected routers (/v1/* and /tokenize, /detokenize); the
probes (/health, /ready) and /metrics stay open for orchestrators and scrapers.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from tokenmill.server.errors import APIError
from tokenmill.server.state import get_state


async def require_api_key(request: Request) -> None:
    expected = get_state(request).settings.api_key
    if expected is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, supplied = header.partition(" ")
    # compare_digest on bytes: time depends on the length only, not on where they differ.
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        supplied.strip().encode(), expected.encode()
    ):
        raise APIError(
            401,
            "Incorrect or missing API key. Send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
