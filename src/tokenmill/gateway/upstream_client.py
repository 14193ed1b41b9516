"""A lean HTTP/1.1 client for the hot path: keep-alive connections to each replica.

The gateway forwards every request upstream, so the client's cost per request is half the
gateway's budget; a general client (redirects, cookies, tracing, proxies) spends several
times what forwarding JSON to a known replica needs. This one does only that: a pool of idle
keep-alive connections per replica (asyncio Protocols), one write per request, and a
response read as a head (status line and headers) then a body framed by Content-Length,
chunked transfer encoding, or the connection's end. A connection goes back to the pool only
after its response was read to the end; an unread or broken one is closed. Idle connections
older than `idle_s` are dropped before the server's keep-alive timeout can race a reuse.

Failures are `UpstreamError` (closed or reset before or during a response, bad framing) or
OSError from connecting; timeouts are the caller's (asyncio.timeout around the request).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import cast
from urllib.parse import urlsplit


class UpstreamError(Exception):
    """The upstream connection failed or answered something that is not HTTP/1.1."""


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.closed = False
        self.error: Exception | None = None
        self.last_used = time.monotonic()
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        self._wake()

    def eof_received(self) -> bool:
        self.closed = True
        self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.error = exc
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait_for_data(self) -> None:
        """Return once more bytes arrived or the connection ended."""
        if self.closed:
            raise UpstreamError(f"connection closed by the upstream ({self.error or 'EOF'})")
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class UpstreamResponse:
    def __init__(self, pool: UpstreamPool, key: str, conn: _Connection) -> None:
        self._pool = pool
        self._key = key
        self._conn = conn
        self.status = 0
        self.headers: dict[str, str] = {}
        self._length: int | None = None  # Content-Length framing: bytes left
        self._chunked = False
        self._chunk_left = 0  # chunked framing: bytes left of the current chunk
        self._done = False
        self._released = False

    async def read_head(self) -> None:
        conn = self._conn
        while (end := conn.buffer.find(b"\r\n\r\n")) < 0:
            await conn.wait_for_data()
        head = bytes(conn.buffer[:end]).decode("latin-1").split("\r\n")
        del conn.buffer[: end + 4]
        parts = head[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise UpstreamError(f"not an HTTP/1.1 response: {head[0][:80]!r}")
        self.status = int(parts[1])
        for line in head[1:]:
            name, _, value = line.partition(":")
            self.headers[name.strip().lower()] = value.strip()
        if "chunked" in self.headers.get("transfer-encoding", "").lower():
            self._chunked = True
        elif "content-length" in self.headers:
            self._length = int(self.headers["content-length"])
            self._done = self._length == 0
        elif self.status in (204, 304):
            self._done = True
        if self._done:
            self._finish()

    async def readany(self) -> bytes:
        """The next body bytes available; b"" once the body is complete."""
        conn = self._conn
        while not self._done:
            data = self._take()
            if data:
                return data
            if self._done:
                break
            if conn.closed:
                if self._length is None and not self._chunked:
                    self._done = True  # framed by the connection's end
                    break
                raise UpstreamError(f"connection closed mid-body ({conn.error or 'EOF'})")
            await conn.wait_for_data()
        return b""

    async def read(self) -> bytes:
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return b"".join(parts)

    def _take(self) -> bytes:
        buf = self._conn.buffer
        if self._length is not None:
            data = bytes(buf[: self._length])
            del buf[: len(data)]
            self._length -= len(data)
            if self._length == 0:
                self._done = True
                self._finish()
            return data
        if not self._chunked:
            data = bytes(buf)
            buf.clear()
            return data
        out = bytearray()
        while True:
            if self._chunk_left:
                piece = buf[: self._chunk_left]
                out += piece
                del buf[: len(piece)]
                self._chunk_left -= len(piece)
                if self._chunk_left:
                    break
                continue
            line_end = buf.find(b"\r\n")
            if line_end < 0:
                break
            if line_end == 0:  # the CRLF after a chunk's data
                del buf[:2]
                continue
            size_text = bytes(buf[:line_end]).split(b";")[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise UpstreamError(f"bad chunk size {size_text[:20]!r}") from None
            if size == 0:
                if buf.find(b"\r\n\r\n", line_end) < 0:
                    break  # wait for the trailer's end
                del buf[: buf.find(b"\r\n\r\n", line_end) + 4]
                self._done = True
                self._finish()
                break
            del buf[: line_end + 2]
            self._chunk_left = size
        return bytes(out)

    def _finish(self) -> None:
        if self._released:
            return
        self._released = True
        reusable = not self._conn.closed and self.headers.get("connection", "").lower() != "close"
        self._pool.give_back(self._key, self._conn, reusable and not self._conn.buffer)

    def close(self) -> None:
        """Abandon the response: a connection with unread body cannot be reused."""
        if not self._released:
            self._released = True
            self._conn.close()


class UpstreamPool:
    def __init__(self, connect_timeout_s: float, idle_s: float = 4.0, max_idle_per_host: int = 256) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.idle_s = idle_s
        self.max_idle_per_host = max_idle_per_host
        self._idle: dict[str, deque[_Connection]] = {}
        self._hosts: dict[str, tuple[str, int, bytes]] = {}

    def _host(self, base_url: str) -> tuple[str, int, bytes]:
        host = self._hosts.get(base_url)
        if host is None:
            parts = urlsplit(base_url)
            if parts.scheme != "http" or parts.hostname is None:
                raise ValueError(f"the fast client speaks plain http only, not {base_url!r}")
            port = parts.port or 80
            host = self._hosts[base_url] = (parts.hostname, port, f"{parts.hostname}:{port}".encode())
        return host

    async def _connection(self, base_url: str) -> _Connection:
        idle = self._idle.get(base_url)
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.last_used < self.idle_s:
                return conn
            conn.close()
        hostname, port, _ = self._host(base_url)
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.connect_timeout_s):
            _, conn = await loop.create_connection(_Connection, hostname, port)
        return conn

    async def post(self, base_url: str, path: str, body: bytes) -> UpstreamResponse:
        """Send `body` as JSON and read the response's head; the body is read from it."""
        conn = await self._connection(base_url)
        host = self._host(base_url)[2]
        assert conn.transport is not None
        conn.transport.write(
            b"POST " + path.encode() + b" HTTP/1.1\r\nHost: " + host
            + b"\r\nContent-Type: application/json\r\nAccept: */*\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        response = UpstreamResponse(self, base_url, conn)
        try:
            await response.read_head()
        except BaseException:
            response.close()
            raise
        return response

    def give_back(self, base_url: str, conn: _Connection, reusable: bool) -> None:
        idle = self._idle.setdefault(base_url, deque())
        if reusable and len(idle) < self.max_idle_per_host:
            conn.last_used = time.monotonic()
            idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
