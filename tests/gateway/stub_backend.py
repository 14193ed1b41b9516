"""A fast scripted OpenAI-compatible backend for gateway tests and benchmarks/gateway.py.

    python tests/gateway/stub_backend.py --port 9001 [--name a] [--delay-s 0.0]

Answers chat/completions/embeddings at once (or after `delay_s`), streams `stream_chunks`
content chunks, serves /health, /ready and /metrics like a tokenmill server, and records
every generation request it received. Its behaviour is changed at run time by
`POST /stub/config` (any of: delay_s, status, ready, break_after_chunks, logprob, content)
and read by `GET /stub/requests` (the bodies received, in order).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Any

from aiohttp import web


class Stub:
    def __init__(self, name: str, delay_s: float) -> None:
        self.name = name
        self.settings: dict[str, Any] = {
            "delay_s": delay_s,
            "status": 200,
            "ready": True,
            "break_after_chunks": None,
            "logprob": -0.1,
            "content": f"hello from {name}",
            "stream_chunks": 3,
            "chunk_delay_s": 0.0,
        }
        self.requests: list[dict[str, Any]] = []
        self.num_running = 0

    def answer(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        content = self.settings["content"]
        usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
        logprob = self.settings["logprob"]
        if path.endswith("/embeddings"):
            return {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [0.5, 0.25]}],
                    "model": body.get("model"), "usage": {"prompt_tokens": 5, "total_tokens": 5}}
        if path.endswith("/chat/completions"):
            logprobs = {"content": [{"token": "x", "logprob": logprob, "bytes": None, "top_logprobs": []}] * 3}
            choice = {"index": 0, "message": {"role": "assistant", "content": content},
                      "logprobs": logprobs if body.get("logprobs") else None, "finish_reason": "stop"}
            return {"id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": body.get("model"),
                    "choices": [choice], "usage": usage, "served_by": self.name}
        logprobs = {"tokens": ["x"] * 3, "token_logprobs": [logprob] * 3, "top_logprobs": None, "text_offset": [0, 1, 2]}
        choice = {"index": 0, "text": content, "logprobs": logprobs if body.get("logprobs") is not None else None,
                  "finish_reason": "stop"}
        return {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": body.get("model"),
                "choices": [choice], "usage": usage, "served_by": self.name}

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        s = self.settings
        self.num_running += 1
        try:
            if s["delay_s"]:
                await asyncio.sleep(s["delay_s"])
            if s["status"] != 200:
                error = {"error": {"message": f"stub {self.name} says {s['status']}", "type": "server_error",
                                   "param": None, "code": None}}
                return web.json_response(error, status=s["status"])
            if not body.get("stream"):
                return web.Response(body=json.dumps(self.answer(request.path, body)).encode(),
                                    content_type="application/json")
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for i in range(s["stream_chunks"]):
                if s["break_after_chunks"] is not None and i == s["break_after_chunks"]:
                    # Die like a SIGKILLed replica: the connection drops mid-stream.
                    assert request.transport is not None
                    request.transport.abort()
                    return out
                chunk = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "model": body.get("model"),
                         "choices": [{"index": 0, "delta": {"content": f"{self.name}-{i} "}, "finish_reason": None}]}
                await out.write(f"data: {json.dumps(chunk)}\n\n".encode())
                if s["chunk_delay_s"]:
                    await asyncio.sleep(s["chunk_delay_s"])
            usage = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "choices": [],
                     "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}
            await out.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
            await out.write_eof()
            return out
        finally:
            self.num_running -= 1


def build(stub: Stub) -> web.Application:
    app = web.Application()

    async def ready(request: web.Request) -> web.Response:
        ok = stub.settings["ready"]
        return web.json_response({"status": "ready" if ok else "loading"}, status=200 if ok else 503)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def metrics(request: web.Request) -> web.Response:
        text = (f'tokenmill:num_requests_running{{model_name="stub"}} {float(stub.num_running)}\n'
                f'tokenmill:num_requests_waiting{{model_name="stub"}} 0.0\n')
        return web.Response(text=text)

    async def configure(request: web.Request) -> web.Response:
        changes = await request.json()
        unknown = set(changes) - set(stub.settings)
        if unknown:
            return web.json_response({"unknown": sorted(unknown)}, status=400)
        stub.settings.update(changes)
        return web.json_response(stub.settings)

    async def requests(request: web.Request) -> web.Response:
        return web.json_response(stub.requests)

    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        app.router.add_post(path, stub.generate)
    app.router.add_get("/ready", ready)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/stub/config", configure)
    app.router.add_get("/stub/requests", requests)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default=None)
    parser.add_argument("--delay-s", type=float, default=0.0)
    args = parser.parse_args()
    stub = Stub(args.name or f"stub{args.port}", args.delay_s)
    import uvloop

    print(f"stub {stub.name} pid {os.getpid()} on {args.port}", flush=True)
    web.run_app(build(stub), host="127.0.0.1", port=args.port, access_log=None, print=None,
                loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
