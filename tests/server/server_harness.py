"""Test helpers: a free port, uvicorn in a thread, SSE parsing."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ThreadedServer:
    """uvicorn on a free localhost port, in a thread (signals stay with pytest)."""

    def __init__(self, app: FastAPI) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def parse_sse(text: str) -> list[Any]:
    """`data: {...}\\n\\n` frames -> decoded payloads; the terminator stays "[DONE]"."""
    assert text.endswith("\n\n"), text[-50:]
    events = []
    for frame in text.split("\n\n")[:-1]:
        assert frame.startswith("data: "), frame
        payload = frame[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
