"""The lean upstream client against a raw socket server that writes scripted bytes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from tokenmill.gateway.upstream_client import UpstreamError, UpstreamPool

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
    return head + await reader.readexactly(length)


async def serve(script: Script) -> tuple[asyncio.Server, str, list[int]]:
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            await script(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", connections


def test_content_length_responses_reuse_one_connection() -> None:
    seen: list[bytes] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for i in range(3):
            seen.append(await read_request(reader))
            body = f'{{"n": {i}}}'.encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(body)).encode() + b"\r\n\r\n" + body)
            await writer.drain()

    async def scenario() -> list[tuple[int, str, bytes]]:
        server, url, connections = await serve(script)
        pool = UpstreamPool(connect_timeout_s=2)
        out = []
        for _ in range(3):
            resp = await pool.post(url, "/v1/chat/completions", b'{"a":1}')
            out.append((resp.status, resp.headers["content-type"], await resp.read()))
        assert len(connections) == 1
        pool.close()
        server.close()
        return out

    assert asyncio.run(scenario()) == [(200, "application/json", b'{"n": %d}' % i) for i in range(3)]
    assert seen[0].startswith(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert seen[0].endswith(b'Content-Length: 7\r\n\r\n{"a":1}')


def test_chunked_stream_split_anywhere() -> None:
    raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n7;ext=1\r\n, world\r\n0\r\n\r\n"

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        for i in range(len(raw)):  # one byte at a time
            writer.write(raw[i:i + 1])
            await writer.drain()
            await asyncio.sleep(0)
        await read_request(reader)
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()

    async def scenario() -> tuple[bytes, int, int]:
        server, url, connections = await serve(script)
        pool = UpstreamPool(connect_timeout_s=2)
        resp = await pool.post(url, "/s", b"{}")
        parts = []
        while chunk := await resp.readany():
            parts.append(chunk)
        second = await pool.post(url, "/s", b"{}")  # the connection went back to the pool
        assert await second.read() == b""
        pool.close()
        server.close()
        return b"".join(parts), second.status, len(connections)

    assert asyncio.run(scenario()) == (b"hello, world", 204, 1)


def test_connection_lost_mid_body_is_an_error_and_eof_framing_works() -> None:
    async def broken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()

    async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it")
        await writer.drain()

    async def nothing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async def scenario() -> None:
        pool = UpstreamPool(connect_timeout_s=2)
        server, url, _ = await serve(broken)
        resp = await pool.post(url, "/x", b"{}")
        assert await resp.readany() == b"partial"
        with pytest.raises(UpstreamError, match="closed mid-body"):
            await resp.readany()
        server.close()
        server, url, _ = await serve(until_close)
        assert await (await pool.post(url, "/x", b"{}")).read() == b"all of it"
        server.close()
        server, url, _ = await serve(nothing)
        with pytest.raises(UpstreamError, match="connection closed by the upstream"):
            await pool.post(url, "/x", b"{}")
        server.close()
        with pytest.raises(OSError):
            await pool.post("http://127.0.0.1:1", "/x", b"{}")
        with pytest.raises(ValueError, match="plain http only"):
            await pool.post("https://example.com", "/x", b"{}")

    asyncio.run(scenario())
