"""An in-memory OpenAI-compatible streaming server with scripted timings, for exact metrics.

`ScriptedTransport` is an httpx transport: each request gets the SSE events of
`script(body)`, a list of (seconds, payload) pairs. Before an event is handed to the
client, the shared `FakeClock` advances by its seconds, so the client's clock readings
(and so TTFT, ITL, E2E) are exact. Between events the stream yields to the event loop, so
concurrent requests interleave; `max_in_flight` records the most open at once (from the
request to the client closing the response).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

# (seconds to advance the clock before the event, payload: a chunk dict or "[DONE]")
Script = list[tuple[float, Any]]


@dataclass
class FakeClock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def completion_chunk(text: str) -> dict[str, Any]:
    return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": None}]}


def chat_chunk(delta: dict[str, str]) -> dict[str, Any]:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def usage_chunk(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    return {"choices": [], "usage": usage}


@dataclass
class ScriptedTransport(httpx.AsyncBaseTransport):
    script: Callable[[dict[str, Any]], Script]
    clock: FakeClock = field(default_factory=FakeClock)
    status_code: int = 200
    bodies: list[dict[str, Any]] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(await request.aread())
        self.bodies.append(body)
        self.urls.append(str(request.url))
        self.headers.append(dict(request.headers))
        if self.status_code != 200:
            return httpx.Response(self.status_code, json={"error": {"message": "scripted failure"}})
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return httpx.Response(200, stream=_Stream(self, self.script(body)))


class _Stream(httpx.AsyncByteStream):
    def __init__(self, transport: ScriptedTransport, script: Script) -> None:
        self.transport, self.script = transport, script

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for seconds, payload in self.script:
            await asyncio.sleep(0)
            self.transport.clock.now += seconds
            data = payload if payload == "[DONE]" else json.dumps(payload)
            yield f"data: {data}\n\n".encode()

    async def aclose(self) -> None:
        # httpx closes the stream when the client's `async with client.stream(...)` ends.
        self.transport.in_flight -= 1
