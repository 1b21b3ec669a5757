"""A small keep-alive HTTP/1.1 client for one origin: the direct transport's upstream pool.

Why not aiohttp: its compiled parser was never the cost, its Python layers around it were
(``ClientSession._request``, the connector, ``ClientRequest``/``ClientResponse``, a writer task per
request): ~145 Python frames per upstream request of the ~730 the gateway added, ~30 here
(benchmarks/gateway.py profile). Here a request is one ``transport.write`` and the response is parsed by httptools' compiled
llhttp straight into the callbacks below. It does only what the gateway needs: ``POST`` to one origin,
no proxies (``DirectOpenAIClient`` keeps aiohttp where one applies), no redirects, no pipelining.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Mapping
from typing import cast
from urllib.parse import urlsplit

import httptools

# Pause reading past this much unread body (a slow consumer behind a fast upstream), so that memory
# stays bounded; reading resumes when the consumer takes the buffered pieces.
HIGH_WATER = 1 << 20


class HttpProtocolError(Exception):
    """The upstream answered with bytes that are not an HTTP/1.1 response."""


class _Conn(asyncio.Protocol):
    """One connection, at most one request on it at a time (no pipelining).

    The protocol callbacks (from the event loop and from httptools) only store what arrived and wake
    the one waiting consumer; all waiting happens in ``headers_ready`` / ``next_piece``."""

    # Set by connection_made, which runs before create_connection hands the connection over: every
    # connection this module holds has one. (Typed so, the request path needs no typing.cast, a Python call.)
    transport: asyncio.Transport

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.pool: list[_Conn] | None = None  # the idle list while this connection is in it
        self.lost = False
        self._reset()

    def _reset(self) -> None:
        self.active = False
        self.status = 0
        self.headers: dict[str, str] = {}
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.got_bytes = False
        self.error: Exception | None = None
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None

    # -- the request side ---------------------------------------------------------------------------
    def start(self, data: bytes, deadline: float) -> None:
        self.active = True
        self.timer = asyncio.get_running_loop().call_at(deadline, self._timed_out)
        self.transport.write(data)

    async def _wait(self) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        await self.waiter

    async def headers_ready(self) -> None:
        while not self.headers_done:
            if self.error is not None:
                raise self.error
            await self._wait()

    async def next_piece(self) -> bytes | None:
        """The body bytes that arrived since the last call (waiting for some); None at its end."""
        while True:
            if self.chunks:
                piece = self.chunks[0] if len(self.chunks) == 1 else b"".join(self.chunks)
                self.chunks = []
                self.buffered = 0
                if self.paused:
                    self.paused = False
                    self.transport.resume_reading()
                return piece
            if self.error is not None:
                raise self.error
            if self.complete:
                return None
            await self._wait()

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and self.error is None and not self.lost

    def close(self) -> None:
        self._cancel_timer()
        if not self.lost:
            # Mid-response (cancelled, failed): drop the socket now, with whatever it still had to send.
            if self.complete:
                self.transport.close()
            else:
                self.transport.abort()

    # -- event-loop callbacks -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # once per connection

    def data_received(self, data: bytes) -> None:
        if not self.active:  # bytes nobody asked for (on an idle connection): it cannot be trusted
            self.transport.abort()
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(HttpProtocolError(f"invalid HTTP response from the upstream: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._cancel_timer()
        if self.pool is not None:  # closed while idle: leave the pool now rather than on the next pop
            self.pool.remove(self)
            self.pool = None
        if self.active and not self.complete and self.error is None:
            te = self.headers.get("transfer-encoding", "").lower()
            if self.headers_done and "content-length" not in self.headers and "chunked" not in te:
                self.complete = True  # a body delimited by the close (no length, not chunked)
            else:
                when = "mid-response" if self.got_bytes else "before responding"
                self.error = ConnectionError(f"the upstream closed the connection {when}")
        self._wake()

    # -- httptools callbacks ------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.complete:  # a second response to one request
            raise HttpProtocolError("unexpected bytes after the response")

    def on_header(self, name: bytes, value: bytes) -> None:
        key, text = name.decode("latin-1").lower(), value.decode("latin-1")
        self.headers[key] = f"{self.headers[key]}, {text}" if key in self.headers else text

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        self.complete = True
        self._cancel_timer()
        self._wake()

    # -- helpers ------------------------------------------------------------------------------------
    def _wake(self) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, exc: Exception) -> None:
        if self.error is None:
            self.error = exc
        self.close()
        self._wake()

    def _timed_out(self) -> None:
        self.timer = None
        self._fail(TimeoutError("the upstream request timed out"))

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class Response:
    """Status, headers (lower-cased names) and the body of one response.

    Read it to the end (``read`` or ``pieces``) or ``release`` it: only a response read to its end on
    a keep-alive connection gives the connection back to the pool; anything else closes it."""

    def __init__(self, client: Http1Client, conn: _Conn) -> None:
        self.status = conn.status
        self.headers = conn.headers
        self._client = client
        self._conn: _Conn | None = conn

    async def read(self) -> bytes:
        """The whole body (the connection is released, whatever happens)."""
        conn = self._conn
        if conn is None:
            raise RuntimeError("the response was already released")
        parts: list[bytes] = []
        try:
            while (piece := await conn.next_piece()) is not None:
                parts.append(piece)
        finally:
            self.release()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives, in pieces of any size (an SSE stream's lines are split by the caller)."""
        conn = self._conn
        if conn is None:
            raise RuntimeError("the response was already released")
        while (piece := await conn.next_piece()) is not None:
            yield piece
        self.release()

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._client._release(conn)


def _clean(text: str) -> str:
    if "\r" in text or "\n" in text:  # a line break would end the header early (request smuggling)
        raise ValueError("a line break in an HTTP request header")
    return text


class Http1Client:
    """Keep-alive HTTP/1.1 ``POST``s to one origin (``base_url``, with its path as a prefix)."""

    def __init__(
        self,
        base_url: str,
        headers: Mapping[str, str] | None = None,
        *,
        max_idle: int = 256,
        connect_timeout: float = 10.0,
        total_timeout: float = 600.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = (ssl_context or ssl.create_default_context()) if parts.scheme == "https" else None
        self._prefix = _clean(parts.path.rstrip("/"))
        self._defaults = {k.lower(): f"{_clean(k)}: {_clean(v)}\r\n" for k, v in (headers or {}).items()}
        self._host_line = f"Host: {_clean(parts.netloc.rpartition('@')[2])}\r\n"
        self._default_head = self._host_line + "".join(self._defaults.values())
        self._max_idle = max_idle
        self._connect_timeout = connect_timeout
        self._total_timeout = total_timeout
        self._idle: list[_Conn] = []  # LIFO: the most recently used connection is the least likely stale
        self._closed = False

    async def post(self, path: str, body: bytes, headers: Mapping[str, str] | None = None) -> Response:
        """Send ``body`` (one write) and wait for the response's status and headers."""
        head = self._default_head
        if headers:  # a per-request header replaces the default of the same name
            merged = dict(self._defaults)
            merged.update((k.lower(), f"{_clean(k)}: {_clean(v)}\r\n") for k, v in headers.items())
            head = self._host_line + "".join(merged.values())
        data = (f"POST {self._prefix}{_clean(path)} HTTP/1.1\r\n{head}Content-Length: {len(body)}\r\n\r\n"
                .encode() + body)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._total_timeout  # one budget for connecting, both tries and the body
        for attempt in (1, 2):
            conn = None
            while self._idle and conn is None and attempt == 1:  # the retry goes on a fresh connection
                conn = self._idle.pop()
                conn.pool = None
                if conn.transport.is_closing():  # closed, connection_lost not yet run
                    conn = None
            reused = conn is not None
            if conn is None:
                conn = await self._connect(loop, deadline)
            conn.start(data, deadline)
            try:
                await conn.headers_ready()
            except ConnectionError:
                conn.close()
                # The server closed a reused connection without a byte of answer. POST is not idempotent:
                # RFC 9112 (9.3.1.1) lets a client retry it only where the request was likely never
                # applied, and a server closing an idle kept-alive connection (its timeout racing our
                # write) has not read it. A server that read it and then closed without answering looks
                # the same from here; that duplicate risk exists anyway, since the gateway would answer
                # 502 and the OpenAI SDKs retry a 502. (aiohttp retries only idempotent methods.) Any
                # other loss (a byte received, a fresh connection) is the caller's error.
                if reused and attempt == 1 and not conn.got_bytes:
                    continue
                raise
            except BaseException:  # cancelled, timed out, not HTTP: the connection is in an unknown state
                conn.close()
                raise
            return Response(self, conn)
        raise AssertionError("unreachable")

    async def _connect(self, loop: asyncio.AbstractEventLoop, deadline: float) -> _Conn:
        timeout = min(self._connect_timeout, deadline - loop.time())
        _, conn = await asyncio.wait_for(
            loop.create_connection(_Conn, self._host, self._port, ssl=self._ssl), timeout)
        return conn

    def _release(self, conn: _Conn) -> None:
        if conn.reusable() and not self._closed and len(self._idle) < self._max_idle:
            conn._reset()
            conn.pool = self._idle
            self._idle.append(conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        """Close the idle connections; those in use close when their response is released."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.pool = None
            conn.close()
