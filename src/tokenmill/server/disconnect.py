"""Run a non-streaming call unless the client goes away first.

After the body has been read, the ASGI `receive` channel only ever yields
`http.disconnect`. One task waits for it next to the work; if it comes first, the work
is cancelled, which aborts its engine requests (see generation.py) within one step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Reached on completion, on disconnect, and when this handler is itself cancelled.
        watch_task.cancel()
        await asyncio.gather(watch_task, return_exceptions=True)
        if not work_task.done():
            work_task.cancel()
            await asyncio.gather(work_task, return_exceptions=True)
    if work_task.cancelled():
        raise ClientDisconnected()
    return work_task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
